"""The client's training calls return their futures at once and are sent on the transport's threads
(client/transport.py `send`, client/futures.py), against the embedded stack: two calls travel together and apply in
call order, a refusal raises from the future, a result awaited past its timeout keeps the submission going, and a
script that exits without awaiting its last call still sends it. The sends are slowed by an httpx request hook in
the sending thread (the gateway itself is untouched), so "at once" is measurable."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import pytest

from loraplex.client import AdamParams, Datum, ServiceClient
from loraplex.errors import FutureTimeoutError, InvalidRequestError
from tests.helpers.stack import create_tenants

DATA = [Datum.for_next_token([10, 11, 12, 13, 14])]


def _slow_posts(client: ServiceClient, delay_s: float) -> list[tuple[str, float, float]]:
    """Delay every POST by `delay_s` before it leaves; returns (path, start, sent) per POST, on the sending thread."""
    posts: list[tuple[str, float, float]] = []

    def hook(request: httpx.Request) -> None:
        if request.method == "POST":
            start = time.monotonic()
            time.sleep(delay_s)
            posts.append((request.url.path, start, time.monotonic()))
            assert threading.current_thread().name.startswith("loraplex-send")

    client._transport._sync.event_hooks["request"].append(hook)
    return posts


def test_two_calls_return_at_once_travel_together_and_apply_in_call_order(stack) -> None:
    client = ServiceClient(stack.base_url, create_tenants(stack, "send-pair")["send-pair"])
    trainer = client.create_lora_training_client(rank=4, seed=3)
    posts = _slow_posts(client, 0.5)
    started = time.monotonic()
    fb = trainer.forward_backward(DATA)
    opt = trainer.optim_step(AdamParams(learning_rate=1e-3))
    assert time.monotonic() - started < 0.25  # neither call waited for its POST
    assert "loss:sum" in fb.result(timeout=30)["metrics"] and opt.result(timeout=30) is not None
    (_, start_a, sent_a), (_, start_b, sent_b) = sorted(posts, key=lambda p: p[1])
    assert start_b < sent_a  # both POSTs in flight at once
    assert trainer.info()["applied_seq_id"] == 2  # both applied, in call order
    client.close()


def test_a_refusal_raises_from_the_future_and_costs_the_next_call_nothing(stack) -> None:
    client = ServiceClient(stack.base_url, create_tenants(stack, "send-refused")["send-refused"])
    trainer = client.create_lora_training_client(rank=4, seed=4)
    bad = trainer.forward_backward(DATA, loss_fn="no_such_loss")  # the gateway's 400 comes back later
    with pytest.raises(InvalidRequestError, match="loss_fn"):
        bad.result(timeout=30)
    assert bad.done()
    with pytest.raises(InvalidRequestError, match="loss_fn"):
        _ = bad.request_id
    started = time.monotonic()
    assert "loss:sum" in trainer.forward_backward(DATA).result(timeout=30)["metrics"]
    assert time.monotonic() - started < 10  # no wait for the refused seq_id
    client.close()


def test_a_result_awaited_past_its_timeout_keeps_the_submission_going(stack) -> None:
    client = ServiceClient(stack.base_url, create_tenants(stack, "send-slow")["send-slow"])
    trainer = client.create_lora_training_client(rank=4, seed=5)
    _slow_posts(client, 1.0)
    fb = trainer.forward_backward(DATA)
    assert not fb.done()  # still being sent
    with pytest.raises(FutureTimeoutError, match="not yet accepted"):
        fb.result(timeout=0.2)
    assert "loss:sum" in fb.result(timeout=30)["metrics"]
    client.close()


async def _async_result(future: Any) -> Any:
    return await future


def test_await_waits_for_the_submission_too(stack) -> None:
    import asyncio

    client = ServiceClient(stack.base_url, create_tenants(stack, "send-await")["send-await"])
    trainer = client.create_lora_training_client(rank=4, seed=6)
    _slow_posts(client, 0.3)
    assert "loss:sum" in asyncio.run(_async_result(trainer.forward_backward(DATA)))["metrics"]
    client.close()


def test_a_script_that_exits_without_awaiting_its_last_call_still_sends_it(stack) -> None:
    key = create_tenants(stack, "send-exit")["send-exit"]
    client = ServiceClient(stack.base_url, key)
    trainer = client.create_lora_training_client(rank=4, seed=7)
    script = (
        "from loraplex.client import Datum, ServiceClient\n"
        f"c = ServiceClient({stack.base_url!r}, {key!r})\n"
        f"c.training_client({trainer.model_id!r}).forward_backward([Datum.for_next_token([10, 11, 12])])\n"
    )  # no result(), no close(): the interpreter's exit joins the sending thread
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    deadline = time.monotonic() + 30
    while trainer.info()["applied_seq_id"] != 1:
        assert time.monotonic() < deadline, trainer.info()
        time.sleep(0.1)
    client.close()
