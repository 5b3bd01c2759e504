"""A dead pool failed over by a sibling (pool/failover.py) on a real redis-server and a real SQLite database: its
adapters and their unanswered entries go to live siblings once, its old leader is fenced out in Redis and SQL, a
second sweeper finds nothing to do, a late entry is forwarded, and nothing moves while the pool is not dead enough."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis
from sqlalchemy.orm import Session, sessionmaker

from loraplex.errors import LeaseLostError
from loraplex.pool.failover import FailoverSweeper
from loraplex.queue import handoff, keys, pool_registry
from loraplex.queue.consumer import Consumer
from loraplex.queue.envelope import Envelope
from loraplex.queue.lease import PoolLease
from loraplex.queue.pool_registry import PoolRegistration
from loraplex.queue.producer import Producer
from loraplex.queue.replay_log import read_after
from loraplex.storage.db import make_db_engine, migrate, session_factory, unit_of_work
from loraplex.storage.repositories import AdapterRepository, PoolRepository, TenantRepository
from tests.helpers.services.redis import redis_server


@pytest.fixture(scope="module")
def own_redis_url() -> Iterator[str]:
    """A redis-server of this module's own: the registry is fleet-wide."""
    with redis_server() as url:
        yield url


@pytest.fixture()
def client(own_redis_url: str) -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(own_redis_url)
    r.flushdb()
    yield r
    r.close()


@pytest.fixture()
def sessions(tmp_path) -> Iterator[sessionmaker[Session]]:
    url = f"sqlite:///{tmp_path / 'loraplex.db'}"
    migrate(url)
    engine = make_db_engine(url)
    yield session_factory(engine)
    engine.dispose()


def _fb(tenant: str, model: str, seq: int) -> Envelope:
    data = {"data": [{"model_input": [1, 2, 3], "loss_fn_inputs": {"target_tokens": [2, 3, 4]}}]}
    return Envelope.new(tenant_id=tenant, model_id=model, seq_id=seq, kind="forward_backward", payload=data)


def _register(client: redis.Redis, name: str, published_at: float, live: bool = True) -> None:
    reg = PoolRegistration(name=name, base_model="tiny", slots=2, max_rank=16, state="ready", published_at=published_at)
    pool_registry.publish(client, reg, ttl_s=30)
    if not live:
        pool_registry.withdraw(client, name)


def _fleet(client: redis.Redis, sessions: sessionmaker[Session], dead_since: float) -> tuple[str, list[str]]:
    """Pools dead (its last registration `dead_since` s ago), live-1 and live-2 of tiny; two adapters on dead, with
    entries queued (one read by its old leader), one answered into its request log. Returns (tenant, adapters)."""
    with unit_of_work(sessions) as db:
        tenant, _ = TenantRepository(db).create_tenant("acme")
        pools = PoolRepository(db)
        for name in ("dead", "live-1", "live-2"):
            pools.heartbeat(name, "tiny", 1, 2)
        for m in ("fa", "fb"):
            AdapterRepository(db, tenant.id).create(m, "tiny", 2, 4.0, ["q_proj"], seed=0, pool="dead")
    _register(client, "dead", time.time() - dead_since, live=False)
    _register(client, "live-1", time.time())
    _register(client, "live-2", time.time())
    producer = Producer(client, "dead")
    for m in ("fa", "fb"):
        for seq in (1, 2, 3):
            producer.submit(_fb(tenant.id, m, seq))
    old = Consumer(client, "dead", "old-leader")
    read = old.read(count=2)  # fa's 1 and 2 read; 1 answered into the log
    answered = [(ref, env) for ref, env in read if env.seq_id == 1]
    old.ack([ref for ref, _ in answered], {answered[0][0]: ("a", "fa", 1)})
    return tenant.id, ["fa", "fb"]


TTL = 0.3  # the lease TTL: a sweeper acts on a pool it has seen dead for that long


def _sweeper(client: redis.Redis, sessions: sessionmaker[Session], pool: str = "live-1") -> FailoverSweeper:
    return FailoverSweeper(pool=pool, base_model="tiny", redis=client, sessions=sessions, after_s=5.0, lease_ttl_s=TTL)


def _sweep(sweeper: FailoverSweeper) -> dict[str, dict[str, str]]:
    """Two rounds one lease TTL apart (the first sights the dead pools); what both failed over."""
    first = sweeper.sweep()
    time.sleep(TTL + 0.05)
    return first | sweeper.sweep()


def test_a_dead_pools_adapters_go_to_live_siblings_once_and_its_old_leader_is_fenced_out(
    client: redis.Redis, sessions: sessionmaker[Session]
) -> None:
    old_lease = PoolLease(client, "dead", ttl_s=5.0)
    assert old_lease.try_acquire()
    with unit_of_work(sessions) as db:
        PoolRepository(db).take_leadership("dead", old_lease.token or 0, "tiny", 1, 2)
    tenant, adapters = _fleet(client, sessions, dead_since=60)
    sweeper = _sweeper(client, sessions)
    assert _sweep(sweeper) == {}  # its lease is live: not dead
    client.delete(keys.pool_leader("dead"))  # the lease lapsed: nobody renewed it
    assert sweeper.sweep() == {}  # seen dead the first time: it has one lease TTL to come back

    time.sleep(TTL + 0.05)
    moved = sweeper.sweep()
    assert moved == {"dead": {"fa": "live-1", "fb": "live-2"}}  # spread by the placement rule, one by one
    assert _sweep(_sweeper(client, sessions, "live-2")) == {}  # a second sibling: nothing left to do
    assert not client.exists(keys.pool_leader("dead"))  # released: the pool's next process takes it at once
    with sessions() as db:
        pools = PoolRepository(db)
        assert [pools.adapter(m).pool for m in adapters] == ["live-1", "live-2"]
        assert pools.live_adapters_on("dead") == []
        with pytest.raises(LeaseLostError):  # the old leader's record transactions are refused
            pools.check_leader("dead", old_lease.token or 0)
    assert not old_lease.renew() and old_lease.lost  # and its Redis writes
    for m, target in (("fa", "live-1"), ("fb", "live-2")):
        assert handoff.meet(client, target, m) == (None, True)  # adopt orders
        assert handoff.moved_to(client, "dead", m) == target
        got = [env.seq_id for _, env in Consumer(client, target, "leader").read(count=10)]
        assert got == ([2, 3] if m == "fa" else [1, 2, 3])  # each unanswered entry once, the answered one not
    assert [e.seq_id for e in read_after(client, "live-1", "fa", None)] == [1]  # the request log went along
    assert client.xlen(keys.request_stream("dead", tenant)) == 0

    late = Producer(client, "dead").submit(_fb(tenant, "fb", 4))  # a gateway that read the old placement
    assert sweeper.sweep() == {}
    assert [env.request_id for _, env in Consumer(client, "live-2", "later").read(count=10)] == [late]
    assert client.xlen(keys.request_stream("dead", tenant)) == 0


def test_a_pool_not_dead_long_enough_or_with_no_open_sibling_keeps_its_adapters(
    client: redis.Redis, sessions: sessionmaker[Session]
) -> None:
    _fleet(client, sessions, dead_since=2)  # under the 5 s
    sweeper = _sweeper(client, sessions)
    assert _sweep(sweeper) == {}
    with unit_of_work(sessions) as db:  # dead long enough, but both siblings drained
        client.hset(keys.fleet_last_seen(), "dead", repr(time.time() - 60))
        PoolRepository(db).set_draining("live-1", True)
        PoolRepository(db).set_draining("live-2", True)
    assert _sweep(sweeper) == {}
    with sessions() as db:
        assert PoolRepository(db).live_adapters_on("dead") == ["fa", "fb"]
    assert not client.exists(keys.pool_leader("dead")) and handoff.moved_away(client, "dead") == {}
