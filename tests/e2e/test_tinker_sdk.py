"""The official Tinker SDK (tinker 0.38), unchanged, against the embedded stack: training, chunked calls, forward,
custom losses, save and resume, checkpoints through its RestClient, the session's end, and another tenant's view."""

from __future__ import annotations

import io
import tarfile

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from loraplex.client import ServiceClient
from loraplex.errors import NotFoundError
from tests.helpers.sdk import LR, train
from tests.helpers.stack import create_tenants


@pytest.fixture(scope="module")
def keys(stack):
    return create_tenants(stack, "sdk-alice", "sdk-bob")


@pytest.fixture
def alice(stack, keys):
    client = tinker.ServiceClient(base_url=stack.base_url, api_key=keys["sdk-alice"])
    yield client
    client.close("success").result()


def datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    """A next-token datum: inputs tokens[:-1], targets tokens[1:]."""
    n = len(tokens) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights if weights is not None else [1.0] * n},
    )


def batch(seed: int, n: int = 4, length: int = 12) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    return [datum(rng.integers(3, 250, size=length).tolist()) for _ in range(n)]


def logprobs(out: types.ForwardBackwardOutput) -> list[list[float]]:
    return [o["logprobs"].tolist() for o in out.loss_fn_outputs]


def flat(out: types.ForwardBackwardOutput) -> np.ndarray:
    return np.array(sum(logprobs(out), []))


def test_fifteen_cross_entropy_steps_lower_the_loss_and_loss_sum_is_the_weighted_logprob_sum(alice) -> None:
    client = alice.create_lora_training_client(base_model="tiny", rank=8, seed=1).result()
    data = batch(0)
    data[1] = datum(list(range(40, 53)), [0.5, 2.0, 0.0, 1.0, -1.0] + [1.0] * 7)  # uneven weights, one negative
    losses = []
    for _ in range(15):
        fb = client.forward_backward(data, "cross_entropy")
        optim = client.optim_step(LR)
        out = fb.result()
        optim.result()
        weights = [d.loss_fn_inputs["weights"].tolist() for d in data]
        expected = -sum(float(np.dot(w, lp)) for w, lp in zip(weights, logprobs(out), strict=True))
        assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5, abs=1e-4)
        assert [len(lp) for lp in logprobs(out)] == [len(w) for w in weights]
        losses.append(out.metrics["loss:sum"])
    assert losses[-1] < 0.5 * losses[0], losses
    info = client.get_info()
    assert info.model_data.model_name == "tiny" and info.lora_rank == 8
    assert client.get_tokenizer().encode("hello world")  # the tokenizer_id is a local folder: loads offline


def test_save_state_and_resume_with_optimizer_continue_exactly(alice) -> None:
    data = batch(1)
    straight = alice.create_lora_training_client(base_model="tiny", rank=8, seed=2).result()
    train(straight, data, 3)
    saved = straight.save_state("after-3").result()
    assert saved.path == f"tinker://{straight.model_id}/weights/after-3"
    uninterrupted = train(straight, data, 3)

    resumed = alice.create_training_client_from_state_with_optimizer(saved.path).result()
    assert resumed.model_id != straight.model_id
    assert train(resumed, data, 3) == pytest.approx(uninterrupted, rel=1e-6)
    weights_only = alice.create_training_client_from_state(saved.path).result()  # Adam state fresh: a new trajectory
    assert train(weights_only, data, 1)[0] == pytest.approx(uninterrupted[0], rel=1e-6)  # the same weights at first


def test_1100_datums_in_one_call_equal_the_same_data_in_two_calls(alice) -> None:
    """The SDK splits a call at 1,024 datums into chunks with consecutive seq_ids, sent concurrently."""
    data = batch(2, n=1100, length=5)
    whole = alice.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    halves = alice.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    one = whole.forward_backward(data, "cross_entropy").result()
    whole.optim_step(LR).result()
    first = halves.forward_backward(data[:550], "cross_entropy").result()
    second = halves.forward_backward(data[550:], "cross_entropy").result()
    halves.optim_step(LR).result()
    assert len(one.loss_fn_outputs) == 1100
    assert one.metrics["loss:sum"] == pytest.approx(first.metrics["loss:sum"] + second.metrics["loss:sum"], rel=1e-5)
    np.testing.assert_allclose(
        np.array(sum(logprobs(one), [])), np.array(sum(logprobs(first) + logprobs(second), [])), rtol=1e-5
    )
    probe = batch(9, n=2)
    np.testing.assert_allclose(
        np.array(sum(logprobs(whole.forward(probe, "cross_entropy").result()), [])),
        np.array(sum(logprobs(halves.forward(probe, "cross_entropy").result()), [])),
        rtol=1e-4, atol=1e-5,
    )  # fmt: skip


def test_forward_equals_forward_backward_outputs(alice) -> None:
    client = alice.create_lora_training_client(base_model="tiny", rank=8, seed=4).result()
    data = batch(3)
    train(client, data, 1)  # a non-zero B, so the adapter matters
    fwd = client.forward(data, "cross_entropy").result()
    fb = client.forward_backward(data, "cross_entropy").result()
    np.testing.assert_allclose(flat(fwd), flat(fb), rtol=1e-6)
    assert fwd.metrics["loss:sum"] == pytest.approx(fb.metrics["loss:sum"])


def test_forward_backward_custom_with_negative_weights_equals_cross_entropy_with_them(alice) -> None:
    """forward_backward_custom is client-side: a forward, then cross_entropy with the loss's gradient as weights."""
    data = batch(4, n=3)
    signs = [[(-1.0) ** i * 0.5 for i in range(len(d.loss_fn_inputs["target_tokens"].tolist()))] for d in data]
    custom = alice.create_lora_training_client(base_model="tiny", rank=8, seed=5).result()
    plain = alice.create_lora_training_client(base_model="tiny", rank=8, seed=5).result()

    def signed_loss(batch_data, lps):
        loss = sum((-torch.tensor(s) * lp).sum() for s, lp in zip(signs, lps, strict=True))
        return loss, {"signed:sum": float(loss)}

    out = custom.forward_backward_custom(data, signed_loss).result()
    custom.optim_step(LR).result()
    weighted = [datum(d.model_input.to_ints() + [d.loss_fn_inputs["target_tokens"].tolist()[-1]], s)
                for d, s in zip(data, signs, strict=True)]  # fmt: skip
    reference = plain.forward_backward(weighted, "cross_entropy").result()
    plain.optim_step(LR).result()
    assert out.metrics["signed:sum"] == pytest.approx(reference.metrics["loss:sum"], rel=1e-5)
    probe = batch(8, n=2)
    np.testing.assert_allclose(
        flat(custom.forward(probe, "cross_entropy").result()), flat(plain.forward(probe, "cross_entropy").result()),
        rtol=1e-4, atol=1e-5,
    )  # fmt: skip


def test_checkpoints_through_the_rest_client_and_another_tenant_sees_none(stack, keys, alice) -> None:
    client = alice.create_lora_training_client(base_model="tiny", rank=8, seed=6).result()
    train(client, batch(5), 1)
    state = client.save_state("s1").result().path
    sampler = client.save_weights_for_sampler("w1").result().path
    assert sampler == f"tinker://{client.model_id}/sampler_weights/w1"
    rest = alice.create_rest_client()
    listed = rest.list_checkpoints(client.model_id).result()
    assert {c.tinker_path for c in listed.checkpoints} == {state, sampler}
    assert {c.checkpoint_type for c in listed.checkpoints} == {"training", "sampler"}
    run = rest.get_training_run(client.model_id).result()
    assert run.training_run_id == client.model_id and run.lora_rank == 8 and run.last_checkpoint.tinker_path == state
    assert client.model_id in {r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs}
    assert {state, sampler} <= {c.tinker_path for c in rest.list_user_checkpoints(limit=100).result().checkpoints}
    info = rest.get_weights_info_by_tinker_path(state).result()
    assert (info.lora_rank, info.train_attn, info.train_mlp) == (8, True, True)

    bob = tinker.ServiceClient(base_url=stack.base_url, api_key=keys["sdk-bob"])
    try:
        bob_rest = bob.create_rest_client()
        with pytest.raises(tinker.NotFoundError):
            bob_rest.list_checkpoints(client.model_id).result()
        with pytest.raises(tinker.NotFoundError):
            bob_rest.get_training_run(client.model_id).result()
        with pytest.raises(tinker.NotFoundError):
            bob_rest.delete_checkpoint_from_tinker_path(state).result()
        with pytest.raises(Exception, match="not found"):
            bob.create_training_client_from_state(state).result()
    finally:
        bob.close("success").result()

    rest.set_checkpoint_ttl_from_tinker_path(state, 3600).result()
    (kept,) = [c for c in rest.list_checkpoints(client.model_id).result().checkpoints if c.tinker_path == state]
    assert kept.expires_at is not None and kept.expires_at > kept.time
    archive = httpx.get(f"{stack.base_url}/api/v1/training_runs/{client.model_id}/checkpoints/weights/s1/archive",
                        headers={"X-API-Key": keys["sdk-alice"]}, timeout=60)  # fmt: skip
    assert archive.status_code == 200, archive.text
    with tarfile.open(fileobj=io.BytesIO(archive.content)) as tar:
        assert {"adapter_model.safetensors", "adapter_config.json"} <= set(tar.getnames())
    foreign = httpx.get(f"{stack.base_url}/api/v1/training_runs/{client.model_id}/checkpoints/weights/s1/archive",
                        headers={"X-API-Key": keys["sdk-bob"]}, timeout=60)  # fmt: skip
    assert foreign.status_code == 404
    rest.delete_checkpoint_from_tinker_path(sampler).result()
    assert [c.tinker_path for c in rest.list_checkpoints(client.model_id).result().checkpoints] == [state]


def test_closing_the_session_frees_its_adapters_and_keeps_their_checkpoints(stack, keys) -> None:
    with tinker.ServiceClient(base_url=stack.base_url, api_key=keys["sdk-alice"]) as sdk:
        client = sdk.create_lora_training_client(base_model="tiny", rank=8, seed=7).result()
        train(client, batch(6), 1)
        path = client.save_state("kept").result().path
        model_id = client.model_id
    with ServiceClient(stack.base_url, keys["sdk-alice"]) as native:
        with pytest.raises(NotFoundError):
            native.training_client(model_id)  # deleted through the queue when the session finished
        assert native.get_run(model_id)["status"] == "deleted"
        assert [c["tinker_path"] for c in native.list_checkpoints(model_id)] == [path]
    with tinker.ServiceClient(base_url=stack.base_url, api_key=keys["sdk-alice"]) as sdk:
        resumed = sdk.create_training_client_from_state_with_optimizer(path).result()
        assert train(resumed, batch(6), 1)


def test_every_loss_the_sdk_names_runs_through_the_tinker_route(alice) -> None:
    client = alice.create_lora_training_client(base_model="tiny", rank=8, seed=8).result()
    rng = np.random.default_rng(7)
    tokens = rng.integers(3, 250, size=13).tolist()
    n = len(tokens) - 1
    rl = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": (-rng.random(n) * 3).astype(np.float32),
                        "advantages": np.r_[np.zeros(4), rng.normal(size=n - 4)].astype(np.float32)},
    )  # fmt: skip
    for loss in ("importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce"):
        out = client.forward_backward([rl], loss).result()
        assert np.isfinite(out.metrics["loss:sum"]) and len(logprobs(out)[0]) == n, loss
    out = client.forward_backward([rl], "ppo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}).result()
    assert np.isfinite(out.metrics["loss:sum"]) and "clip_fraction:mean" in out.metrics


def test_a_request_that_fails_in_the_pool_reaches_the_sdk_as_request_failed_with_its_category(alice) -> None:
    """retrieve_future answers {error, category}: the SDK raises RequestFailedError, category user for a bad input."""
    client = alice.create_lora_training_client(base_model="tiny", rank=8, seed=10).result()
    too_big = 10**6  # past the tiny vocabulary: the gateway cannot know it, the pool refuses it
    with pytest.raises(tinker.RequestFailedError) as failed:
        client.forward_backward([datum([5, too_big, 7])], "cross_entropy").result()
    assert failed.value.category == types.RequestErrorCategory.User
    assert "vocab" in str(failed.value).lower() or str(too_big) in str(failed.value)


def test_an_attention_only_adapter_trains_and_says_so(alice) -> None:
    """lora_config train_mlp=False: the pool trains the attention projections only (the MLP ones held at zero)."""
    client = alice.create_lora_training_client(base_model="tiny", rank=8, seed=11, train_mlp=False).result()
    losses = train(client, batch(10), 4)
    assert losses[-1] < losses[0]
    path = client.save_state("attn").result().path
    info = alice.create_rest_client().get_weights_info_by_tinker_path(path).result()
    assert (info.train_attn, info.train_mlp, info.train_unembed) == (True, False, False)
    resumed = alice.create_training_client_from_state_with_optimizer(path).result()
    assert train(resumed, batch(10), 1)[0] == pytest.approx(train(client, batch(10), 1)[0], rel=1e-6)
