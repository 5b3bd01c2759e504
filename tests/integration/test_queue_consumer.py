"""Consumer group against a real redis-server: read/ack, redelivery after a crash, claims from a dead consumer,
undecodable entries."""

from __future__ import annotations

import json
import time
import uuid

import redis

from loraplex.queue import keys
from loraplex.queue.consumer import Consumer
from loraplex.queue.envelope import Envelope, encode
from loraplex.queue.producer import Producer
from loraplex.queue.results import ResultStore


def _pool() -> str:
    return f"p-{uuid.uuid4().hex[:8]}"


def _xadd(r: redis.Redis, pool: str, fields: dict, tenant: str = "t") -> None:
    """An entry written straight into tenant `tenant`'s stream (as a producer of another build might)."""
    r.sadd(keys.pool_tenants(pool), tenant)
    r.xadd(keys.request_stream(pool, tenant), fields)


def _submit(r: redis.Redis, pool: str, n: int) -> list[str]:
    producer = Producer(r, pool)
    model = uuid.uuid4().hex[:6]
    return [producer.submit(Envelope.new(tenant_id="t", model_id=model, seq_id=i, kind="optim_step")) for i in range(n)]


def test_read_then_ack_removes_entries(redis_client: redis.Redis) -> None:
    pool = _pool()
    ids = _submit(redis_client, pool, 3)
    consumer = Consumer(redis_client, pool, "c1")
    entries = consumer.read(count=10)
    assert [env.request_id for _, env in entries] == ids
    assert consumer.read(block_ms=50) == []  # nothing new, and its own pending entries are not re-read
    assert consumer.pending_count() == 3
    consumer.ack([sid for sid, _ in entries])
    assert consumer.pending_count() == 0
    assert redis_client.xlen(keys.request_stream(pool, "t")) == 0  # XDEL: answered requests leave the stream


def test_entries_read_but_not_acked_come_back_after_a_crash(redis_client: redis.Redis) -> None:
    pool = _pool()
    ids = _submit(redis_client, pool, 3)
    first = Consumer(redis_client, pool, "leader")
    assert len(first.read(count=2)) == 2  # ...and the process dies before acking
    extra = _submit(redis_client, pool, 1)

    restarted = Consumer(redis_client, pool, "leader")
    backlog = restarted.read(count=10)
    assert [env.request_id for _, env in backlog] == ids[:2]  # its own pending entries first
    fresh = restarted.read(count=10)
    assert [env.request_id for _, env in fresh] == [ids[2], *extra]
    restarted.ack([sid for sid, _ in backlog + fresh])
    assert restarted.pending_count() == 0


def test_backlog_is_paged(redis_client: redis.Redis) -> None:
    pool = _pool()
    ids = _submit(redis_client, pool, 5)
    Consumer(redis_client, pool, "leader").read(count=5)
    restarted = Consumer(redis_client, pool, "leader")
    got = [env.request_id for _ in range(3) for _, env in restarted.read(count=2)]
    assert got == ids


def test_a_live_consumer_claims_the_idle_entries_of_a_dead_one(redis_client: redis.Redis) -> None:
    pool = _pool()
    ids = _submit(redis_client, pool, 2)
    dead = Consumer(redis_client, pool, "dead")
    assert len(dead.read(count=10)) == 2
    live = Consumer(redis_client, pool, "live")
    assert live.claim_stale(min_idle_ms=60_000) == []  # not idle long enough yet
    time.sleep(0.06)
    claimed = live.claim_stale(min_idle_ms=50)
    assert [env.request_id for _, env in claimed] == ids
    live.ack([sid for sid, _ in claimed])
    assert live.pending_count() == 0


def test_an_undecodable_entry_is_acked_and_its_request_fails(redis_client: redis.Redis) -> None:
    pool = _pool()
    stream = keys.request_stream(pool, "t")
    consumer = Consumer(redis_client, pool, "c")
    good = Envelope.new(tenant_id="t", model_id="m", seq_id=1, kind="optim_step")
    future = encode(good) | {"v": "99", "request_id": "req-from-the-future"}
    _xadd(redis_client, pool, future)
    _xadd(redis_client, pool, {"garbage": "x"})  # not even a request_id
    _xadd(redis_client, pool, encode(good))

    entries = consumer.read(count=10)
    assert [env for _, env in entries] == [good]
    outcome = ResultStore(redis_client).get("req-from-the-future")
    assert outcome is not None and not outcome.ok
    assert outcome.error_name == "InvalidRequestError" and "version '99'" in (outcome.error or "")
    consumer.ack([sid for sid, _ in entries])
    assert consumer.pending_count() == 0 and redis_client.xlen(stream) == 0


def test_the_group_is_recreated_if_the_stream_vanishes(redis_client: redis.Redis) -> None:
    pool = _pool()
    consumer = Consumer(redis_client, pool, "c")
    first = _submit(redis_client, pool, 1)
    consumer.ack([sid for sid, _ in consumer.read(count=5)])
    redis_client.delete(keys.request_stream(pool, "t"))
    assert consumer.read(block_ms=10) == []
    ids = _submit(redis_client, pool, 1)
    assert ids != first and [env.request_id for _, env in consumer.read(count=5)] == ids


def test_keeping_entries_whose_group_is_gone_passes_them_over(redis_client: redis.Redis) -> None:
    """Redis restarted empty while the dispatcher held entries: keeping them finds no group (NOGROUP), and that is
    no error (it killed the pool's loop), while the entries of a stream that still has its group are kept."""
    pool = _pool()
    consumer = Consumer(redis_client, pool, "c")
    _submit(redis_client, pool, 1)
    Producer(redis_client, pool).submit(Envelope.new(tenant_id="other", model_id="m", seq_id=0, kind="optim_step"))
    held = [sid for sid, _ in consumer.read(count=5)]
    assert len(held) == 2
    redis_client.delete(keys.request_stream(pool, "t"))  # its group with it
    consumer.keep(held)
    other = keys.request_stream(pool, "other")
    assert redis_client.xpending(other, consumer.group)["pending"] == 1


def test_an_entry_whose_payload_does_not_fit_its_kind_fails_as_undecodable(redis_client: redis.Redis) -> None:
    """The codec checks each payload against its kind's model (loraplex/protocol): a bad one fails alone, named."""
    pool = _pool()
    consumer = Consumer(redis_client, pool, "c")
    good = Envelope.new(tenant_id="t", model_id="m", seq_id=2, kind="optim_step", payload={"adam_params": {}})
    # An envelope cannot be built with a payload of the wrong shape: the entry is written by hand, as another
    # version or a bug might.
    fields = encode(good)
    data = json.loads(fields["data"]) | {"request_id": "bad", "seq_id": 1, "kind": "forward_backward",
                                         "payload": {"data": "tokens"}}  # fmt: skip
    _xadd(redis_client, pool, {"v": fields["v"], "request_id": "bad", "data": json.dumps(data)})
    _xadd(redis_client, pool, fields)
    entries = consumer.read(count=10)
    assert [env for _, env in entries] == [good]
    outcome = ResultStore(redis_client).get("bad")
    assert outcome is not None and outcome.error_name == "InvalidRequestError"
    assert "data: expected list[object], got str" in (outcome.error or "")



def test_a_queued_sample_with_the_older_field_names_fails_its_request_and_the_stream_goes_on(
    redis_client: redis.Redis,
) -> None:
    """SamplePayload's fields were `snapshot` / `snapshot_dir` before they were `sampler_copy` / `sampler_copy_dir`;
    an entry written with the older names (a gateway not yet upgraded) fails its request naming the unknown field,
    and the entries after it are read as usual."""
    pool = _pool()
    consumer = Consumer(redis_client, pool, "c")
    path = "tinker://m/sampler_weights/w1"
    good = Envelope.new(tenant_id="t", model_id="s", seq_id=2, kind="sample",
                        payload={"prompt": [1, 2], "sampler_copy": path, "sampler_copy_dir": "/ckpt"})  # fmt: skip
    fields = encode(good)
    data = json.loads(fields["data"])
    old = {k: v for k, v in data["payload"].items() if k not in ("sampler_copy", "sampler_copy_dir")}
    data |= {"request_id": "old", "seq_id": 1, "payload": old | {"snapshot": path, "snapshot_dir": "/ckpt"}}
    _xadd(redis_client, pool, {"v": fields["v"], "request_id": "old", "data": json.dumps(data)})
    _xadd(redis_client, pool, fields)
    assert [env for _, env in consumer.read(count=10)] == [good]
    outcome = ResultStore(redis_client).get("old")
    assert outcome is not None and outcome.error_name == "InvalidRequestError"
    assert "unknown field(s) snapshot, snapshot_dir" in (outcome.error or "")

def _fill(r: redis.Redis, pool: str, tenant: str, n: int, model: str | None = None) -> list[str]:
    producer = Producer(r, pool)
    model = model or uuid.uuid4().hex[:6]
    return [producer.submit(Envelope.new(tenant_id=tenant, model_id=model, seq_id=i, kind="optim_step"))
            for i in range(1, n + 1)]  # fmt: skip


def test_every_tenant_is_read_side_by_side_whatever_the_backlog_ahead(redis_client: redis.Redis) -> None:
    """One stream per tenant: a tenant's single request behind another's 500 queued ones is in the first read
    (before: one arrival-ordered stream, read 256 at a time, so it was 2 reads away, or 20 with 5,000)."""
    pool = _pool()
    _fill(redis_client, pool, "flood", 500)
    (small,) = _fill(redis_client, pool, "small", 1)
    consumer = Consumer(redis_client, pool, "c", window=16)
    first = consumer.read(count=8)
    assert small in [env.request_id for _, env in first]
    assert sum(env.tenant_id == "flood" for _, env in first) == 8


def test_a_tenant_with_a_full_window_is_not_read_until_acks(redis_client: redis.Redis) -> None:
    pool = _pool()
    flood = _fill(redis_client, pool, "flood", 20)
    consumer = Consumer(redis_client, pool, "c", window=6)
    got = consumer.read(count=4) + consumer.read(count=4)
    assert [env.request_id for _, env in got] == flood[:8]  # the window is reached within the second read
    assert consumer.read(block_ms=20, count=4) == []  # 8 unacked >= 6: paused
    (late,) = _fill(redis_client, pool, "late", 1)
    assert [env.request_id for _, env in consumer.read(block_ms=20, count=4)] == [late]
    consumer.ack([ref for ref, _ in got[:4]])  # 4 unacked now: read again
    assert [env.request_id for _, env in consumer.read(count=4)] == flood[8:12]


def test_a_new_tenants_first_request_wakes_a_blocked_read(redis_client: redis.Redis) -> None:
    import threading

    pool = _pool()
    consumer = Consumer(redis_client, pool, "c")
    got: list = []
    reader = threading.Thread(target=lambda: got.extend(consumer.read(block_ms=5000, count=4)))
    started = time.monotonic()
    reader.start()
    time.sleep(0.1)  # the read is blocked, on streams that do not include the new tenant's
    (rid,) = _fill(redis_client, pool, "newcomer", 1)
    reader.join(timeout=6)
    assert [env.request_id for _, env in got] == [rid] and time.monotonic() - started < 2


def test_acks_give_the_tenants_queued_tokens_back_exactly_once(redis_client: redis.Redis) -> None:
    pool = _pool()
    producer = Producer(redis_client, pool)
    data = [{"model_input": [1, 2, 3], "loss_fn_inputs": {}}, {"model_input": [4, 5], "loss_fn_inputs": {}}]
    for seq in (1, 2):
        producer.submit(Envelope.new(tenant_id="t", model_id=f"m-{pool}", seq_id=seq, kind="forward", payload={"data": data}))
    assert int(redis_client.hget(keys.queued_tokens(pool), "t")) == 10
    consumer = Consumer(redis_client, pool, "c")
    entries = consumer.read(count=10)
    consumer.ack([entries[0][0]])
    assert int(redis_client.hget(keys.queued_tokens(pool), "t")) == 5
    consumer.ack([entries[0][0]])  # acked again (a redelivery answered twice): nothing more given back
    assert int(redis_client.hget(keys.queued_tokens(pool), "t")) == 5
    consumer.ack([entries[1][0]])
    assert redis_client.hget(keys.queued_tokens(pool), "t") is None


def test_one_ack_over_several_tenants_streams_after_the_script_cache_was_emptied(redis_client: redis.Redis) -> None:
    """A plan's entries of several tenants are acked in one pipelined round trip of the ack script by its hash; a
    Redis that lost its script cache (a restart) gets the script again and every entry is still acked once."""
    pool = _pool()
    producer = Producer(redis_client, pool)
    data = [{"model_input": [1, 2, 3], "loss_fn_inputs": {}}]
    for tenant in ("a", "b", "c"):
        producer.submit(Envelope.new(tenant_id=tenant, model_id=f"m-{tenant}-{pool}", seq_id=1, kind="forward",
                                     payload={"data": data}))  # fmt: skip
    consumer = Consumer(redis_client, pool, "c")
    entries = consumer.read(count=10)
    assert len(entries) == 3
    redis_client.script_flush()
    consumer.ack([ref for ref, _ in entries])
    assert consumer.pending_count() == 0
    assert all(redis_client.xlen(keys.request_stream(pool, t)) == 0 for t in ("a", "b", "c"))
    assert redis_client.hgetall(keys.queued_tokens(pool)) == {}


def test_entries_whose_read_answer_was_lost_come_back_after_rescan_pending(redis_client: redis.Redis) -> None:
    """Redis delivered entries (they are pending to this consumer) but the answer never reached the caller (the
    connection broke with a Redis restart; here the read's result is dropped): no ">" read returns them again, and
    after `rescan_pending` the next read does, once, before new entries."""
    pool = _pool()
    ids = _submit(redis_client, pool, 3)
    consumer = Consumer(redis_client, pool, "leader")
    consumer.read(count=10)  # delivered, and lost on the way
    extra = _submit(redis_client, pool, 1)
    assert [env.request_id for _, env in consumer.read(count=10)] == extra
    assert consumer.read(block_ms=50) == []  # the lost ones stay pending: only the stale-entry claim would find them

    consumer.rescan_pending()
    again = consumer.read(count=10)
    assert [env.request_id for _, env in again] == ids + extra  # every entry pending to it, in stream order
    assert consumer.read(block_ms=50) == []  # once
    consumer.ack([sid for sid, _ in again])
    assert consumer.pending_count() == 0


class _NewTenantDuringClaim:
    """The real client, except that its first XAUTOCLAIM first lets another thread's read pick up a new tenant's
    stream: the dispatcher's prefetch thread reads (and so refreshes the tenants) while the loop thread claims, and
    a thread switch at exactly that point cannot be caused otherwise (a wrapper, because the race is the fault)."""

    def __init__(self, real: redis.Redis, pool: str) -> None:
        self._real, self._pool, self.consumer, self.fired = real, pool, None, False

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def xautoclaim(self, *args, **kwargs):
        if not self.fired and self.consumer is not None:
            self.fired = True
            _xadd(self._real, self._pool, {"x": "1"}, tenant="late")
            self.consumer.refresh()  # what the prefetch thread's read does meanwhile
        return self._real.xautoclaim(*args, **kwargs)


def test_a_tenant_appearing_while_stale_entries_are_claimed_is_no_error(redis_client: redis.Redis) -> None:
    pool = _pool()
    _submit(redis_client, pool, 1)
    client = _NewTenantDuringClaim(redis_client, pool)
    consumer = Consumer(client, pool, "live")  # type: ignore[arg-type]
    consumer.refresh()
    client.consumer = consumer
    assert consumer.claim_stale(min_idle_ms=60_000) == []
    assert client.fired and "late" in consumer._backlog
