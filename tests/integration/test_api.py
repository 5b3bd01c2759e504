"""The gateway against real Redis and SQLite (no worker pool): auth, validation, tenant isolation, idempotent submit,
and that a rejected request leaves nothing behind."""

from __future__ import annotations

import pytest


@pytest.fixture()
def stack(gateway):
    return gateway.client, gateway.keys, gateway.services


def _create(client, key, **body):
    return client.post("/v1/adapters", json=body, headers={"X-API-Key": key})


def test_missing_or_wrong_key_is_401(stack):
    client, keys, _ = stack
    assert client.get("/v1/adapters").status_code == 401
    assert client.get("/v1/adapters", headers={"X-API-Key": "tml-nope"}).status_code == 401
    assert client.get("/v1/adapters", headers={"Authorization": f"Bearer {keys['alice']}"}).status_code == 200


def test_other_tenants_adapter_is_404_and_invisible(stack):
    client, keys, _ = stack
    created = _create(client, keys["alice"], rank=4)
    assert created.status_code == 202, created.text
    model_id = created.json()["model_id"]
    bob = {"X-API-Key": keys["bob"]}
    assert client.get(f"/v1/adapters/{model_id}", headers=bob).status_code == 404
    assert client.get("/v1/adapters", headers=bob).json() == []
    body = {"seq_id": 1, "data": [{"model_input": [1, 2], "loss_fn_inputs": {"target_tokens": [2, 3]}}]}
    assert client.post(f"/v1/adapters/{model_id}/forward_backward", json=body, headers=bob).status_code == 404
    assert client.delete(f"/v1/adapters/{model_id}", headers=bob).status_code == 404
    # Bob cannot read Alice's future either.
    request_id = created.json()["request_id"]
    assert client.get(f"/v1/futures/{request_id}?timeout=0", headers=bob).status_code == 404
    assert client.get(f"/v1/futures/{request_id}?timeout=0", headers={"X-API-Key": keys["alice"]}).status_code == 200


def test_malformed_bodies_are_422_naming_the_field(stack):
    client, keys, _ = stack
    alice = {"X-API-Key": keys["alice"]}
    model_id = _create(client, keys["alice"], rank=4).json()["model_id"]
    bad = client.post(f"/v1/adapters/{model_id}/forward_backward", json={"data": []}, headers=alice)
    assert bad.status_code == 422
    fields = {tuple(e["loc"]) for e in bad.json()["detail"]}
    assert ("body", "seq_id") in fields and ("body", "data") in fields
    mismatch = {"seq_id": 1, "data": [{"model_input": [1, 2, 3], "loss_fn_inputs": {"target_tokens": [1]}}]}
    bad = client.post(f"/v1/adapters/{model_id}/forward_backward", json=mismatch, headers=alice)
    assert bad.status_code == 422 and "target_tokens" in bad.text
    bad = client.post(
        f"/v1/adapters/{model_id}/optim_step", json={"seq_id": 2, "adam_params": {"lr": 1}}, headers=alice
    )
    assert bad.status_code == 422 and "lr" in bad.text
    assert _create(client, keys["alice"], rank="big").status_code == 422


def test_rejected_create_writes_nothing(stack):
    client, keys, _ = stack
    alice = {"X-API-Key": keys["alice"]}
    before = client.get("/v1/adapters", headers=alice).json()
    too_big = _create(client, keys["alice"], rank=64)
    assert too_big.status_code == 400 and "maximum rank 16" in too_big.json()["detail"]
    wrong_model = _create(client, keys["alice"], base_model="gpt-5")
    assert wrong_model.status_code == 400
    assert client.get("/v1/adapters", headers=alice).json() == before


def test_resubmitted_seq_id_returns_the_first_request(stack):
    client, keys, _ = stack
    alice = {"X-API-Key": keys["alice"]}
    model_id = _create(client, keys["alice"], rank=4).json()["model_id"]
    body = {"seq_id": 1, "data": [{"model_input": [1, 2], "loss_fn_inputs": {"target_tokens": [2, 3]}}]}
    first = client.post(f"/v1/adapters/{model_id}/forward_backward", json=body, headers=alice).json()
    again = client.post(f"/v1/adapters/{model_id}/forward_backward", json=body, headers=alice).json()
    assert first["request_id"] == again["request_id"]


def test_deleted_adapter_is_gone(stack):
    client, keys, _ = stack
    alice = {"X-API-Key": keys["alice"]}
    model_id = _create(client, keys["alice"], rank=4).json()["model_id"]
    assert client.delete(f"/v1/adapters/{model_id}", headers=alice).status_code == 202
    assert client.get(f"/v1/adapters/{model_id}", headers=alice).status_code == 404


def test_a_revoked_key_stops_working_within_the_auth_cache_ttl(tmp_path, redis_url):
    """The gateway trusts a checked key for `auth_cache_seconds` (here 3 s: long enough that a loaded CI machine still
    makes the second request inside it; 0.3 s failed there once), then asks SQL again."""
    import time

    from fastapi.testclient import TestClient

    from loraplex.api.app import create_app
    from loraplex.settings import Settings
    from loraplex.storage.db import migrate
    from loraplex.storage.repositories import TenantRepository, unit_of_work

    settings = Settings(home=tmp_path, redis_url=redis_url, pool=f"auth-{tmp_path.name}", auth_cache_seconds=3.0)
    migrate(settings.resolved_database_url)
    app = create_app(settings)
    with TestClient(app) as client:
        sessions = app.state.services.sessions
        with unit_of_work(sessions) as session:
            tenant, key = TenantRepository(session).create_tenant("carol")
        headers = {"X-API-Key": key}
        assert client.get("/v1/adapters", headers=headers).status_code == 200
        checked = time.monotonic()  # the key was cached before this answer came
        with unit_of_work(sessions) as session:
            repo = TenantRepository(session)
            repo.revoke_key(tenant.id, repo.list_keys(tenant.id)[0].id)
        assert client.get("/v1/adapters", headers=headers).status_code == 200  # still trusted from the first check
        time.sleep(max(0.0, checked + 3.1 - time.monotonic()))
        denied = client.get("/v1/adapters", headers=headers)
        assert denied.status_code == 401 and "revoked" in denied.json()["detail"]


def test_a_reused_seq_id_with_another_body_is_409_and_the_same_body_gets_the_first_id(stack):
    client, keys, _ = stack
    alice = {"X-API-Key": keys["alice"]}
    model_id = _create(client, keys["alice"], rank=4).json()["model_id"]
    body = {"seq_id": 1, "data": [{"model_input": [1, 2], "loss_fn_inputs": {"target_tokens": [2, 3]}}]}
    first = client.post(f"/v1/adapters/{model_id}/forward_backward", json=body, headers=alice)
    assert first.status_code == 202
    changed = {**body, "loss_fn": "importance_sampling"}
    conflict = client.post(f"/v1/adapters/{model_id}/forward_backward", json=changed, headers=alice)
    assert conflict.status_code == 409 and "already used by a forward_backward request" in conflict.json()["detail"]
    optim = client.post(f"/v1/adapters/{model_id}/optim_step", json={"seq_id": 1, "adam_params": {}}, headers=alice)
    assert optim.status_code == 409 and "optim_step" in optim.json()["detail"]
    again = client.post(f"/v1/adapters/{model_id}/forward_backward", json=body, headers=alice)
    assert again.status_code == 202 and again.json()["request_id"] == first.json()["request_id"]


def test_a_result_landing_as_the_long_poll_ends_is_answered_whole(stack, monkeypatch):
    """Before: the route read the result (missing), then the state (COMPLETE: the result had landed in between) and
    answered "complete" with a null result. The landing is placed exactly there by wrapping `wait` (a timing fault
    that cannot be caused reliably otherwise); the answer must carry the result."""
    from loraplex.protocol import Outcome
    from loraplex.protocol.results import OptimStepResult

    client, keys, services = stack
    alice = {"X-API-Key": keys["alice"]}
    model_id = _create(client, keys["alice"], rank=4).json()["model_id"]
    body = {"seq_id": 1, "data": [{"model_input": [1, 2], "loss_fn_inputs": {"target_tokens": [2, 3]}}]}
    request_id = client.post(f"/v1/adapters/{model_id}/forward_backward", json=body, headers=alice).json()["request_id"]
    real_wait = services.results.wait_with_others

    def wait_then_land(rid: str, timeout_s: float, *args, **kw):
        missed = real_wait(rid, 0.01, *args, **kw)  # nothing yet
        services.results.put(Outcome(rid, result=OptimStepResult({"loss": 1.5})))  # lands right after the wait gave up
        return missed

    monkeypatch.setattr(services.results, "wait_with_others", wait_then_land)
    answer = client.get(f"/v1/futures/{request_id}?timeout=1", headers=alice).json()
    assert answer["state"] == "complete" and answer["result"] == {"metrics": {"loss": 1.5}}


def test_a_future_poll_answers_the_finished_among_its_also_ids_of_the_same_tenant(stack):
    """`also`: the poll brings back those of the other ids that are finished and the caller's; a pending one, another
    tenant's or an unknown id is left out, never an error; too many ids is a 400."""
    from loraplex.errors import EngineError
    from loraplex.protocol import Outcome
    from loraplex.protocol.results import OptimStepResult

    client, keys, services = stack
    alice, bob = {"X-API-Key": keys["alice"]}, {"X-API-Key": keys["bob"]}
    mine = [_create(client, keys["alice"], rank=4).json()["request_id"] for _ in range(4)]
    theirs = _create(client, keys["bob"], rank=4).json()["request_id"]
    asked, done, failed, pending = mine
    services.results.put(Outcome(done, result=OptimStepResult({"loss": 1.0})))
    services.results.put(Outcome.failed(failed, EngineError("nan")))
    services.results.put(Outcome(theirs, result=OptimStepResult({"loss": 2.0})))
    also = ",".join([done, failed, pending, theirs, "no-such-request", asked])
    answer = client.get(f"/v1/futures/{asked}", params={"timeout": 0, "also": also}, headers=alice).json()
    assert answer["state"] == "queued"
    by_id = {f["request_id"]: f for f in answer["also"]}
    assert set(by_id) == {done, failed}
    assert by_id[done]["state"] == "complete" and by_id[done]["result"] == {"metrics": {"loss": 1.0}}
    assert by_id[failed]["state"] == "failed" and by_id[failed]["error"]["type"] == "EngineError"
    services.results.put(Outcome(asked, result=OptimStepResult({"loss": 3.0})))
    answer = client.get(f"/v1/futures/{asked}", params={"timeout": 5, "also": done}, headers=alice).json()
    assert answer["result"] == {"metrics": {"loss": 3.0}} and [f["request_id"] for f in answer["also"]] == [done]
    assert client.get(f"/v1/futures/{asked}", params={"also": theirs}, headers=bob).status_code == 404
    too_many = client.get(f"/v1/futures/{asked}", params={"timeout": 0, "also": ",".join(["x"] * 33)}, headers=alice)
    assert too_many.status_code == 400 and "at most 32" in too_many.text


def test_an_adapter_may_train_a_subset_of_the_pools_target_modules(stack):
    client, keys, _ = stack
    h = {"X-API-Key": keys["alice"]}
    created = _create(client, keys["alice"], rank=4, target_modules=["v_proj", "q_proj"])
    assert created.status_code == 202, created.text
    adapter = client.get(f"/v1/adapters/{created.json()['model_id']}", headers=h).json()
    assert adapter["target_modules"] == ["q_proj", "v_proj"]  # in the pool's order
    unknown = _create(client, keys["alice"], rank=4, target_modules=["q_proj", "lm_head"])
    assert unknown.status_code == 400 and "lm_head" in unknown.json()["detail"]
    assert _create(client, keys["alice"], rank=4, target_modules=[]).status_code == 422
    with_checkpoint = _create(client, keys["alice"], from_checkpoint="tinker://m/weights/x", target_modules=["q_proj"])
    assert with_checkpoint.status_code == 400 and "taken from the checkpoint" in with_checkpoint.json()["detail"]
