"""The same sampling flow with the vLLM backend (`LORAPLEX_SAMPLER=vllm`, a stack of its own on the `tiny-vllm` preset):
the pool process starts a vLLM server, a sampler checkpoint reaches it as a PEFT folder loaded at run time, and the
Tinker SDK samples from it. The served adapter is the trained one: the sampled tokens' logprobs equal the trainer's
forward logprobs of the same tokens. Skipped where vllm is not installed (`make test` installs it)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm")

import tinker  # noqa: E402
from tinker import types  # noqa: E402

from loraplex.launch.embedded import Stack  # noqa: E402
from loraplex.runtime.netutil import free_port  # noqa: E402
from loraplex.settings import Settings  # noqa: E402
from tests.helpers.stack import create_tenants  # noqa: E402

PROMPT = [11, 12, 13, 14, 15]


@pytest.fixture(scope="module")
def vllm_stack(tmp_path_factory):
    settings = Settings(home=tmp_path_factory.mktemp("vllm-stack"), base_model="tiny-vllm", sampler="vllm", slots=4,
                        max_rank=16, vllm_max_loras=4)  # fmt: skip
    stack = Stack(settings, api_port=free_port()).start(timeout_s=400)  # the pool starts a vLLM server: ~25 s more
    try:
        yield stack
    finally:
        stack.stop()


def test_the_sdk_samples_through_the_vllm_backend(vllm_stack) -> None:
    key = create_tenants(vllm_stack, "vllm-alice")["vllm-alice"]
    sdk = tinker.ServiceClient(base_url=vllm_stack.base_url, api_key=key)
    try:
        trainer = sdk.create_lora_training_client(base_model="tiny-vllm", rank=8, seed=3).result()
        tokens = list(range(20, 33))
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:]})  # fmt: skip
        for _ in range(3):
            trainer.forward_backward([datum], "cross_entropy")
            trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        path = trainer.save_weights_for_sampler("w1").result().path
        sampler = sdk.create_sampling_client(model_path=path)
        greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
        out = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, greedy).result()
        seq = out.sequences[0]
        assert seq.tokens == out.sequences[1].tokens and 1 <= len(seq.tokens) <= 6

        full = PROMPT + seq.tokens
        fwd = trainer.forward([types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                                           loss_fn_inputs={"target_tokens": full[1:]})], "cross_entropy").result()  # fmt: skip
        trainer_lp = fwd.loss_fn_outputs[0]["logprobs"].tolist()[len(PROMPT) - 1 :]
        np.testing.assert_allclose(seq.logprobs, trainer_lp, atol=1e-4)  # the server runs in the pool's dtype (fp32)

        unnamed = trainer.save_weights_and_get_sampling_client()
        assert len(unnamed.sample(types.ModelInput.from_ints(PROMPT), 1, greedy).result().sequences) == 1
        base = sdk.create_sampling_client(base_model="tiny-vllm")
        assert base.sample(types.ModelInput.from_ints(PROMPT), 1, greedy).result().sequences[0].tokens
        with pytest.raises(tinker.RequestFailedError, match="top-k logprobs"):
            sampler.sample(types.ModelInput.from_ints(PROMPT), 1, greedy, topk_sample_logprobs=2).result()
    finally:
        sdk.close("success").result()


def test_the_cookbook_rl_loop_runs_to_its_end_with_the_vllm_backend(vllm_stack, tmp_path, monkeypatch) -> None:
    pytest.importorskip("tinker_cookbook")
    from tests.helpers.cookbook_rl import BATCHES, run_rl_loop

    monkeypatch.setenv("TINKER_API_KEY", create_tenants(vllm_stack, "vllm-rl")["vllm-rl"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rows = [r for r in run_rl_loop(vllm_stack, tmp_path / "rl") if "optim/kl_sample_train_v1" in r]
    assert [r["step"] for r in rows] == list(range(BATCHES))
    assert all(abs(r["optim/kl_sample_train_v1"]) < 1e-3 for r in rows), rows  # vLLM's logprobs are the trainer's
