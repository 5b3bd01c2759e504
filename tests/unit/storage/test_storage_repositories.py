"""Repository behaviour on SQLite. The tests shared with PostgreSQL live in tests/helpers/storage_cases.py: imported here,
and by tests/integration/test_storage_postgres.py, which runs them on PostgreSQL."""

from __future__ import annotations

import pytest
from sqlalchemy.orm import Session, sessionmaker

from loraplex import errors
from loraplex.storage.repositories import TenantRepository

# The tests shared with PostgreSQL (tests/integration/test_storage_postgres.py), run here on SQLite.
from tests.helpers.storage_cases import (  # noqa: F401 - collected here, on this module's `factory`
    _adapter,
    _tenant,
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
    test_tenant_state_quotas_key_use_and_audit_round_trip,
    test_unique_clash_becomes_conflict_and_keeps_the_transaction,
    test_usage_totals_are_per_tenant,
    test_wrong_key_is_rejected,
)


def test_owner_of_adapter_is_found_for_operator_tools(factory: sessionmaker[Session]) -> None:
    alice, _ = _tenant(factory, "alice")
    bob, _ = _tenant(factory, "bob")
    _adapter(factory, bob, "m-bob")
    with factory() as s:
        assert TenantRepository(s).owner_of_adapter("m-bob").id == bob != alice
        with pytest.raises(errors.NotFoundError):
            TenantRepository(s).owner_of_adapter("m-nobody")
