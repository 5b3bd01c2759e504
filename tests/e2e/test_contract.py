"""The step contract through the embedded stack and the Python client: a call the client cannot send (a non-finite
number) raises at once, naming the field, and costs the caller's next call nothing (it takes no seq_id: before, the
next call waited 60 s for the seq_id that never arrived, then failed); a result is visible only after its record."""

from __future__ import annotations

import math
import time

import pytest
import redis

from loraplex.client import AdamParams, Datum, ServiceClient
from loraplex.errors import InvalidRequestError, NotFoundError
from loraplex.queue import stats
from tests.helpers.stack import create_tenants, tenant_clients


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_number_fails_at_the_call_and_the_next_call_runs(stack, bad: float) -> None:
    name = "finite-nan" if math.isnan(bad) else "finite-inf"
    client = tenant_clients(stack, name)[name]
    trainer = client.create_lora_training_client(rank=4)
    data = [Datum.for_next_token([10, 11, 12, 13])]
    trainer.forward_backward(data).result(timeout=60)
    with pytest.raises(InvalidRequestError, match="adam_params.learning_rate"):
        trainer.optim_step(AdamParams(learning_rate=bad))
    bad_weights = [Datum(model_input=[10, 11], loss_fn_inputs={"target_tokens": [11, 12], "weights": [1.0, bad]})]
    with pytest.raises(InvalidRequestError, match=r"data\.0\.loss_fn_inputs\.weights\.1"):
        trainer.forward_backward(bad_weights)
    started = time.monotonic()
    assert trainer.optim_step(AdamParams(learning_rate=1e-3)).result(timeout=30) is not None
    assert trainer.forward_backward(data).result(timeout=30)["metrics"]
    assert time.monotonic() - started < 20  # nothing waited for a missing seq_id
    client.close()


def test_a_call_the_gateway_rejects_costs_the_next_call_nothing(stack) -> None:
    """The client took seq_ids for these calls and the gateway turned them down (a 422 from validation, a 400 from a
    service rule, a 404 for a missing checkpoint): each rejection holds its seq_id, so the next calls run at once
    (before: the next call waited 60 s for the rejected seq_id, then failed)."""
    client = tenant_clients(stack, "rejected")["rejected"]
    trainer = client.create_lora_training_client(rank=4)
    data = [Datum.for_next_token([10, 11, 12, 13])]
    with pytest.raises(InvalidRequestError, match="loss_fn"):
        trainer.forward_backward(data, loss_fn="no_such_loss").result(timeout=30)
    with pytest.raises(InvalidRequestError, match="invalid checkpoint name"):
        trainer.save_state("../escape").result(timeout=30)
    with pytest.raises(NotFoundError):
        trainer.load_state(f"tinker://{trainer.model_id}/weights/never-saved").result(timeout=30)
    started = time.monotonic()
    fb = trainer.forward_backward(data)
    assert trainer.optim_step(AdamParams(learning_rate=1e-3)).result(timeout=30) is not None
    assert fb.result(timeout=30)["metrics"]
    assert time.monotonic() - started < 20  # nothing waited for a missing seq_id
    assert trainer.info()["applied_seq_id"] == 5  # the three rejected seq_ids, answered with their errors, then two
    client.close()


def test_a_result_is_visible_only_after_its_step_is_recorded(stack) -> None:
    """Right after a step's results, the adapter's row already shows that step applied (before: results reached Redis
    ahead of the SQL record, and 2 reads in 18 saw the previous applied_seq_id; `training_client()` derives the next
    seq_id from it)."""
    client = tenant_clients(stack, "recorded-first")["recorded-first"]
    trainer = client.create_lora_training_client(rank=4)
    data = [Datum.for_next_token([10, 11, 12, 13])]
    seen = []
    for _ in range(20):
        fb, opt = trainer.forward_backward(data), trainer.optim_step(AdamParams(learning_rate=1e-3))
        fb.result(timeout=30)
        opt.result(timeout=30)
        seen.append(trainer.info()["applied_seq_id"])
    assert seen == list(range(2, 41, 2))
    client.close()


def test_a_huge_body_is_refused_unread_and_costs_the_next_call_nothing(stack) -> None:
    """A huge body must not hold every tenant while it is parsed (235 MB took 13 s): a body over
    LORAPLEX_MAX_BODY_BYTES is a 413 before it is read (a declared Content-Length: at once; chunked: once the limit
    is passed), and the client's seq_id (named in X-Seq-Id) is held by the rejection, so its next call runs at once."""
    import socket
    import threading
    from urllib.parse import urlsplit

    from loraplex.errors import RequestTooLargeError

    key = create_tenants(stack, "huge")["huge"]
    client = ServiceClient(stack.base_url, key)
    trainer = client.create_lora_training_client(rank=4)
    host, port = urlsplit(stack.base_url).hostname, urlsplit(stack.base_url).port
    head = (
        f"POST /v1/adapters/{trainer.model_id}/forward_backward HTTP/1.1\r\nHost: {host}\r\nX-API-Key: {key}\r\n"
        "Content-Type: application/json\r\nX-Seq-Id: 1\r\n"
    )
    with socket.create_connection((host, port), timeout=10) as sock:  # declares 235 MB, sends none of it
        started = time.monotonic()
        sock.sendall((head + "Content-Length: 235000000\r\n\r\n").encode())
        assert sock.recv(65536).startswith(b"HTTP/1.1 413") and time.monotonic() - started < 2

    sent = [0]
    with socket.create_connection((host, port), timeout=10) as sock:  # chunked, no length: 200 MB on offer

        def send_chunks() -> None:
            chunk = b"%x\r\n%s\r\n" % (1 << 20, b" " * (1 << 20))
            try:
                sock.sendall((head + "Transfer-Encoding: chunked\r\n\r\n").encode())
                for _ in range(200):
                    sock.sendall(chunk)
                    sent[0] += 1
            except OSError:
                pass  # the gateway answered and closed: stop sending

        sender = threading.Thread(target=send_chunks, daemon=True)
        sender.start()
        assert sock.recv(65536).startswith(b"HTTP/1.1 413")
        sender.join(timeout=10)
    assert sent[0] < 100, sent  # refused past the 32 MiB limit, long before 200 MB

    # Through the client: a 3.3 M-token datum (~40 MB of JSON) takes seq_id 2 and is refused unread.
    tokens = list(range(3_300_000))
    with pytest.raises(RequestTooLargeError, match="LORAPLEX_MAX_BODY_BYTES"):
        trainer._next_seq = 2  # seq_id 1 went to the raw requests above (held by their rejection)
        trainer.forward_backward([Datum(model_input=tokens, loss_fn_inputs={"target_tokens": tokens})]).result(timeout=60)
    started = time.monotonic()
    assert trainer.forward_backward([Datum.for_next_token([10, 11, 12, 13])]).result(timeout=30)["metrics"]
    assert time.monotonic() - started < 20 and trainer.info()["applied_seq_id"] == 3
    client.close()


def test_a_request_over_the_plan_token_cap_runs_in_parts_and_others_are_answered_first(stack) -> None:
    """One tenant's huge request must not hold the pool while another's small step waits (a 2.56 M-token request in one
    plan holds it ~93 s): a request over LORAPLEX_PLAN_TOKENS (16,384 here) runs one part per plan: 15 x 3,000 tokens go
    as [0, 5), [5, 10) and [10, 15); the other tenant's small step, sent just after, joins the first or the second plan
    (whether the pool read it before planning the first), so it is answered at least a whole plan before the big one,
    which answers once, with every datum's logprobs, after its last part."""
    import threading

    clients = tenant_clients(stack, "parts-big", "parts-small")
    big = clients["parts-big"].create_lora_training_client(rank=4)
    small = clients["parts-small"].create_lora_training_client(rank=4)
    warm = [Datum.for_next_token([10, 11, 12, 13])]
    big.forward_backward(warm).result(timeout=60)
    small.forward_backward(warm).result(timeout=60)
    data = [Datum.for_next_token([(7 * i + k) % 190 + 1 for k in range(3001)]) for i in range(15)]
    pool_stats = redis.Redis.from_url(stack.settings.redis_url)
    time.sleep(0.5)  # the warm-up plans' statistics are in
    before = stats.read(pool_stats, stack.settings.pool)
    done: dict[str, float] = {}
    results: dict[str, dict] = {}

    def wait(name: str, future) -> None:
        results[name] = future.result(timeout=300)
        done[name] = time.monotonic()

    big_step = big.forward_backward(data)
    assert big_step.request_id  # queued (the calls are sent on the client's threads: the small one must come after)
    waiters = [threading.Thread(target=wait, args=("big", big_step))]
    waiters.append(threading.Thread(target=wait, args=("small", small.forward_backward(warm))))
    for w in waiters:
        w.start()
    for w in waiters:
        w.join(timeout=320)
    assert done["small"] < done["big"]
    time.sleep(0.5)
    ran = stats.read(pool_stats, stack.settings.pool).minus(before)
    # Three parts, one plan each; the small step rides in one of those plans, in the part's step or in a step of its
    # own beside it (the cost model's choice: sharing the part's last microbatch would take it through the grouped op).
    assert (ran.plans, ran.fb_tokens) == (3, 45003) and ran.fb_steps in (3, 4)
    assert [len(o["logprobs"]) for o in results["big"]["loss_fn_outputs"]] == [3000] * 15
    assert math.isfinite(results["big"]["metrics"]["loss:sum"]) and results["big"]["metrics"]["loss:sum"] > 0
    assert big.info()["applied_seq_id"] == 2  # applied once, as one step
    assert big.optim_step(AdamParams(learning_rate=1e-3)).result(timeout=60) is not None
    for c in clients.values():
        c.close()
