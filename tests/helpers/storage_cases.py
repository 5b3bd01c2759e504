"""Repository and unit-of-work test bodies that run on both backends: tests/unit/storage/test_storage_repositories.py and
test_storage_uow.py import them (SQLite), tests/integration/test_storage_postgres.py imports them too (PostgreSQL).
Each of those modules defines the `factory` fixture (a migrated, empty database of its backend) that these take; pytest
collects the imported test functions as the importing module's own tests."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from loraplex import errors
from loraplex.protocol.checkpoint_paths import TinkerPath
from loraplex.storage.db import unit_of_work
from loraplex.storage.enums import AdapterStatus, CheckpointKind, PoolState
from loraplex.storage.models import Adapter, ApiKey, Tenant
from loraplex.storage.repositories import (
    AdapterRepository,
    CheckpointRepository,
    PoolRepository,
    SessionRepository,
    TenantRepository,
    UsageRepository,
    hash_api_key,
)
from loraplex.storage.repositories._common import add_or_conflict
from loraplex.storage.repositories.usage import record_usage_of_tenants


def _tenant(factory: sessionmaker[Session], name: str) -> tuple[str, str]:
    with unit_of_work(factory) as s:
        tenant, key = TenantRepository(s).create_tenant(name)
        return tenant.id, key


def _adapter(factory: sessionmaker[Session], tenant_id: str, model_id: str, rank: int = 8) -> None:
    with unit_of_work(factory) as s:
        AdapterRepository(s, tenant_id).create(model_id, "tiny", rank, 16.0, ["q_proj", "v_proj"], seed=7)


# --- tenants and keys -------------------------------------------------------------------------------------------


def test_created_key_authenticates_its_tenant(factory: sessionmaker[Session]) -> None:
    tenant_id, key = _tenant(factory, "acme")
    assert key.startswith("tml-") and len(key) > 40
    with factory() as s:
        assert TenantRepository(s).authenticate(key).id == tenant_id
        assert TenantRepository(s).get_by_name("acme").id == tenant_id


def test_only_the_key_hash_is_stored(factory: sessionmaker[Session]) -> None:
    tenant_id, key = _tenant(factory, "acme")
    with factory() as s:
        (row,) = s.scalars(select(ApiKey).where(ApiKey.tenant_id == tenant_id)).all()
        assert row.key_hash == hash_api_key(key) and len(row.key_hash) == 64
        assert row.prefix == key[:8]
        stored = [str(v) for r in s.execute(select(ApiKey.__table__)).all() for v in r]
        assert not any(key in v for v in stored)


def test_wrong_key_is_rejected(factory: sessionmaker[Session]) -> None:
    _, key = _tenant(factory, "acme")
    wrong = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
    with factory() as s, pytest.raises(errors.AuthenticationError):
        TenantRepository(s).authenticate(wrong)


def test_revoked_key_is_rejected_and_other_keys_still_work(factory: sessionmaker[Session]) -> None:
    tenant_id, first = _tenant(factory, "acme")
    with unit_of_work(factory) as s:
        second = TenantRepository(s).issue_key(tenant_id)
        (key_row,) = [k for k in TenantRepository(s).list_keys(tenant_id) if k.key_hash == hash_api_key(first)]
        TenantRepository(s).revoke_key(tenant_id, key_row.id)
    with factory() as s:
        with pytest.raises(errors.AuthenticationError):
            TenantRepository(s).authenticate(first)
        assert TenantRepository(s).authenticate(second).id == tenant_id


@pytest.mark.parametrize(
    "key", [None, "", "sk-abcdefghijklmnopqrstuvwxyz", "tml-short", "tml-" + "x" * 20 + "!", 12345]
)
def test_missing_or_malformed_keys_are_rejected(factory: sessionmaker[Session], key: object) -> None:
    _tenant(factory, "acme")
    with factory() as s, pytest.raises(errors.AuthenticationError):
        TenantRepository(s).authenticate(key)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["", "x" * 65, "has space", "slash/name", "ünï"])
def test_bad_tenant_names_are_rejected(factory: sessionmaker[Session], name: str) -> None:
    with unit_of_work(factory) as s, pytest.raises(errors.InvalidRequestError):
        TenantRepository(s).create_tenant(name)


def test_duplicate_tenant_name_conflicts(factory: sessionmaker[Session]) -> None:
    _tenant(factory, "acme.team-1_x")
    with pytest.raises(errors.ConflictError), unit_of_work(factory) as s:
        TenantRepository(s).create_tenant("acme.team-1_x")


def test_unique_clash_becomes_conflict_and_keeps_the_transaction(factory: sessionmaker[Session]) -> None:
    _tenant(factory, "acme")
    with unit_of_work(factory) as s:
        # What a concurrent insert of the same name looks like after the pre-check passed.
        with pytest.raises(errors.ConflictError):
            add_or_conflict(s, Tenant(name="acme"), "dup")
        TenantRepository(s).create_tenant("other")
    with factory() as s:
        assert sorted(t.name for t in TenantRepository(s).list()) == ["acme", "other"]


# --- adapters ---------------------------------------------------------------------------------------------------


def test_adapters_are_scoped_to_their_tenant(factory: sessionmaker[Session]) -> None:
    a, _ = _tenant(factory, "a")
    b, _ = _tenant(factory, "b")
    _adapter(factory, a, "a-model")
    _adapter(factory, b, "b-model")
    with factory() as s:
        assert AdapterRepository(s, a).get("a-model").tenant_id == a
        assert [x.model_id for x in AdapterRepository(s, a).list()] == ["a-model"]
        assert [x.model_id for x in AdapterRepository(s, b).list()] == ["b-model"]
        with pytest.raises(errors.NotFoundError) as foreign:
            AdapterRepository(s, b).get("a-model")
        with pytest.raises(errors.NotFoundError) as missing:
            AdapterRepository(s, b).get("no-such-model")
        # Same wording either way: a foreign id is never confirmed to exist.
        assert str(foreign.value) == str(missing.value).replace("no-such-model", "a-model")
    for write in (
        lambda r: r.set_status("a-model", AdapterStatus.READY),
        lambda r: r.mark_deleted("a-model"),
        lambda r: r.record_applied("a-model", 3),
    ):
        with pytest.raises(errors.NotFoundError), unit_of_work(factory) as s:
            write(AdapterRepository(s, b))
    with factory() as s:
        untouched = AdapterRepository(s, a).get("a-model")
        assert (untouched.status, untouched.applied_seq_id) == (AdapterStatus.CREATING, None)


def test_adapter_fields_round_trip(factory: sessionmaker[Session]) -> None:
    a, _ = _tenant(factory, "a")
    with unit_of_work(factory) as s:
        AdapterRepository(s, a).create(
            "s1:train:0", "tiny", 4, 8.0, ["q_proj"], seed=2**40, session_id="s1", user_metadata={"run": [1, 2]}
        )
    with factory() as s:
        got = AdapterRepository(s, a).get("s1:train:0")
        assert (got.base_model, got.rank, got.alpha, got.seed) == ("tiny", 4, 8.0, 2**40)
        assert got.target_modules == ["q_proj"] and got.user_metadata == {"run": [1, 2]}
        assert got.status is AdapterStatus.CREATING and got.session_id == "s1"
        assert [x.model_id for x in AdapterRepository(s, a).list(session_id="s1")] == ["s1:train:0"]
        # Stored as the enum's value, so raw SQL and other backends read the same text.
        assert s.execute(select(Adapter.__table__.c.status)).scalar_one() == "creating"


def test_deleted_adapter_is_gone_but_its_id_stays_taken(factory: sessionmaker[Session]) -> None:
    a, _ = _tenant(factory, "a")
    b, _ = _tenant(factory, "b")
    _adapter(factory, a, "m")
    with unit_of_work(factory) as s:
        AdapterRepository(s, a).mark_deleted("m")
    with factory() as s:
        with pytest.raises(errors.NotFoundError):
            AdapterRepository(s, a).get("m")
        assert AdapterRepository(s, a).list() == []
        assert [x.status for x in AdapterRepository(s, a).list(include_deleted=True)] == [AdapterStatus.DELETED]
    for tenant in (a, b):
        with pytest.raises(errors.ConflictError):
            _adapter(factory, tenant, "m")


def test_deleted_adapters_are_reachable_only_when_asked(factory: sessionmaker[Session]) -> None:
    a, _ = _tenant(factory, "a")
    b, _ = _tenant(factory, "b")
    _adapter(factory, a, "m")
    with unit_of_work(factory) as s:
        AdapterRepository(s, a).record_applied("m", 1)
        AdapterRepository(s, a).mark_deleted("m")
    with pytest.raises(errors.NotFoundError), unit_of_work(factory) as s:
        AdapterRepository(s, a).record_applied("m", 2)
    with unit_of_work(factory) as s:
        # Requests queued before the delete still advance the order (the dispatcher records them).
        assert AdapterRepository(s, a).record_applied("m", 2, include_deleted=True) == 2
        assert AdapterRepository(s, a).get("m", include_deleted=True).status is AdapterStatus.DELETED
    with factory() as s:
        with pytest.raises(errors.NotFoundError):
            AdapterRepository(s, b).get("m", include_deleted=True)
        with pytest.raises(errors.NotFoundError):
            AdapterRepository(s, b).record_applied("m", 3, include_deleted=True)


@pytest.mark.parametrize(
    ("rank", "alpha", "modules"),
    [(0, 16.0, ["q_proj"]), (8, 0.0, ["q_proj"]), (8, float("nan"), ["q_proj"]), (8, 16.0, []), (8, 16.0, "q_proj")],
)
def test_bad_adapter_config_is_rejected(
    factory: sessionmaker[Session], rank: int, alpha: float, modules: object
) -> None:
    a, _ = _tenant(factory, "a")
    with pytest.raises(errors.InvalidRequestError), unit_of_work(factory) as s:
        AdapterRepository(s, a).create("m", "tiny", rank, alpha, modules, seed=0)  # type: ignore[arg-type]


def test_applied_seq_id_only_increases(factory: sessionmaker[Session]) -> None:
    a, _ = _tenant(factory, "a")
    _adapter(factory, a, "m")
    with unit_of_work(factory) as s:
        repo = AdapterRepository(s, a)
        loaded = repo.get("m")
        assert repo.record_applied("m", 5) == 5
        assert loaded.applied_seq_id == 5 and loaded.last_used_at is not None  # the loaded copy is refreshed
        first_use = loaded.last_used_at
        assert repo.record_applied("m", 3) == 5
        assert repo.record_applied("m", 5) == 5
        assert loaded.last_used_at >= first_use
    with unit_of_work(factory) as s:
        assert AdapterRepository(s, a).record_applied("m", 9) == 9
    with factory() as s:
        assert AdapterRepository(s, a).get("m").applied_seq_id == 9
    with pytest.raises(errors.InvalidRequestError), unit_of_work(factory) as s:
        AdapterRepository(s, a).record_applied("m", -1)


def test_a_plans_applied_seq_ids_and_usage_go_in_one_statement_each_and_never_backwards(
    factory: sessionmaker[Session],
) -> None:
    """The pool's per-plan record (pool/records.py): every adapter's applied seq_id in one UPDATE, each as
    `record_applied(include_deleted=True)` (the max, deleted adapters too, last_used_at touched; another tenant's
    pairing and a missing row change nothing), and every tenant's usage in one INSERT."""
    a, _ = _tenant(factory, "a")
    b, _ = _tenant(factory, "b")
    for tenant, model_id in ((a, "m1"), (b, "m2"), (a, "m3")):
        _adapter(factory, tenant, model_id)
    with unit_of_work(factory) as s:
        AdapterRepository(s, a).mark_deleted("m3")
        loaded = AdapterRepository(s, a).get("m1")
        PoolRepository(s).record_applied({(a, "m1"): 3, (b, "m2"): 5, (a, "m3"): 2, (a, "gone"): 4})
        assert loaded.applied_seq_id == 3 and loaded.last_used_at is not None  # the loaded copy is refreshed
    with unit_of_work(factory) as s:
        PoolRepository(s).record_applied({(a, "m1"): 2, (b, "m2"): 7, (b, "m1"): 9})
        record_usage_of_tenants(s, {a: [("m1", "forward_backward", 10, 0.5), ("m1", "forward", 4, 0.25)],
                                    b: [("m2", "forward_backward", 6, 0.5)]})  # fmt: skip
    with factory() as s:
        applied = {m: PoolRepository(s).applied_seq_id(m) for m in ("m1", "m2", "m3")}
        assert applied == {"m1": 3, "m2": 7, "m3": 2}
        assert (UsageRepository(s, a).totals().tokens, UsageRepository(s, b).totals().tokens) == (14, 6)
    with pytest.raises(errors.InvalidRequestError), unit_of_work(factory) as s:
        record_usage_of_tenants(s, {a: [("m1", "forward_backward", -1, 0.5)]})


def test_status_changes(factory: sessionmaker[Session]) -> None:
    a, _ = _tenant(factory, "a")
    _adapter(factory, a, "m")
    with unit_of_work(factory) as s:
        AdapterRepository(s, a).set_status("m", AdapterStatus.READY)
    with factory() as s:
        assert AdapterRepository(s, a).get("m").status is AdapterStatus.READY


# --- checkpoints, sessions, usage, pools -----------------------------------------------------------------------


def test_checkpoints(factory: sessionmaker[Session]) -> None:
    a, _ = _tenant(factory, "a")
    b, _ = _tenant(factory, "b")
    _adapter(factory, a, "m")
    expires = datetime.now(UTC) + timedelta(days=7)
    with unit_of_work(factory) as s:
        repo = CheckpointRepository(s, a)
        repo.add("m", CheckpointKind.STATE, "step-1", "file:///x/1", 10, "0" * 64, step=1, expires_at=expires)
        repo.add("m", CheckpointKind.SAMPLER, "step-1", "file:///x/2", 20, "1" * 64, step=1)
    with pytest.raises(errors.ConflictError), unit_of_work(factory) as s:
        CheckpointRepository(s, a).add("m", CheckpointKind.STATE, "step-1", "file:///x/3", 1, "2" * 64)
    with pytest.raises(errors.NotFoundError), unit_of_work(factory) as s:
        CheckpointRepository(s, b).add("m", CheckpointKind.STATE, "b-sneaks-in", "file:///x/4", 1, "3" * 64)
    with factory() as s:
        got = CheckpointRepository(s, a).get("m", CheckpointKind.STATE, "step-1")
        assert (got.size_bytes, got.step, got.blob_uri) == (10, 1, "file:///x/1")
        assert got.expires_at == expires
        assert len(CheckpointRepository(s, a).list("m")) == 2
        assert [c.kind for c in CheckpointRepository(s, a).list("m", CheckpointKind.SAMPLER)] == ["sampler"]
        assert CheckpointRepository(s, b).list("m") == []
        with pytest.raises(errors.NotFoundError):
            CheckpointRepository(s, b).get("m", CheckpointKind.STATE, "step-1")
    with unit_of_work(factory) as s:
        removed = CheckpointRepository(s, a).delete("m", CheckpointKind.STATE, "step-1")
        assert removed.blob_uri == "file:///x/1"
    with factory() as s:
        assert [c.name for c in CheckpointRepository(s, a).list("m")] == ["step-1"]


def test_pages_latest_of_and_bulk_delete_across_adapters(factory: sessionmaker[Session]) -> None:
    a, _ = _tenant(factory, "a")
    b, _ = _tenant(factory, "b")
    for model_id in ("m1", "m2"):
        _adapter(factory, a, model_id)
    _adapter(factory, b, "theirs")
    made = [("m1", CheckpointKind.STATE, "s1", 1), ("m2", CheckpointKind.SAMPLER, "w1", 1),
            ("m1", CheckpointKind.STATE, "s2", 2), ("m1", CheckpointKind.SAMPLER, "w2", 2)]  # fmt: skip
    for model_id, kind, name, step in made:  # one transaction each: created_at increases
        with unit_of_work(factory) as s:
            CheckpointRepository(s, a).add(model_id, kind, name, f"file:///x/{name}", 1, "0" * 64, step=step)
    with unit_of_work(factory) as s:
        CheckpointRepository(s, b).add("theirs", CheckpointKind.STATE, "s1", "file:///y/s1", 1, "0" * 64)
        AdapterRepository(s, a).mark_deleted("m1")
    with factory() as s:
        repo = CheckpointRepository(s, a)
        assert repo.count() == 4 and CheckpointRepository(s, b).count() == 1
        assert [c.name for c in repo.page(3, 0)] == ["w2", "s2", "w1"]
        assert [c.name for c in repo.page(3, 3)] == ["s1"] and repo.page(3, 4) == []
        latest = {key: c.name for key, c in repo.latest_of(["m1", "m2", "theirs", "none"]).items()}
        assert latest == {("m1", "state"): "s2", ("m1", "sampler"): "w2", ("m2", "sampler"): "w1"}
        assert repo.latest_of([]) == {}
        adapters = AdapterRepository(s, a)
        assert adapters.count() == 1 and adapters.count(include_deleted=True) == 2
        assert [x.model_id for x in adapters.page(10, 0, include_deleted=True)] == ["m2", "m1"]
        assert [x.model_id for x in adapters.page(1, 1, include_deleted=True)] == ["m1"]
        assert [x.model_id for x in adapters.page(10, 0)] == ["m2"]
    paths = [TinkerPath("m1", CheckpointKind.STATE, "s1"), TinkerPath("m2", CheckpointKind.SAMPLER, "w1")]
    for bad in (TinkerPath("theirs", CheckpointKind.STATE, "s1"), TinkerPath("m1", CheckpointKind.SAMPLER, "s1")):
        with pytest.raises(errors.NotFoundError, match=str(bad)), unit_of_work(factory) as s:
            CheckpointRepository(s, a).delete_many([*paths, bad])
    with unit_of_work(factory) as s:
        assert [c.blob_uri for c in CheckpointRepository(s, a).delete_many(paths)] == ["file:///x/s1", "file:///x/w1"]
        expires = datetime.now(UTC) + timedelta(hours=1)
        assert CheckpointRepository(s, a).set_expiry("m1", CheckpointKind.STATE, "s2", expires).expires_at == expires
        with pytest.raises(errors.NotFoundError):
            CheckpointRepository(s, b).set_expiry("m1", CheckpointKind.STATE, "s2", None)
    with factory() as s:
        assert sorted(c.name for c in CheckpointRepository(s, a).page(10, 0)) == ["s2", "w2"]
        assert CheckpointRepository(s, b).count() == 1
        assert CheckpointRepository(s, a).get("m1", CheckpointKind.STATE, "s2").expires_at == expires


def test_session_lifecycle(factory: sessionmaker[Session]) -> None:
    a, _ = _tenant(factory, "a")
    b, _ = _tenant(factory, "b")
    with unit_of_work(factory) as s:
        sid = SessionRepository(s, a).create(tags=["rl"], user_metadata={"k": "v"})
    with unit_of_work(factory) as s:
        before = SessionRepository(s, a).get(sid).last_heartbeat_at
        assert SessionRepository(s, a).heartbeat(sid).last_heartbeat_at >= before
    with factory() as s, pytest.raises(errors.NotFoundError):
        SessionRepository(s, b).get(sid)
    with unit_of_work(factory) as s:
        SessionRepository(s, a).finish(sid, "success")
        SessionRepository(s, a).finish(sid, "errored")  # idempotent: the first reason stays
    with factory() as s:
        row = SessionRepository(s, a).get(sid)
        assert (row.finish_reason, row.tags, row.user_metadata) == ("success", ["rl"], {"k": "v"})
        assert row.finished_at is not None and SessionRepository(s, a).list(active_only=True) == []
    with pytest.raises(errors.GoneError), unit_of_work(factory) as s:
        SessionRepository(s, a).heartbeat(sid)


def test_usage_totals_are_per_tenant(factory: sessionmaker[Session]) -> None:
    a, _ = _tenant(factory, "a")
    b, _ = _tenant(factory, "b")
    with unit_of_work(factory) as s:
        UsageRepository(s, a).record("m1", "forward_backward", 100, 0.5)
        UsageRepository(s, a).record("m1", "forward_backward", 50, 0.25)
        UsageRepository(s, a).record("m2", "sample", 7, 1.0)
        UsageRepository(s, b).record(None, "sample", 1000, 9.0)
    with factory() as s:
        totals = UsageRepository(s, a).totals()
        assert (totals.tokens, totals.seconds, totals.records) == (157, 1.75, 3)
        assert totals.by_kind["forward_backward"].tokens == 150 and totals.by_kind["sample"].records == 1
        assert UsageRepository(s, a).totals(model_id="m2").tokens == 7
        assert UsageRepository(s, a).totals(since=datetime.now(UTC) + timedelta(hours=1)).records == 0
        assert UsageRepository(s, b).totals().tokens == 1000


def test_pool_heartbeat_upserts(factory: sessionmaker[Session]) -> None:
    with unit_of_work(factory) as s:
        first = PoolRepository(s).heartbeat("default", "tiny", 2, 8)
        started = first.started_at
    with unit_of_work(factory) as s:
        again = PoolRepository(s).heartbeat("default", "tiny", 4, 16)
        assert (again.world_size, again.slots, again.started_at) == (4, 16, started)
        assert again.heartbeat_at >= started
    with factory() as s:
        assert [p.name for p in PoolRepository(s).list(alive_within=timedelta(minutes=1))] == ["default"]
        assert PoolRepository(s).list(alive_within=timedelta(seconds=-60)) == []
        with pytest.raises(errors.NotFoundError):
            PoolRepository(s).get("other")


def test_pool_leadership_goes_to_larger_tokens_and_fences_the_old_one(factory: sessionmaker[Session]) -> None:
    with unit_of_work(factory) as s:
        assert PoolRepository(s).take_leadership("fenced", 3, "tiny", 1, 8)  # creates the row
    with unit_of_work(factory) as s:
        PoolRepository(s).check_leader("fenced", 3)
        assert PoolRepository(s).heartbeat("fenced", "tiny", 1, 8).leader_token == 3  # a heartbeat keeps it
    with unit_of_work(factory) as s:
        assert PoolRepository(s).take_leadership("fenced", 5, "tiny", 1, 8)
        assert not PoolRepository(s).take_leadership("fenced", 4, "tiny", 1, 8)  # an older token never takes it back
    with factory() as s:
        assert PoolRepository(s).leader_token("fenced") == 5 and PoolRepository(s).leader_token("other") is None
        with pytest.raises(errors.LeaseLostError, match="token 3 no longer leads"):
            PoolRepository(s).check_leader("fenced", 3)
        with pytest.raises(errors.LeaseLostError):
            PoolRepository(s).check_leader("other", 3)
        PoolRepository(s).check_leader("fenced", 5)


def test_pool_state_is_recorded(factory: sessionmaker[Session]) -> None:
    with unit_of_work(factory) as s:
        assert PoolRepository(s).heartbeat("p", "tiny", 1, 8).state == PoolState.READY  # older pools: ready
        assert PoolRepository(s).heartbeat("p", "tiny", 1, 8, state=PoolState.LOADING).state == PoolState.LOADING
        assert PoolRepository(s).heartbeat("p", "tiny", 1, 8).state == PoolState.LOADING  # kept when not given
        PoolRepository(s).set_state("p", PoolState.STOPPED)
        PoolRepository(s).set_state("nobody", PoolState.STOPPED)  # no row: nothing to do
    with factory() as s:
        assert PoolRepository(s).get("p").state == PoolState.STOPPED and PoolRepository(s).find("nobody") is None


def test_placed_adapters_count_every_tenants_live_adapters_per_pool(factory: sessionmaker[Session]) -> None:
    a, _ = _tenant(factory, "a")
    b, _ = _tenant(factory, "b")
    with unit_of_work(factory) as s:
        PoolRepository(s).heartbeat("p1", "tiny", 1, 8)  # a row to lock; p2 has none (never beat): counted all the same
        for tenant, model_id, pool in ((a, "a1", "p1"), (b, "b1", "p1"), (b, "b2", "p2"), (a, "gone", "p2"), (a, "old", None)):
            AdapterRepository(s, tenant).create(model_id, "tiny", 4, 8.0, ["q_proj"], seed=0, pool=pool)
        AdapterRepository(s, a).mark_deleted("gone")
    with unit_of_work(factory) as s:
        assert PoolRepository(s).placed_adapters(["p2", "p1", "p3"]) == {"p1": 2, "p2": 1, "p3": 0}
        assert AdapterRepository(s, b).live_pool("b2") == "p2" and AdapterRepository(s, a).live_pool("old") is None
        with pytest.raises(errors.NotFoundError):
            AdapterRepository(s, a).live_pool("gone")
        with pytest.raises(errors.NotFoundError):
            AdapterRepository(s, a).live_pool("b1")  # another tenant's


def test_datetimes_come_back_timezone_aware_utc(factory: sessionmaker[Session]) -> None:
    a, _ = _tenant(factory, "a")
    with factory() as s:
        created = s.get(Tenant, a).created_at  # type: ignore[union-attr]
        assert created.tzinfo is not None and created.utcoffset() == timedelta(0)
        assert abs(datetime.now(UTC) - created) < timedelta(minutes=1)


# --- unit of work ------------------------------------------------------------------------------------------------


def _count(factory: sessionmaker[Session], model: type) -> int:
    with factory() as s:
        return s.scalar(select(func.count()).select_from(model)) or 0


def test_error_rolls_back_everything(factory: sessionmaker[Session]) -> None:
    with pytest.raises(RuntimeError, match="boom"), unit_of_work(factory) as s:
        tenant, _ = TenantRepository(s).create_tenant("acme")
        AdapterRepository(s, tenant.id).create("m", "tiny", 8, 16.0, ["q_proj"], seed=0)
        raise RuntimeError("boom")
    assert (_count(factory, Tenant), _count(factory, ApiKey), _count(factory, Adapter)) == (0, 0, 0)


def test_failed_repository_call_rolls_back_earlier_writes(factory: sessionmaker[Session]) -> None:
    with unit_of_work(factory) as s:
        tenant_id = TenantRepository(s).create_tenant("acme")[0].id
    with pytest.raises(errors.ConflictError), unit_of_work(factory) as s:
        AdapterRepository(s, tenant_id).create("m1", "tiny", 8, 16.0, ["q_proj"], seed=0)
        TenantRepository(s).create_tenant("acme")
    with factory() as s:
        assert AdapterRepository(s, tenant_id).list(include_deleted=True) == []


def test_success_commits_and_rows_stay_readable(factory: sessionmaker[Session]) -> None:
    with unit_of_work(factory) as s:
        tenant, _ = TenantRepository(s).create_tenant("acme")
    assert tenant.name == "acme"  # not expired by the commit
    assert _count(factory, Tenant) == 1


# --- operator controls (migration 0012) -------------------------------------------------------------------------


def test_tenant_state_quotas_key_use_and_audit_round_trip(factory: sessionmaker[Session]) -> None:
    from loraplex.storage.enums import TenantState
    from loraplex.storage.repositories import AuditRepository

    tenant_id, key = _tenant(factory, "acme")
    now = datetime.now(UTC)
    with unit_of_work(factory) as s:
        repo = TenantRepository(s)
        repo.set_state(tenant_id, TenantState.SUSPENDED, "unpaid", now)
        repo.set_quotas(tenant_id, max_queued_requests=0, max_queued_tokens=2**40, max_adapters=None)
        AuditRepository(s).record("ops", "suspend", "tenant", tenant_id, "acme", "r" * 3000)
    with pytest.raises(errors.InvalidRequestError, match="max_adapters must be a whole number"), unit_of_work(factory) as s:
        TenantRepository(s).set_quotas(tenant_id, max_queued_requests=None, max_queued_tokens=None, max_adapters=-1)
    with factory() as s:
        tenant, api_key = TenantRepository(s).authenticate_key(key)
        assert (tenant.state, tenant.state_reason, tenant.state_changed_at) == (TenantState.SUSPENDED, "unpaid", now)
        assert (tenant.max_queued_requests, tenant.max_queued_tokens, tenant.max_adapters) == (0, 2**40, None)
        (entry,) = AuditRepository(s).recent(target_id=tenant_id)
        assert (entry.actor, entry.action, entry.target_name, len(entry.detail or "")) == ("ops", "suspend", "acme", 2000)
    # A key's use: written when none is recorded or the recorded one is older than the cutoff, by one UPDATE each.
    with unit_of_work(factory) as s:
        assert TenantRepository(s).touch_key(api_key.id, now, now - timedelta(minutes=1))
    with unit_of_work(factory) as s:
        assert not TenantRepository(s).touch_key(api_key.id, now + timedelta(seconds=30), now - timedelta(seconds=30))
    with unit_of_work(factory) as s:
        assert TenantRepository(s).touch_key(api_key.id, now + timedelta(minutes=2), now + timedelta(minutes=1))
    with factory() as s:
        assert s.get(ApiKey, api_key.id).last_used_at == now + timedelta(minutes=2)
