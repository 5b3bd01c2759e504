"""One leader per pool, on a real redis-server and SQLite: the lease (queue/lease.py) and its fencing token in the
pool's writes (results in Redis, SQL records and checkpoint rows). Before: there was no lease, and a second pool
process wrote results and records next to the first."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from loraplex.errors import LeaseLostError
from loraplex.pool.finish import PlanFinish
from loraplex.protocol import BatchPlan, Outcome, PlannedRequest, RequestKind, Step, StepKind
from loraplex.protocol.results import OptimStepResult, SaveResult
from loraplex.queue import keys
from loraplex.queue.keys import JobState
from loraplex.queue.lease import PoolLease
from loraplex.queue.results import ResultStore
from loraplex.storage.db import make_db_engine, migrate, session_factory, unit_of_work
from loraplex.storage.models import Checkpoint, Usage
from loraplex.storage.repositories import AdapterRepository, PoolRepository, TenantRepository

TTL_S = 0.3
_pools = itertools.count()


@pytest.fixture
def pool() -> str:
    return f"lease-{next(_pools)}-{time.monotonic_ns()}"


def _lapse() -> None:
    time.sleep(TTL_S + 0.15)


def test_one_holder_at_a_time_and_a_takeover_gets_a_larger_token(redis_client: redis.Redis, pool: str) -> None:
    first, second = PoolLease(redis_client, pool, TTL_S, "first"), PoolLease(redis_client, pool, TTL_S, "second")
    assert first.try_acquire()
    assert not second.try_acquire()  # refused while the first one's lease is live
    now = second.current()
    assert now is not None and (now.token, now.holder) == (first.token, "first")
    assert first.renew()
    time.sleep(TTL_S * 0.7)
    assert first.renew() and not second.try_acquire()  # renewed: still live past its first TTL
    time.sleep(TTL_S * 0.7)
    assert not second.try_acquire()
    _lapse()  # the first stops renewing (it was killed): the lease lapses
    assert second.try_acquire()
    assert second.token is not None and first.token is not None and second.token > first.token
    # The deposed holder can neither renew nor release the new holder's lease, and learns it lost.
    lost: list[str] = []
    first.on_lost(lost.append)
    assert not first.renew()
    assert first.lost and lost and "held by second" in lost[0]
    assert not first.release()
    assert second.current() == now.__class__(second.token, "second")
    # A release by the holder frees it at once, and the next token is larger again.
    assert second.release() and second.current() is None
    third = PoolLease(redis_client, pool, TTL_S, "third")
    assert third.try_acquire() and third.token is not None and third.token > second.token


def test_the_token_passes_the_floor_the_database_saw(redis_client: redis.Redis, pool: str) -> None:
    """Redis lost its counter (a restart without persistence): the database's last token keeps tokens increasing."""
    lease = PoolLease(redis_client, pool, TTL_S, "a")
    assert lease.try_acquire(floor=41) and lease.token == 42
    assert lease.release()
    assert lease.try_acquire(floor=0) and lease.token == 43


def test_a_lapsed_lease_nobody_took_is_still_ours(redis_client: redis.Redis, pool: str) -> None:
    """A holder that was paused past its TTL, with no other process acquiring meanwhile, is still the only leader:
    renewing re-claims it under the same token. Once anyone else acquired, it can never come back."""
    lease = PoolLease(redis_client, pool, TTL_S, "a")
    assert lease.try_acquire()
    _lapse()
    assert lease.current() is None and lease.renew() and not lease.lost
    now = lease.current()
    assert now is not None and now.token == lease.token


def test_the_keeper_thread_renews_and_reports_a_loss(redis_client: redis.Redis, pool: str) -> None:
    lease = PoolLease(redis_client, pool, TTL_S, "kept")
    assert lease.try_acquire()
    lease.keep()
    time.sleep(TTL_S * 3)
    assert not PoolLease(redis_client, pool, TTL_S, "other").try_acquire()  # kept alive by the thread
    redis_client.set(keys.pool_leader(pool), "999 usurper", px=5000)  # another process's lease
    redis_client.set(keys.pool_leader_token(pool), "999")
    deadline = time.monotonic() + TTL_S * 3
    while not lease.lost and time.monotonic() < deadline:
        time.sleep(0.02)
    assert lease.lost and "usurper" in lease.lost_reason


# --- fencing: a superseded token writes nothing -----------------------------------------------------------------


def _takeover(redis_client: redis.Redis, pool: str) -> tuple[PoolLease, PoolLease]:
    """The old leader acquired, lapsed, and a new one took over: (old, new)."""
    old, new = PoolLease(redis_client, pool, TTL_S, "old"), PoolLease(redis_client, pool, TTL_S, "new")
    assert old.try_acquire()
    _lapse()
    assert new.try_acquire()
    return old, new


def test_a_result_write_with_a_superseded_token_is_refused_and_leaves_nothing(
    redis_client: redis.Redis, pool: str
) -> None:
    old, new = PoolLease(redis_client, pool, TTL_S, "old"), PoolLease(redis_client, pool, TTL_S, "new")
    assert old.try_acquire()
    store = ResultStore(redis_client, lease=old)
    store.put_many([Outcome(f"{pool}-ok", result=OptimStepResult({"loss": 1.0}))])  # while it leads: written
    assert store.get(f"{pool}-ok") is not None and store.state(f"{pool}-ok") == JobState.COMPLETE
    _lapse()
    assert new.try_acquire()
    ids = [f"{pool}-r{i}" for i in range(3)]
    with pytest.raises(LeaseLostError, match="no longer leads"):
        store.put_many([Outcome(rid, result=OptimStepResult({"loss": 2.0})) for rid in ids])
    assert old.lost
    with pytest.raises(LeaseLostError):
        store.set_states(ids, JobState.RUNNING)
    names = [k(rid) for rid in ids for k in (keys.result_key, keys.state_key, keys.notify_key)]
    assert redis_client.exists(*names) == 0  # nothing behind: no result, no state, no notify token
    ResultStore(redis_client, lease=new).put_many([Outcome(ids[0], result=OptimStepResult({"loss": 3.0}))])  # the new leader's lands
    assert (store.get(ids[0]) or Outcome("")).result == OptimStepResult({"loss": 3.0})


@pytest.fixture
def sessions(tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    url = f"sqlite:///{tmp_path / 'loraplex.db'}"
    migrate(url)
    engine = make_db_engine(url)
    yield session_factory(engine)
    engine.dispose()


def _tenant_with_adapter(sessions: sessionmaker[Session], model_id: str) -> str:
    with unit_of_work(sessions) as s:
        tenant, _ = TenantRepository(s).create_tenant("fenced")
        AdapterRepository(s, tenant.id).create(model_id, "tiny", 4, 8.0, ["q_proj"], seed=0)
        return tenant.id


def _take(sessions: sessionmaker[Session], pool: str, lease: PoolLease) -> None:
    with unit_of_work(sessions) as s:
        assert PoolRepository(s).take_leadership(pool, lease.token or 0, "tiny", 1, 8)


def test_a_record_write_with_a_superseded_token_is_refused_and_leaves_nothing(
    redis_client: redis.Redis, sessions: sessionmaker[Session], pool: str
) -> None:
    tenant = _tenant_with_adapter(sessions, "m")
    old, new = _takeover(redis_client, pool)
    _take(sessions, pool, old)  # the old leader's token in the pools row ...
    fb = PlannedRequest(
        "r1", tenant, "m", 1, RequestKind.FORWARD_BACKWARD,
        {"data": [{"model_input": [1, 2, 3], "loss_fn_inputs": {}}], "loss_fn": "cross_entropy"},
    )  # fmt: skip
    plan = BatchPlan((Step(StepKind.FORWARD_BACKWARD, (fb,)),))
    finish = PlanFinish(sessions, pool=pool, lease=old)
    finish.record(plan, [Outcome("r1", result=OptimStepResult())], 0.01)  # still the pool row's leader: recorded
    _take(sessions, pool, new)  # ... until the new leader writes its own
    fb2 = PlannedRequest("r2", tenant, "m", 2, RequestKind.FORWARD_BACKWARD, fb.payload)
    plan2 = BatchPlan((Step(StepKind.FORWARD_BACKWARD, (fb2,)),))
    with pytest.raises(LeaseLostError, match="no longer leads"):
        finish.record(plan2, [Outcome("r2", result=OptimStepResult())], 0.01)
    assert old.lost
    with sessions() as s:
        assert AdapterRepository(s, tenant).get("m").applied_seq_id == 1  # the refused plan's seq_id 2 is not there
        assert s.scalar(select(func.count()).select_from(Usage)) == 1  # nor its usage row
    PlanFinish(sessions, pool=pool, lease=new).record(plan2, [Outcome("r2", result=OptimStepResult())], 0.01)
    with sessions() as s:
        assert AdapterRepository(s, tenant).get("m").applied_seq_id == 2


def test_a_checkpoint_row_with_a_superseded_token_is_refused_and_leaves_nothing(
    redis_client: redis.Redis, sessions: sessionmaker[Session], pool: str
) -> None:
    tenant = _tenant_with_adapter(sessions, "m")
    old, new = _takeover(redis_client, pool)
    _take(sessions, pool, new)
    save = PlannedRequest(
        "s1", tenant, "m", 1, RequestKind.SAVE_STATE,
        {"name": "c1", "path": "tinker://m/weights/c1", "blob_uri": "file:///nowhere/c1", "base_model": "tiny"},
    )  # fmt: skip
    plan = BatchPlan((Step(StepKind.CHECKPOINT, (save,)),))
    # the save went well (its files are not the point here)
    saved = [Outcome("s1", result=SaveResult(path="tinker://m/weights/c1", kind="state", name="c1", step=1,
                                              size_bytes=1, sha256="x"))]  # fmt: skip
    with pytest.raises(LeaseLostError):
        PlanFinish(sessions, pool=pool, lease=old).record(plan, saved)
    assert old.lost
    with sessions() as s:
        assert s.scalar(select(func.count()).select_from(Checkpoint)) == 0
        assert AdapterRepository(s, tenant).get("m").applied_seq_id is None  # nor its seq_id
    outcomes = PlanFinish(sessions, pool=pool, lease=new).record(plan, saved)
    assert outcomes[0].ok
    with sessions() as s:
        assert s.scalar(select(func.count()).select_from(Checkpoint)) == 1
