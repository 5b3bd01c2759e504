"""An adapter handed from one pool to another in Redis (queue/handoff.py), on a real redis-server: its request log and
its unanswered entries (read or not) move once, with their request ids and token counts; a late entry is forwarded
once; a deposed source moves nothing."""

from __future__ import annotations

import uuid

import pytest
import redis

from loraplex.errors import LeaseLostError
from loraplex.queue import handoff, keys
from loraplex.queue.consumer import Consumer
from loraplex.queue.envelope import Envelope
from loraplex.queue.lease import PoolLease
from loraplex.queue.producer import Producer
from loraplex.queue.replay_log import logged_adapters, read_after

_TAG = uuid.uuid4().hex[:8]
A, B = f"a-{_TAG}", f"b-{_TAG}"  # idempotency keys are global: each run has adapters of its own


def _pools() -> tuple[str, str]:
    tag = uuid.uuid4().hex[:8]
    return f"src-{tag}", f"dst-{tag}"


def _fb(model: str, seq: int) -> Envelope:
    data = {"data": [{"model_input": [1, 2, 3], "loss_fn_inputs": {"target_tokens": [2, 3, 4]}}]}
    return Envelope.new(tenant_id="t", model_id=model, seq_id=seq, kind="forward_backward", payload=data)


def test_hand_over_moves_the_log_and_every_unanswered_entry_once(redis_client: redis.Redis) -> None:
    src, dst = _pools()
    producer = Producer(redis_client, src)
    ids = [producer.submit(_fb(A, s)) for s in (1, 2, 3)]
    other = producer.submit(_fb(B, 1))  # another adapter of the tenant stays
    consumer = Consumer(redis_client, src, "leader")
    read = consumer.read(count=2)  # two read and held, not answered
    answered = [(ref, env) for ref, env in read if env.seq_id == 1]
    consumer.ack([ref for ref, _ in answered], {answered[0][0]: ("a", A, 1)})  # seq 1 answered: into the log
    tokens_before = int(redis_client.hget(keys.queued_tokens(src), "t"))

    entries = handoff.entries_of(redis_client, src, "t", A)
    assert len(entries) == 2  # seq 2 (read) and 3 (not read yet)
    scripts = handoff.Handoffs(redis_client)
    assert scripts.hand_over(src, dst, "t", A, entries, None) == 2
    assert scripts.hand_over(src, dst, "t", A, entries, None) == 0  # run again: nothing moves twice

    target = Consumer(redis_client, dst, "leader")
    moved = target.read(count=10)
    assert [(env.request_id, env.seq_id) for _, env in moved] == [(ids[1], 2), (ids[2], 3)]
    assert [e.seq_id for e in read_after(redis_client, dst, A, None)] == [1]  # the log went with it
    assert read_after(redis_client, src, A, None) == [] and A not in logged_adapters(redis_client, src)
    assert A in logged_adapters(redis_client, dst)
    assert handoff.meet(redis_client, src, A) == (dst, False)
    assert handoff.meet(redis_client, dst, A) == (None, True)
    per_entry = tokens_before // 3  # three equal entries were queued on src (b and two of a)
    assert int(redis_client.hget(keys.queued_tokens(src), "t")) == per_entry
    assert int(redis_client.hget(keys.queued_tokens(dst), "t")) == 2 * per_entry
    assert [env.request_id for _, env in consumer.read(count=10)] == [other]  # b stays on src


def test_a_late_entry_is_forwarded_once_and_an_adapter_handed_back_is_not(redis_client: redis.Redis) -> None:
    src, dst = _pools()
    scripts = handoff.Handoffs(redis_client)
    scripts.hand_over(src, dst, "t", A, [], None)
    late = Producer(redis_client, src).submit(_fb(A, 7))  # a gateway that read the old placement
    consumer = Consumer(redis_client, src, "leader")
    ((ref, _),) = consumer.read(count=10)
    assert consumer.forward(ref, A) == dst
    assert consumer.forward(ref, A) == dst  # again: gone from src already, not queued twice
    assert [env.request_id for _, env in Consumer(redis_client, dst, "leader").read(count=10)] == [late]
    assert redis_client.xlen(keys.request_stream(dst, "t")) == 1

    scripts.hand_over(dst, src, "t", A, [], None)  # handed back: src holds it again
    assert handoff.moved_to(redis_client, src, A) is None
    assert handoff.meet(redis_client, src, A) == (None, True)
    back = Producer(redis_client, src).submit(_fb(A, 8))
    ((ref, env),) = consumer.read(count=10)
    assert env.request_id == back and consumer.forward(ref, A) is None  # stays


def test_a_deposed_source_hands_nothing_over(redis_client: redis.Redis) -> None:
    src, dst = _pools()
    Producer(redis_client, src).submit(_fb(A, 9))
    old = PoolLease(redis_client, src, ttl_s=5.0)
    assert old.try_acquire()
    redis_client.delete(keys.pool_leader(src))  # lapsed...
    assert PoolLease(redis_client, src, ttl_s=5.0).try_acquire()  # ...and taken over
    with pytest.raises(LeaseLostError):
        handoff.Handoffs(redis_client).hand_over(src, dst, "t", A, handoff.entries_of(redis_client, src, "t", A), old)
    assert old.lost
    assert redis_client.xlen(keys.request_stream(src, "t")) == 1 and not redis_client.exists(
        keys.request_stream(dst, "t")
    )
    assert handoff.meet(redis_client, dst, A) == (None, False)
