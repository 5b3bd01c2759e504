"""The repository and unit-of-work tests of tests/unit, run again on a real PostgreSQL, plus races that only a
server with real concurrent transactions can show."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from loraplex import errors
from loraplex.storage.db import make_db_engine, migrate, session_factory, unit_of_work
from loraplex.storage.models import Base
from loraplex.storage.repositories import AdapterRepository, PoolRepository, TenantRepository
from tests.helpers.services.postgres import postgres_server

# The SQLite tests' shared bodies, re-collected here: pytest binds them to this module's `factory` fixture (PostgreSQL).
from tests.helpers.storage_cases import (  # noqa: F401 - collected here, on this module's `factory`
    test_a_plans_applied_seq_ids_and_usage_go_in_one_statement_each_and_never_backwards,
    test_adapter_fields_round_trip,
    test_adapters_are_scoped_to_their_tenant,
    test_applied_seq_id_only_increases,
    test_bad_adapter_config_is_rejected,
    test_bad_tenant_names_are_rejected,
    test_checkpoints,
    test_created_key_authenticates_its_tenant,
    test_datetimes_come_back_timezone_aware_utc,
    test_deleted_adapter_is_gone_but_its_id_stays_taken,
    test_deleted_adapters_are_reachable_only_when_asked,
    test_duplicate_tenant_name_conflicts,
    test_error_rolls_back_everything,
    test_failed_repository_call_rolls_back_earlier_writes,
    test_missing_or_malformed_keys_are_rejected,
    test_only_the_key_hash_is_stored,
    test_pages_latest_of_and_bulk_delete_across_adapters,
    test_placed_adapters_count_every_tenants_live_adapters_per_pool,
    test_pool_heartbeat_upserts,
    test_pool_leadership_goes_to_larger_tokens_and_fences_the_old_one,
    test_pool_state_is_recorded,
    test_revoked_key_is_rejected_and_other_keys_still_work,
    test_session_lifecycle,
    test_status_changes,
    test_success_commits_and_rows_stay_readable,
    test_tenant_state_quotas_key_use_and_audit_round_trip,
    test_unique_clash_becomes_conflict_and_keeps_the_transaction,
    test_usage_totals_are_per_tenant,
    test_wrong_key_is_rejected,
)


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with postgres_server() as server:
        url = server.create_database("repositories")
        migrate(url)
        engine = make_db_engine(url)
        yield engine
        engine.dispose()


@pytest.fixture
def factory(engine: Engine) -> sessionmaker[Session]:
    """A migrated database, emptied before each test."""
    tables = ", ".join(t.name for t in reversed(Base.metadata.sorted_tables))
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    return session_factory(engine)


def _in_threads(n: int, target: object) -> list[BaseException | None]:
    barrier = threading.Barrier(n)
    outcomes: list[BaseException | None] = [None] * n

    def run(i: int) -> None:
        barrier.wait()
        try:
            target(i)  # type: ignore[operator]
        except BaseException as exc:  # noqa: BLE001 - collected and asserted on below
            outcomes[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return outcomes


def test_concurrent_tenant_creation_yields_one_winner(factory: sessionmaker[Session]) -> None:
    def create(_: int) -> None:
        with unit_of_work(factory) as s:
            TenantRepository(s).create_tenant("racer")

    outcomes = _in_threads(6, create)
    assert outcomes.count(None) == 1
    assert all(isinstance(o, errors.ConflictError) for o in outcomes if o is not None)


def test_concurrent_record_applied_keeps_the_maximum(factory: sessionmaker[Session]) -> None:
    with unit_of_work(factory) as s:
        tenant_id = TenantRepository(s).create_tenant("acme")[0].id
        AdapterRepository(s, tenant_id).create("m", "tiny", 8, 16.0, ["q_proj"], seed=0)

    def record(i: int) -> None:
        for seq in range(i, 200, 8):
            with unit_of_work(factory) as s:
                AdapterRepository(s, tenant_id).record_applied("m", seq)

    assert _in_threads(8, record) == [None] * 8
    with factory() as s:
        assert AdapterRepository(s, tenant_id).get("m").applied_seq_id == 199


def test_a_takeover_waits_for_the_old_leaders_record_transaction_then_fences_it(factory: sessionmaker[Session]) -> None:
    """check_leader locks the pools row (FOR UPDATE): a new leader's take_leadership blocks until the old leader's
    record transaction commits; after it, the old token is refused."""
    with unit_of_work(factory) as s:
        PoolRepository(s).take_leadership("race", 1, "tiny", 1, 8)
    checked, took = threading.Event(), threading.Event()

    def take_over() -> None:
        checked.wait(10)
        with unit_of_work(factory) as s:
            assert PoolRepository(s).take_leadership("race", 2, "tiny", 1, 8)
        took.set()

    thread = threading.Thread(target=take_over)
    thread.start()
    with unit_of_work(factory) as s:  # the old leader's plan transaction
        PoolRepository(s).check_leader("race", 1)
        checked.set()
        assert not took.wait(0.5)  # blocked on the row lock while this transaction is open
    thread.join(timeout=10)
    assert took.is_set()
    with factory() as s, pytest.raises(errors.LeaseLostError):
        PoolRepository(s).check_leader("race", 1)
