"""Sampling on the embedded stack with the native sampler: the Tinker SDK (a named sampler save + a sampling client,
the unnamed save_weights_and_get_sampling_client, compute_logprobs) and our client, the sampler's logprobs equal to the
trainer's forward logprobs of the same tokens, a sampler copy frozen while its adapter trains on, another tenant's 404."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from loraplex.client import Datum, ServiceClient
from loraplex.errors import NotFoundError
from tests.helpers.stack import create_tenants

PROMPT = [11, 12, 13, 14, 15]
GREEDY = types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])


@pytest.fixture(scope="module")
def keys(stack):
    return create_tenants(stack, "smp-alice", "smp-bob")


@pytest.fixture
def sdk(stack, keys):
    client = tinker.ServiceClient(base_url=stack.base_url, api_key=keys["smp-alice"])
    yield client
    client.close("success").result()


def _train(trainer, steps: int) -> None:
    tokens = list(range(20, 33))
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]})
    for _ in range(steps):
        trainer.forward_backward([datum], "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()


def test_the_sdk_samples_a_sampler_copy_and_its_logprobs_match_the_trainer(sdk) -> None:
    trainer = sdk.create_lora_training_client(base_model="tiny", rank=8, seed=3).result()
    _train(trainer, 3)
    path = trainer.save_weights_for_sampler("w1").result().path
    sampler = sdk.create_sampling_client(model_path=path)
    first = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, GREEDY).result()
    assert len(first.sequences) == 2 and first.sequences[0].tokens == first.sequences[1].tokens  # greedy
    seq = first.sequences[0]
    assert len(seq.tokens) == 8 and seq.stop_reason == "length" and len(seq.logprobs) == 8

    # The trainer's forward logprobs of the same tokens (the weights as saved): KL(sampler || trainer) ~ 0.
    full = PROMPT + seq.tokens
    fwd = trainer.forward([types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                                       loss_fn_inputs={"target_tokens": full[1:]})], "cross_entropy").result()  # fmt: skip
    trainer_lp = fwd.loss_fn_outputs[0]["logprobs"].tolist()[len(PROMPT) - 1 :]
    np.testing.assert_allclose(seq.logprobs, trainer_lp, atol=1e-4)

    _train(trainer, 4)  # the adapter trains on; the sampler copy does not move
    again = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, GREEDY).result().sequences[0]
    assert again.tokens == seq.tokens and again.logprobs == pytest.approx(seq.logprobs, abs=1e-5)

    prompt_lp = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
    assert prompt_lp[0] is None
    np.testing.assert_allclose(prompt_lp[len(PROMPT):], seq.logprobs, atol=1e-4)


def test_save_weights_and_get_sampling_client_and_seeded_sampling(sdk) -> None:
    trainer = sdk.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
    _train(trainer, 2)
    sampler = trainer.save_weights_and_get_sampling_client()
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=17, stop=[])
    a = sampler.sample(types.ModelInput.from_ints(PROMPT), 3, params).result()
    b = sampler.sample(types.ModelInput.from_ints(PROMPT), 3, params).result()
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]  # same seed, same samples
    assert all(s.sequence_id for s in a.sequences)  # the SDK stamped our sample_sequence_ids
    base = sdk.create_sampling_client(base_model="tiny")
    plain = base.sample(types.ModelInput.from_ints(PROMPT), 1, GREEDY).result().sequences[0]
    assert len(plain.tokens) == 8


def test_our_client_samples_too_and_another_tenant_cannot(stack, keys) -> None:
    with ServiceClient(stack.base_url, keys["smp-alice"]) as client:
        trainer = client.create_lora_training_client(rank=4, seed=2)
        for _ in range(2):
            trainer.forward_backward([Datum.for_next_token(list(range(40, 50)))])
            trainer.optim_step({"learning_rate": 5e-2}).result()
        sampler = trainer.save_weights_and_get_sampling_client("native-w")
        out = sampler.sample(PROMPT, num_samples=2, max_tokens=5, temperature=0.0, stop=[]).result()
        assert [len(s["tokens"]) for s in out["sequences"]] == [5, 5]
        logprobs = sampler.compute_logprobs(PROMPT).result()["prompt_logprobs"]
        assert logprobs[0] is None and len(logprobs) == len(PROMPT)
        path = sampler.model_path
    with ServiceClient(stack.base_url, keys["smp-bob"]) as bob, pytest.raises(NotFoundError):
        bob.create_sampling_client(model_path=path)
