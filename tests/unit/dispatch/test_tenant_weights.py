"""Tenant fair-share weights: the `tenants.weight` column (migration 0006, default 1, only positive finite values), read
by the dispatcher through dispatch/tenant_weights.TenantWeights (one fetch per TTL, the last known weights while the
database is away); and the executor's per-step timing that calibrates the cost model."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from loraplex import errors
from loraplex.dispatch.tenant_weights import TenantWeights
from loraplex.pool.records import sql_weights
from loraplex.storage.repositories import TenantRepository, unit_of_work


def test_weights_default_to_1_and_are_set_per_tenant(factory: sessionmaker[Session]) -> None:
    with unit_of_work(factory) as s:
        a, _ = TenantRepository(s).create_tenant("alice")
        b, _ = TenantRepository(s).create_tenant("bob")
        a_id, b_id = a.id, b.id
    with unit_of_work(factory) as s:
        TenantRepository(s).set_weight(b_id, 2.5)
        for bad in (0.0, -1.0, float("inf"), float("nan")):
            with pytest.raises(errors.InvalidRequestError):
                TenantRepository(s).set_weight(a_id, bad)
    assert sql_weights(factory)([a_id, b_id, "nobody"]) == {a_id: 1.0, b_id: 2.5}


def test_the_cache_reads_once_per_ttl_and_keeps_what_it_knows_when_the_database_is_away() -> None:
    now = [0.0]
    calls: list[set[str]] = []
    table = {"a": 2.0}
    down = [False]

    def fetch(tenants: Collection[str]) -> dict[str, float]:
        calls.append(set(tenants))
        if down[0]:
            raise ConnectionError("database away")
        return {t: table[t] for t in tenants if t in table}

    weights = TenantWeights(fetch, ttl_s=30, retry_s=5, clock=lambda: now[0])
    assert weights.of({"a", "b"}) == {"a": 2.0, "b": 1.0}
    assert weights.of({"a", "b"}) == {"a": 2.0, "b": 1.0} and len(calls) == 1  # cached
    table["a"] = 3.0
    now[0] = 31.0
    down[0] = True
    assert weights.of({"a"}) == {"a": 2.0}  # the database is away: the last known weight
    assert weights.of({"a"}) == {"a": 2.0} and len(calls) == 2  # not retried on every plan
    down[0] = False
    now[0] = 37.0
    assert weights.of({"a"}) == {"a": 3.0} and len(calls) == 3  # retried after retry_s: the new weight


def test_tenants_first_seen_at_different_times_are_read_together_once_per_ttl() -> None:
    """16 tenants join one second apart; every plan (each 0.5 s) asks for all tenants seen so far. Each new tenant
    costs one SELECT of the plan's tenants; after that the whole set costs one SELECT per ttl, not one per tenant as
    their entries expire one by one."""
    now = [0.0]
    calls: list[set[str]] = []

    def fetch(tenants: Collection[str]) -> dict[str, float]:
        calls.append(set(tenants))
        return {}

    weights = TenantWeights(fetch, ttl_s=30, clock=lambda: now[0])
    tenants = [f"t{i}" for i in range(16)]
    for k in range(240):  # 120 s of plans
        now[0] = 0.5 * k
        seen = tenants[: min(16, int(now[0]) + 1)]
        assert weights.of(seen) == dict.fromkeys(seen, 1.0)
    joining = [c for c in calls if len(c) < 16]
    assert len(joining) == 15  # the arrivals of t0..t14, each a read of the tenants seen so far
    steady = calls[len(joining) + 1 :]  # after the read that t15's arrival made of all 16
    assert all(c == set(tenants) for c in steady)
    assert len(steady) == 3  # at 45, 75 and 105 s: once per ttl, not once per tenant's own expiry


def test_the_cli_shows_and_sets_a_weight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    from loraplex.launch import cli
    from loraplex.settings import get_settings

    monkeypatch.setenv("LORAPLEX_HOME", str(tmp_path))
    get_settings.cache_clear()
    try:
        assert cli.main(["tenant", "create", "carol"]) == 0
        assert cli.main(["tenant", "weight", "carol"]) == 0
        assert capsys.readouterr().out.splitlines()[-1] == "carol weight 1"
        assert cli.main(["tenant", "weight", "carol", "3"]) == 0
        assert cli.main(["tenant", "weight", "carol"]) == 0
        assert capsys.readouterr().out.splitlines()[-1] == "carol weight 3"
        assert cli.main(["tenant", "weight", "carol", "0"]) != 0  # refused, with its message
    finally:
        get_settings.cache_clear()
