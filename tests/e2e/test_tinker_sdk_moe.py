"""A mixture-of-experts base through the whole service: an embedded stack whose pool serves `tiny-moe`
(Qwen3-MoE, LoRA on attention and every expert's gate / up / down), driven by the official Tinker SDK unchanged: two
tenants train at once and their losses fall, save_state / resume with the optimizer continues exactly, and a
sampler copy of an MoE adapter samples natively, its logprobs the trainer's forward."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from loraplex.launch.embedded import Stack
from loraplex.runtime.netutil import free_port
from loraplex.settings import Settings
from tests.helpers.sdk import LR, train
from tests.helpers.stack import create_tenants


@pytest.fixture(scope="module")
def moe_stack(tmp_path_factory):
    settings = Settings(home=tmp_path_factory.mktemp("moe-stack"), base_model="tiny-moe", slots=3, max_rank=8)
    with Stack(settings, api_port=free_port()) as running:
        yield running


@pytest.fixture(scope="module")
def keys(moe_stack):
    return create_tenants(moe_stack, "moe-alice", "moe-bob")


@pytest.fixture(scope="module")
def clients(moe_stack, keys):
    made = {name: tinker.ServiceClient(base_url=moe_stack.base_url, api_key=key) for name, key in keys.items()}
    yield made
    for client in made.values():
        client.close("success").result()


def batch(seed: int, n: int = 4, length: int = 12) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(3, 250, size=length).tolist()
        out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                               loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (length - 1)}))  # fmt: skip
    return out


def test_two_tenants_train_moe_adapters_at_once_and_resume_exactly(clients) -> None:
    alice = clients["moe-alice"].create_lora_training_client(base_model="tiny-moe", rank=8, seed=1).result()
    bob = clients["moe-bob"].create_lora_training_client(base_model="tiny-moe", rank=4, seed=2).result()
    data_a, data_b = batch(0), batch(1)
    losses_a, losses_b = [], []
    for _ in range(12):  # both in flight before either waits: the dispatcher may mix them in one step
        fa, fb = alice.forward_backward(data_a, "cross_entropy"), bob.forward_backward(data_b, "cross_entropy")
        oa, ob = alice.optim_step(LR), bob.optim_step(LR)
        losses_a.append(fa.result().metrics["loss:sum"])
        losses_b.append(fb.result().metrics["loss:sum"])
        oa.result(), ob.result()
    assert losses_a[-1] < 0.7 * losses_a[0] and losses_b[-1] < 0.7 * losses_b[0], (losses_a, losses_b)

    saved = alice.save_state("moe-12").result()
    uninterrupted = train(alice, data_a, 3)
    resumed = clients["moe-alice"].create_training_client_from_state_with_optimizer(saved.path).result()
    assert train(resumed, data_a, 3) == pytest.approx(uninterrupted, rel=1e-6)


def test_an_moe_adapter_samples_and_its_logprobs_match_the_trainer(clients, keys, moe_stack) -> None:
    """The server says the MoE base is sampleable; a sampler copy of an MoE adapter samples (greedy, then seeded at
    temperature 1), its logprobs equal the trainer's forward over the sampled tokens, and training goes on."""
    service = clients["moe-bob"]
    caps = httpx.get(f"{moe_stack.base_url}/api/v1/get_server_capabilities",
                     headers={"X-API-Key": keys["moe-bob"]}).json()  # fmt: skip
    assert caps["supported_models"] == [
        {"model_name": "tiny-moe", "max_context_length": moe_stack.settings.max_tokens_per_datum, "trainable": True,
         "sampleable": True}
    ]  # fmt: skip
    client = service.create_lora_training_client(base_model="tiny-moe", rank=4, seed=3).result()
    train(client, batch(2), 3)
    sampler = client.save_weights_and_get_sampling_client().result()
    prompt = [5, 6, 7, 40, 41]
    for params in (types.SamplingParams(max_tokens=8, temperature=0.0), types.SamplingParams(max_tokens=8, seed=4)):
        seq = sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences[0]
        assert len(seq.tokens) == len(seq.logprobs) > 0
        full = prompt + seq.tokens
        fwd = client.forward([types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                                          loss_fn_inputs={"target_tokens": full[1:]})], "cross_entropy").result()  # fmt: skip
        trainer_lp = fwd.loss_fn_outputs[0]["logprobs"].tolist()[len(prompt) - 1 :]
        np.testing.assert_allclose(seq.logprobs, trainer_lp, atol=1e-4)
    assert len(train(client, batch(2), 1)) == 1
