"""The training calls' adapter check (service/training.check_live: one statement on a plain connection, read afresh
on every call) on every training route, native and Tinker, on real Redis and SQLite (and PostgreSQL: the connection
is SQLite's without a BEGIN, PostgreSQL's as its driver opens it) without a pool: an adapter deleted, moved or
another tenant's is refused or redirected from the very next request, and the check costs one SELECT and nothing
else."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

from loraplex import service
from loraplex.service import TenantRef
from loraplex.service.context import write_session
from loraplex.service.schemas import CreateAdapterRequest
from loraplex.service.training import check_live
from loraplex.settings import Settings
from loraplex.storage.repositories import AdapterRepository, PoolRepository
from loraplex.storage.statement_count import STATEMENTS
from tests.helpers.queued import queued
from tests.helpers.services.postgres import PostgresServer, postgres_server
from tests.helpers.tinker_wire import forward_backward_body, text_datum
from tests.integration.conftest import Gateway, gateway_app

PROTOBUF = {"Content-Type": "application/x-protobuf"}
DATUM = {"model_input": [1, 2, 3], "loss_fn_inputs": {"target_tokens": [2, 3, 4]}}


def _h(gw, who: str = "alice") -> dict[str, str]:
    return {"X-API-Key": gw.keys[who]}


def _steps(gw, model_id: str, first_seq: int, who: str = "alice") -> dict[str, Any]:
    """One request of each training route (native forward_backward, forward, optim_step; Tinker forward_backward,
    optim_step), seq_ids from `first_seq` on: route -> response."""
    post, h = gw.client.post, _h(gw, who)
    native = f"/v1/adapters/{model_id}"
    fb = {"data": [DATUM], "loss_fn": "cross_entropy"}
    s = first_seq
    return {
        "forward_backward": post(f"{native}/forward_backward", json={**fb, "seq_id": s}, headers=h),
        "forward": post(f"{native}/forward", json={**fb, "seq_id": s + 1}, headers=h),
        "optim_step": post(f"{native}/optim_step", json={"seq_id": s + 2}, headers=h),
        "tinker forward_backward": post(
            "/api/v1/forward_backward",
            content=forward_backward_body(model_id, s + 3, [text_datum([1, 2, 3, 4])]),
            headers=h | PROTOBUF,
        ),
        "tinker optim_step": post(
            "/api/v1/optim_step",
            json={"model_id": model_id, "seq_id": s + 4, "adam_params": {"learning_rate": 1e-4}, "type": "optim_step"},
            headers=h,
        ),
    }


def _accepted(answers: dict[str, Any]) -> dict[str, Any]:
    """Every step queued: 202 on the native routes, 200 (an UntypedAPIFuture) on the Tinker ones."""
    codes = {r: a.status_code for r, a in answers.items()}
    assert codes == {r: 200 if r.startswith("tinker") else 202 for r in answers}, {
        r: a.text for r, a in answers.items()
    }
    return answers


def _request_id(route: str, body: dict[str, Any]) -> str:
    """The queued request's id: the Tinker future id is `<tag>.<request_id>`."""
    return body["request_id"].split(".")[1] if route.startswith("tinker") else body["request_id"]


_databases = itertools.count()


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    with postgres_server() as server:
        yield server


@pytest.fixture(params=["sqlite", "postgresql"])
def gateway(request, tmp_path, redis_url) -> Iterator[Gateway]:
    """The gateway on a fresh database of each kind (this module's own, replacing conftest's SQLite-only one)."""
    database_url = ""
    if request.param == "postgresql":
        database_url = request.getfixturevalue("postgres").create_database(f"check{next(_databases)}")
    settings = Settings(home=tmp_path, redis_url=redis_url, database_url=database_url, pool=f"tc-{tmp_path.name}")
    with gateway_app(settings) as gw:
        yield gw


@pytest.fixture()
def adapter(gateway) -> str:
    alice = TenantRef(gateway.tenant_ids["alice"], "alice")
    return service.create_adapter(gateway.services, alice, CreateAdapterRequest(rank=4)).model_id


def test_a_deleted_adapter_is_refused_by_every_training_route_right_after_its_deletion(gateway, adapter) -> None:
    _accepted(_steps(gateway, adapter, first_seq=1))
    queued_before = set(queued(gateway.services))
    assert gateway.client.delete(f"/v1/adapters/{adapter}", headers=_h(gateway)).status_code == 202

    refused = _steps(gateway, adapter, first_seq=6)
    assert {r: a.status_code for r, a in refused.items()} == dict.fromkeys(refused, 404), {
        r: a.text for r, a in refused.items()
    }
    assert all(adapter in a.json()["detail"] for a in refused.values())
    delete_only = set(queued(gateway.services)) - queued_before
    assert [str(queued(gateway.services)[r].kind) for r in delete_only] == ["delete_adapter"]  # nothing else queued


def test_another_tenants_adapter_is_404_on_every_training_route(gateway, adapter) -> None:
    refused = _steps(gateway, adapter, first_seq=1, who="bob")
    assert {r: a.status_code for r, a in refused.items()} == dict.fromkeys(refused, 404), {
        r: a.text for r, a in refused.items()
    }
    assert queued(gateway.services) == {
        r: e for r, e in queued(gateway.services).items() if str(e.kind) == "create_adapter"
    }  # bob queued nothing on alice's adapter, not even a rejection in its seq_ids


def test_a_moved_adapters_next_steps_go_to_its_new_pool(gateway, adapter) -> None:
    services = gateway.services
    here = _accepted(_steps(gateway, adapter, first_seq=1))
    assert all(_request_id(r, a.json()) in queued(services) for r, a in here.items())  # the gateway's own pool

    target = f"moved-{services.settings.pool}"
    with write_session(services) as db:
        assert PoolRepository(db).route_adapter(adapter, services.settings.pool, target)
    moved = _accepted(_steps(gateway, adapter, first_seq=6))
    on_target, left_behind = queued(services, target), queued(services)
    for route, answer in moved.items():
        request_id = _request_id(route, answer.json())
        assert request_id in on_target and request_id not in left_behind, route


def test_a_refused_step_on_a_moved_adapter_holds_its_seq_id_on_the_new_pool(gateway, adapter) -> None:
    """The rejection that fills a refused step's seq_id (service/rejections.py) goes where the adapter's chain is."""
    services = gateway.services
    target = f"moved-{services.settings.pool}"
    with write_session(services) as db:
        assert PoolRepository(db).route_adapter(adapter, services.settings.pool, target)
    bad = {"seq_id": 1, "data": [{"model_input": [1, 2], "loss_fn_inputs": {"target_tokens": [2]}}]}
    response = gateway.client.post(f"/v1/adapters/{adapter}/forward_backward", json=bad, headers=_h(gateway))
    assert response.status_code == 422, response.text
    filled = [e for e in queued(services, target).values() if str(e.kind) == "rejected"]
    assert [(e.model_id, e.seq_id) for e in filled] == [(adapter, 1)]


@pytest.mark.parametrize("gateway", ["sqlite"], indirect=True)
def test_the_adapter_check_sends_one_select_and_nothing_else(gateway, adapter) -> None:
    """No ORM session and no BEGIN: a plain connection, one statement (storage/db.single_read). Its close counts as
    a rollback (the driver's call, which SQLite skips outside a transaction)."""
    alice = TenantRef(gateway.tenant_ids["alice"], "alice")
    check_live(gateway.services, alice, adapter)  # the connection pool warmed (its PRAGMAs are no request's cost)
    before = STATEMENTS.snapshot()
    for _ in range(3):
        check_live(gateway.services, alice, adapter)
    after = STATEMENTS.snapshot()
    assert {verb: n - before.get(verb, 0) for verb, n in after.items() if n != before.get(verb, 0)} == {
        "select": 3,
        "rollback": 3,
    }


@pytest.mark.parametrize("gateway", ["sqlite"], indirect=True)
def test_the_native_training_routes_still_document_their_202_future(gateway) -> None:
    paths = gateway.client.get("/openapi.json").json()["paths"]
    for step in ("forward_backward", "forward", "optim_step"):
        answer = paths[f"/v1/adapters/{{model_id}}/{step}"]["post"]["responses"]["202"]
        assert answer["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/FutureRef"}, step


def test_the_checks_connection_goes_back_to_the_pool_as_it_came(gateway, adapter) -> None:
    """The check reads outside a transaction (PostgreSQL: the driver's autocommit); the pool must hand the connection
    to the next session transactional again, or a failed unit of work would leave its writes behind."""
    services = gateway.services
    alice = TenantRef(gateway.tenant_ids["alice"], "alice")
    for _ in range(3):
        assert check_live(services, alice, adapter) in (None, services.settings.pool)
    with pytest.raises(RuntimeError, match="undo"), write_session(services) as db:
        AdapterRepository(db, alice.id).mark_deleted(adapter)
        db.flush()
        raise RuntimeError("undo")
    assert check_live(services, alice, adapter) in (None, services.settings.pool)  # still live: rolled back
