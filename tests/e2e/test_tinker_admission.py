"""The Tinker SDK against a stack with tight admission limits and compressed bodies (a stack of its own): a 429 with
Retry-After is honoured (the SDK backs off and resubmits the same seq_id; every step is applied once, in order), one
tenant at its quota does not hold another back, zstd forward_backward bodies train exactly like plain ones, and a
step refused while its tenant is suspended does not hold the tenant's next step after the resume."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
import tinker
from tinker import types

from loraplex.launch.embedded import Stack
from loraplex.runtime.netutil import free_port
from loraplex.service import tenant_controls
from loraplex.service.build import build_services
from loraplex.settings import Settings
from loraplex.storage.repositories import TenantRepository
from tests.helpers.stack import create_tenants


@pytest.fixture(scope="module")
def tight(tmp_path_factory):
    settings = Settings(
        home=tmp_path_factory.mktemp("tight"),
        slots=4,
        max_rank=16,
        max_queued_requests_per_tenant=1,  # a second queued request of a tenant is a 429 until the first is answered
        tinker_compress_fwdbwd=True,  # client/config asks the SDK for zstd forward_backward bodies
        auth_cache_seconds=0.2,  # an operator's suspend and resume reach the gateway process at once
    )
    with Stack(settings, api_port=free_port()) as running:
        yield running


def _data(seed: int) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(3):
        tokens = rng.integers(3, 250, size=10).tolist()
        out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                               loss_fn_inputs={"target_tokens": tokens[1:]}))  # fmt: skip
    return out


def _steps(client, data, n: int) -> list[float]:
    """n forward_backward + optim_step pairs submitted back to back (the SDK does not wait between them)."""
    futures = []
    for _ in range(n):
        futures.append(client.forward_backward(data, "cross_entropy"))
        futures.append(client.optim_step(types.AdamParams(learning_rate=1e-2)))
    return [f.result().metrics["loss:sum"] for f in futures[0::2]]


def test_the_sdk_honours_429_and_every_step_is_applied_once_in_order(tight, caplog) -> None:
    keys = create_tenants(tight, "adm-alice", "adm-bob")
    caplog.set_level(logging.DEBUG, logger="tinker")
    alice = tinker.ServiceClient(base_url=tight.base_url, api_key=keys["adm-alice"])
    bob = tinker.ServiceClient(base_url=tight.base_url, api_key=keys["adm-bob"])
    try:
        data = _data(0)
        busy = alice.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
        losses: dict[str, list[float]] = {}
        worker = threading.Thread(target=lambda: losses.__setitem__("alice", _steps(busy, data, 4)))
        worker.start()
        calm = bob.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
        losses["bob"] = _steps(calm, data, 4)  # bob trains while alice is at her quota
        worker.join(timeout=300)
        assert not worker.is_alive()
    finally:
        alice.close("success").result()
        bob.close("success").result()
    retried = [r for r in caplog.records if "Retrying request to" in r.getMessage() and "/api/v1/" in r.getMessage()]
    assert retried, "no request met the quota: the test did not exercise a 429"
    # Same seed, same data: the retried (honoured) submissions applied each step exactly once, in seq_id order.
    assert losses["alice"] == pytest.approx(losses["bob"], rel=1e-6)
    assert losses["alice"][-1] < losses["alice"][0]


def test_compressed_bodies_train_exactly_like_plain_ones(tight, stack) -> None:
    """tight asks for zstd bodies (client/config); the shared stack does not. Same seed and data: same losses."""
    tight_key = create_tenants(tight, "zstd-alice")["zstd-alice"]
    plain_key = create_tenants(stack, "plain-alice")["plain-alice"]
    results = []
    for base_url, key in ((tight.base_url, tight_key), (stack.base_url, plain_key)):
        client = tinker.ServiceClient(base_url=base_url, api_key=key)
        try:
            training = client.create_lora_training_client(base_model="tiny", rank=4, seed=9).result()
            results.append(_steps(training, _data(1), 3))
        finally:
            client.close("success").result()
    assert results[0] == pytest.approx(results[1], rel=1e-6)


def test_a_step_refused_while_suspended_does_not_hold_the_next_one_after_the_resume(tight) -> None:
    """The SDK took the refused step's seq_id (a zstd protobuf forward_backward, refused at the door before its body was
    read): its place is filled, so after the resume the next steps run at once instead of waiting for it (the gap
    timeout, 60 s, then a failure)."""
    keys = create_tenants(tight, "sus-alice")
    services = build_services(tight.settings)
    with services.sessions() as db:
        tenant_id = TenantRepository(db).get_by_name("sus-alice").id
    client = tinker.ServiceClient(base_url=tight.base_url, api_key=keys["sus-alice"])
    try:
        training = client.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
        before = _steps(training, _data(2), 1)
        tenant_controls.suspend_tenant(services, "ops", tenant_id, "maintenance window")
        time.sleep(0.5)
        with pytest.raises(tinker.PermissionDeniedError, match="maintenance window"):
            training.forward_backward(_data(2), "cross_entropy").result()
        tenant_controls.resume_tenant(services, "ops", tenant_id)
        time.sleep(0.5)
        started = time.monotonic()
        after = _steps(training, _data(2), 2)
        assert time.monotonic() - started < 20, "the next steps waited for the refused one's seq_id"
        assert after[-1] < before[0]  # training went on from where it was
    finally:
        client.close("success").result()
