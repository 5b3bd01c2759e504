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
