"""Producer against a real redis-server: enqueue, idempotency per (model_id, seq_id) and per (model_id, kind)."""

from __future__ import annotations

import uuid

import pytest
import redis

from loraplex.queue import keys
from loraplex.queue.consumer import Consumer
from loraplex.queue.envelope import Envelope
from loraplex.queue.keys import JobState
from loraplex.queue.producer import OWNER_TTL_S, Producer
from loraplex.queue.results import ResultStore


def _pool() -> str:
    return f"p-{uuid.uuid4().hex[:8]}"


def _step(model: str, seq: int, kind: str = "forward_backward") -> Envelope:
    return Envelope.new(tenant_id="t", model_id=model, seq_id=seq, kind=kind, payload={"data": [], "loss_fn": "x"})


def test_submit_enqueues_and_marks_queued(redis_client: redis.Redis) -> None:
    pool = _pool()
    env = _step(f"m-{uuid.uuid4().hex[:6]}", 1)  # idempotency keys are per model id: unique in a shared Redis
    assert Producer(redis_client, pool).submit(env) == env.request_id
    assert redis_client.xlen(keys.request_stream(pool, "t")) == 1
    assert ResultStore(redis_client).state(env.request_id) is JobState.QUEUED
    # Entries queued before any dispatcher created the group are still delivered.
    [(_, got)] = Consumer(redis_client, pool, "c").read(count=10)
    assert got == env


def test_a_retried_request_is_enqueued_once_and_returns_the_first_id(redis_client: redis.Redis) -> None:
    pool, model = _pool(), f"m-{uuid.uuid4().hex[:6]}"
    producer = Producer(redis_client, pool)
    first = _step(model, 1)
    retry = _step(model, 1)  # same (model_id, seq_id), new request_id: a client retry
    assert producer.submit(first) == first.request_id
    assert producer.submit_checked(retry) == (first.request_id, False)
    assert producer.submit(first) == first.request_id
    assert producer.submit(_step(model, 2)) != first.request_id
    assert redis_client.xlen(keys.request_stream(pool, "t")) == 2
    assert ResultStore(redis_client).state(retry.request_id) is None  # the retry left no trace
    assert redis_client.ttl(keys.idempotency_key(model, 1)) > 0  # keys expire, never pile up
    # the submit script wrote each queued request's owner (who may read its future) with it; a retry wrote none
    assert redis_client.get(keys.request_owner(first.request_id)) == b"t"
    assert 6 * 24 * 3600 < redis_client.ttl(keys.request_owner(first.request_id)) <= OWNER_TTL_S
    assert redis_client.exists(keys.request_owner(retry.request_id)) == 0


def test_create_and_delete_are_idempotent_per_adapter(redis_client: redis.Redis) -> None:
    pool, model = _pool(), f"m-{uuid.uuid4().hex[:6]}"
    producer = Producer(redis_client, pool)
    create = Envelope.new(tenant_id="t", model_id=model, kind="create_adapter", payload={"rank": 8})
    again = Envelope.new(tenant_id="t", model_id=model, kind="create_adapter", payload={"rank": 8})
    delete = Envelope.new(tenant_id="t", model_id=model, kind="delete_adapter")
    assert producer.submit(create) == create.request_id
    assert producer.submit(again) == create.request_id
    assert producer.submit(delete) == delete.request_id  # a different slot than the create
    assert producer.submit(Envelope.new(tenant_id="t", model_id=model, kind="delete_adapter")) == delete.request_id
    assert redis_client.xlen(keys.request_stream(pool, "t")) == 2


def test_a_reused_key_with_another_body_or_kind_is_a_conflict_naming_both(redis_client: redis.Redis) -> None:
    """Before: a different payload, or an optim_step reusing a forward_backward's seq_id, got the FIRST request's id
    back and the caller believed its request was queued."""
    from loraplex.errors import ConflictError

    pool, model = _pool(), f"m-{uuid.uuid4().hex[:6]}"
    producer = Producer(redis_client, pool)
    first = _step(model, 1)
    assert producer.submit(first) == first.request_id
    other_body = Envelope.new(
        tenant_id="t", model_id=model, seq_id=1, kind="forward_backward", payload={"data": [], "loss_fn": "ppo"}
    )
    with pytest.raises(ConflictError, match=r"seq_id 1 was already used by a forward_backward request"):
        producer.submit(other_body)
    optim = Envelope.new(tenant_id="t", model_id=model, seq_id=1, kind="optim_step", payload={"adam_params": {}})
    with pytest.raises(ConflictError, match=r"forward_backward request .* this optim_step needs the next unused"):
        producer.submit(optim)
    assert producer.submit(_step(model, 1)) == first.request_id  # the same body again: a retry, as before
    assert redis_client.xlen(keys.request_stream(pool, "t")) == 1
    assert (
        ResultStore(redis_client).state(other_body.request_id) is None
        and ResultStore(redis_client).state(optim.request_id) is None
    )  # the conflicting requests left no trace


def _tokens(model: str, seq: int, n: int, tenant: str = "t") -> Envelope:
    data = [{"model_input": [1] * n, "loss_fn_inputs": {}}]
    return Envelope.new(tenant_id=tenant, model_id=model, seq_id=seq, kind="forward", payload={"data": data})


def test_queue_quotas_are_per_tenant_429_with_retry_after_and_queue_nothing(redis_client: redis.Redis) -> None:
    from loraplex.errors import QuotaExceededError

    pool, m, other = _pool(), f"m-{uuid.uuid4().hex[:6]}", f"o-{uuid.uuid4().hex[:6]}"
    producer = Producer(redis_client, pool, max_queued_requests=3, max_queued_tokens=100)
    for seq in (1, 2, 3):
        producer.submit(_step(m, seq))
    with pytest.raises(QuotaExceededError, match="3 requests queued; the quota is 3") as over:
        producer.submit(_step(m, 4))
    assert over.value.retry_after_s and redis_client.xlen(keys.request_stream(pool, "t")) == 3
    assert not redis_client.exists(keys.request_idempotency_key("forward_backward", m, 4))  # retryable as it is
    assert producer.submit(_step(m, 3)) is not None  # a retry of an accepted request is answered, quota or not
    producer.submit(Envelope.new(tenant_id="t", model_id=m, kind="delete_adapter"))  # a delete is never refused
    producer.submit(_tokens(other, 1, 60, tenant="u"))  # another tenant has its own quotas
    with pytest.raises(QuotaExceededError, match="60 tokens queued, and this request adds 50; the quota is 100"):
        producer.submit(_tokens(other, 2, 50, tenant="u"))
    producer.submit(_tokens(other, 2, 40, tenant="u"))
    consumer = Consumer(redis_client, pool, "c")
    consumer.ack([ref for ref, env in consumer.read(count=10) if env.tenant_id == "u"][:1])
    producer.submit(_tokens(other, 3, 50, tenant="u"))  # 40 + 50 <= 100 once the first was answered
