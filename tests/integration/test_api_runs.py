"""Training runs and the tenant's checkpoints across them, through the gateway on real Redis and SQLite (no worker
pool: checkpoint rows are made as the recorder makes them): paging (limit, offset, total_count, newest first), deleted
runs still listed, bulk delete all or nothing, time to live and the retention job, weights_info, another tenant's
run or checkpoint a 404 like a missing one, no key a 401, bad input a 4xx with a message."""

from __future__ import annotations

from datetime import timedelta

import pytest

from loraplex import service
from loraplex.errors import InvalidRequestError, NotFoundError
from loraplex.service import TenantRef
from loraplex.storage.blobs import BlobStore
from loraplex.storage.enums import CheckpointKind
from loraplex.storage.repositories import AdapterRepository, unit_of_work
from loraplex.storage.retention import delete_expired
from loraplex.storage.types import utcnow
from tests.helpers.checkpoint_rows import checkpoint_folder, saved_checkpoint

STATE, SAMPLER = CheckpointKind.STATE, CheckpointKind.SAMPLER


@pytest.fixture()
def stack(gateway):
    headers = {name: {"X-API-Key": key} for name, key in gateway.keys.items()}
    return gateway.client, headers, gateway.tenant_ids, gateway.services


def _adapter(client, headers, **body) -> str:
    response = client.post("/v1/adapters", json={"rank": 4, **body}, headers=headers)
    assert response.status_code == 202, response.text
    return response.json()["model_id"]


def _ok(response):
    assert response.status_code == 200, response.text
    return response.json()


def _names(page: dict) -> list[str]:
    return [c["name"] for c in page["checkpoints"]]


def test_runs_are_paged_newest_first_and_a_deleted_run_stays_listed(stack):
    client, headers, tenants, services = stack
    alice = headers["alice"]
    runs = [_adapter(client, alice, user_metadata={"renderer_name": f"r{i}"}) for i in range(3)]
    _adapter(client, headers["bob"])
    newest_first = runs[::-1]

    page = _ok(client.get("/v1/runs", params={"limit": 2}, headers=alice))
    assert [r["training_run_id"] for r in page["training_runs"]] == newest_first[:2]
    assert page["cursor"] == {"offset": 0, "limit": 2, "total_count": 3}
    rest = _ok(client.get("/v1/runs", params={"limit": 2, "offset": 2}, headers=alice))
    assert [r["training_run_id"] for r in rest["training_runs"]] == newest_first[2:]
    assert rest["cursor"] == {"offset": 2, "limit": 2, "total_count": 3}
    past = _ok(client.get("/v1/runs", params={"offset": 10}, headers=alice))
    assert past["training_runs"] == [] and past["cursor"] == {"offset": 10, "limit": 20, "total_count": 3}

    # Tinker's TrainingRun fields, then ours.
    first = runs[0]
    state = saved_checkpoint(services, tenants["alice"], first, STATE, "s1", step=1)
    newer_state = saved_checkpoint(services, tenants["alice"], first, STATE, "s2", step=2)
    sampler = saved_checkpoint(services, tenants["alice"], first, SAMPLER, "w1", step=2)
    run = _ok(client.get(f"/v1/runs/{first}", headers=alice))
    assert run["training_run_id"] == first and run["model_owner"] == "alice"
    assert run["base_model"] == services.settings.base_model and run["lora_rank"] == 4
    assert run["is_lora"] is True and run["corrupted"] is False
    assert run["user_metadata"] == {"renderer_name": "r0"}
    assert run["last_checkpoint"]["tinker_path"] == newer_state != state
    assert run["last_sampler_checkpoint"]["tinker_path"] == sampler
    assert run["last_request_time"] is not None and run["status"] == "creating" and run["applied_seq_id"] == 0
    assert run["session_id"] is None
    listed = {r["training_run_id"]: r for r in _ok(client.get("/v1/runs", headers=alice))["training_runs"]}
    assert listed[first] == run and listed[runs[1]]["last_checkpoint"] is None

    # Deleted: still readable and listed, its status says so (through the routes and the service alike).
    assert client.delete(f"/v1/adapters/{first}", headers=alice).status_code == 202
    assert _ok(client.get(f"/v1/runs/{first}", headers=alice))["status"] == "deleted"
    page = _ok(client.get("/v1/runs", params={"limit": 1000}, headers=alice))
    assert page["cursor"]["total_count"] == 3 and page["training_runs"][-1]["status"] == "deleted"
    direct = service.get_run(services, TenantRef(tenants["alice"], "alice"), first)
    assert direct.status == "deleted" and direct.last_checkpoint is not None
    assert direct.last_checkpoint.tinker_path == newer_state


def test_checkpoints_across_runs_are_paged_newest_first(stack):
    client, headers, tenants, services = stack
    alice = headers["alice"]
    one, two = _adapter(client, alice), _adapter(client, alice)
    saved = [
        saved_checkpoint(services, tenants["alice"], one, STATE, "a"),
        saved_checkpoint(services, tenants["alice"], two, SAMPLER, "b"),
        saved_checkpoint(services, tenants["alice"], one, SAMPLER, "c"),
        saved_checkpoint(services, tenants["alice"], two, STATE, "d"),
    ]
    bobs = _adapter(client, headers["bob"])
    saved_checkpoint(services, tenants["bob"], bobs, STATE, "bobs")
    assert client.delete(f"/v1/adapters/{one}", headers=alice).status_code == 202  # its checkpoints stay listed

    page = _ok(client.get("/v1/checkpoints", params={"limit": 3}, headers=alice))
    assert [c["tinker_path"] for c in page["checkpoints"]] == saved[::-1][:3]
    assert page["cursor"] == {"offset": 0, "limit": 3, "total_count": 4}
    rest = _ok(client.get("/v1/checkpoints", params={"limit": 3, "offset": 3}, headers=alice))
    assert [c["tinker_path"] for c in rest["checkpoints"]] == saved[:1]
    everything = _ok(client.get("/v1/checkpoints", headers=alice))
    assert _names(everything) == ["d", "c", "b", "a"] and everything["cursor"]["limit"] == 20
    first = everything["checkpoints"][0]
    assert first["checkpoint_id"] == "weights/d" and first["checkpoint_type"] == "training" and first["model_id"] == two
    assert _names(_ok(client.get("/v1/checkpoints", headers=headers["bob"]))) == ["bobs"]
    # The same checkpoint through the service, by its tinker path.
    got = service.get_checkpoint(services, TenantRef(tenants["alice"], "alice"), saved[0])
    assert got.model_dump(mode="json") == everything["checkpoints"][-1]
    with pytest.raises(NotFoundError):
        service.get_checkpoint(services, TenantRef(tenants["bob"], "bob"), saved[0])
    with pytest.raises(InvalidRequestError):
        service.get_checkpoint(services, TenantRef(tenants["alice"], "alice"), "weights/a")


def test_bulk_delete_is_all_or_nothing(stack):
    client, headers, tenants, services = stack
    alice, bob = headers["alice"], headers["bob"]
    mine, theirs = _adapter(client, alice), _adapter(client, bob)
    paths = [saved_checkpoint(services, tenants["alice"], mine, STATE, n) for n in ("a", "b", "c")]
    foreign = saved_checkpoint(services, tenants["bob"], theirs, STATE, "x")
    missing = f"tinker://{mine}/weights/nope"
    folders = {n: checkpoint_folder(services, tenants["alice"], mine, STATE, n) for n in ("a", "b", "c")}

    for bad in (foreign, missing):
        response = client.post("/v1/checkpoints/delete", json={"paths": [paths[0], bad, paths[1]]}, headers=alice)
        assert response.status_code == 404, response.text
        assert bad in response.json()["detail"]
    # Nothing went: rows and files intact (bob's too).
    assert _names(_ok(client.get("/v1/checkpoints", headers=alice))) == ["c", "b", "a"]
    assert all(f.is_dir() for f in folders.values())
    assert _names(_ok(client.get("/v1/checkpoints", headers=bob))) == ["x"]
    assert checkpoint_folder(services, tenants["bob"], theirs, STATE, "x").is_dir()

    deleted = _ok(client.post("/v1/checkpoints/delete", json={"paths": [paths[1], paths[0], paths[1]]}, headers=alice))
    assert [c["tinker_path"] for c in deleted["checkpoints"]] == [paths[1], paths[0]]  # a repeated path counts once
    assert _names(_ok(client.get("/v1/checkpoints", headers=alice))) == ["c"]
    assert not folders["a"].exists() and not folders["b"].exists() and folders["c"].is_dir()
    again = client.post("/v1/checkpoints/delete", json={"paths": [paths[0]]}, headers=alice)
    assert again.status_code == 404 and paths[0] in again.json()["detail"]
    assert _ok(client.post("/v1/checkpoints/delete", json={"paths": []}, headers=alice))["checkpoints"] == []
    # The service directly (the Tinker routes' call): the same rule.
    with pytest.raises(NotFoundError, match="nope"):
        service.delete_checkpoints(services, TenantRef(tenants["alice"], "alice"), [paths[2], missing])
    assert folders["c"].is_dir()


def test_ttl_set_and_clear_and_the_retention_job_honours_it(stack):
    client, headers, tenants, services = stack
    alice = headers["alice"]
    model_id = _adapter(client, alice)
    expiring = saved_checkpoint(services, tenants["alice"], model_id, STATE, "expiring")
    cleared = saved_checkpoint(services, tenants["alice"], model_id, SAMPLER, "cleared")
    kept = saved_checkpoint(services, tenants["alice"], model_id, STATE, "kept")

    before = utcnow()
    out = _ok(client.put("/v1/checkpoints/ttl", json={"path": expiring, "ttl_seconds": 60}, headers=alice))
    assert out["tinker_path"] == expiring and out["expires_at"] is not None
    _ok(client.put("/v1/checkpoints/ttl", json={"path": cleared, "ttl_seconds": 30}, headers=alice))
    out = _ok(client.put("/v1/checkpoints/ttl", json={"path": cleared, "ttl_seconds": None}, headers=alice))
    assert out["expires_at"] is None
    listed = {c["name"]: c for c in _ok(client.get("/v1/checkpoints", headers=alice))["checkpoints"]}
    assert listed["expiring"]["expires_at"] is not None and listed["cleared"]["expires_at"] is None
    assert listed["kept"]["expires_at"] is None

    blobs = BlobStore(services.settings.resolved_blob_root)
    assert delete_expired(services.sessions, blobs, now=before + timedelta(seconds=59)) == 0
    assert delete_expired(services.sessions, blobs, now=before + timedelta(seconds=3600)) == 1
    assert sorted(_names(_ok(client.get("/v1/checkpoints", headers=alice)))) == ["cleared", "kept"]
    assert not checkpoint_folder(services, tenants["alice"], model_id, STATE, "expiring").exists()
    assert kept.endswith("/kept")
    gone = client.put("/v1/checkpoints/ttl", json={"path": expiring, "ttl_seconds": 60}, headers=alice)
    assert gone.status_code == 404


def test_weights_info_reads_the_run_and_its_target_modules(stack):
    client, headers, tenants, services = stack
    alice = headers["alice"]
    model_id = _adapter(client, alice)
    sampler = saved_checkpoint(services, tenants["alice"], model_id, SAMPLER, "w", step=7)
    info = _ok(client.post("/v1/weights_info", json={"tinker_path": sampler}, headers=alice))
    assert info == {
        "base_model": services.settings.base_model,
        "is_lora": True,
        "lora_rank": 4,
        "train_unembed": False,
        "train_mlp": True,
        "train_attn": True,
        "tinker_path": sampler,
        "model_id": model_id,
        "kind": "sampler",
        "checkpoint_type": "sampler",
        "size_bytes": 2,
        "step": 7,
    }
    # An adapter on attention only (made as the gateway would, with other target modules): no MLP.
    with unit_of_work(services.sessions) as session:
        AdapterRepository(session, tenants["alice"]).create(
            "attnonly", services.settings.base_model, 8, 16.0, ["q_proj", "v_proj"], seed=1
        )
    state = saved_checkpoint(services, tenants["alice"], "attnonly", STATE, "s")
    info = _ok(client.post("/v1/weights_info", json={"tinker_path": state}, headers=alice))
    assert (info["train_attn"], info["train_mlp"], info["lora_rank"], info["kind"]) == (True, False, 8, "state")
    assert info["checkpoint_type"] == "training"


def test_another_tenants_runs_and_checkpoints_are_404_like_missing_ones_and_no_key_is_401(stack):
    client, headers, tenants, services = stack
    alice, bob = headers["alice"], headers["bob"]
    model_id = _adapter(client, alice)
    path = saved_checkpoint(services, tenants["alice"], model_id, STATE, "final")
    missing_run, missing_path = "0" * 32, f"tinker://{'0' * 32}/weights/final"

    def calls(run: str, p: str):
        return [
            ("GET", f"/v1/runs/{run}", None),
            ("POST", "/v1/checkpoints/delete", {"paths": [p]}),
            ("PUT", "/v1/checkpoints/ttl", {"path": p, "ttl_seconds": 60}),
            ("POST", "/v1/weights_info", {"tinker_path": p}),
        ]

    for (method, url, body), (_, missing_url, missing_body) in zip(
        calls(model_id, path), calls(missing_run, missing_path), strict=True
    ):
        theirs = client.request(method, url, json=body, headers=bob)
        nothing = client.request(method, missing_url, json=missing_body, headers=bob)
        assert theirs.status_code == nothing.status_code == 404, (url, theirs.text)
        assert theirs.json()["type"] == nothing.json()["type"] == "NotFoundError"
        assert theirs.json()["detail"].replace(model_id, "0" * 32) == nothing.json()["detail"]
        for key in ({}, {"X-API-Key": "tml-not-a-key"}):
            unauthorized = client.request(method, url, json=body, headers=key)
            assert unauthorized.status_code == 401, (url, unauthorized.text)
    for url in ("/v1/runs", "/v1/checkpoints"):
        assert client.get(url).status_code == 401
        assert client.get(url, headers=bob).json()["cursor"]["total_count"] == 0
    # Alice's checkpoint was left alone by bob's delete and ttl.
    listed = _ok(client.get("/v1/checkpoints", headers=alice))["checkpoints"]
    assert [(c["tinker_path"], c["expires_at"]) for c in listed] == [(path, None)]


@pytest.mark.parametrize(
    ("method", "url", "params", "body", "words"),
    [
        ("GET", "/v1/runs", {"limit": 0}, None, "limit"),
        ("GET", "/v1/runs", {"limit": 5000}, None, "limit"),
        ("GET", "/v1/runs", {"offset": -1}, None, "offset"),
        ("GET", "/v1/runs", {"limit": "many"}, None, "limit"),
        ("GET", "/v1/checkpoints", {"limit": 0}, None, "limit"),
        ("GET", "/v1/checkpoints", {"limit": 1001}, None, "limit"),
        ("GET", "/v1/checkpoints", {"offset": -5}, None, "offset"),
        ("POST", "/v1/checkpoints/delete", None, {"paths": ["weights/a"]}, "checkpoint path"),
        ("POST", "/v1/checkpoints/delete", None, {"paths": ["tinker://m/other/a"]}, "checkpoint path"),
        ("POST", "/v1/checkpoints/delete", None, {"paths": [f"tinker://m/weights/n{i}" for i in range(1001)]}, "1000"),
        ("POST", "/v1/checkpoints/delete", None, {"paths": "tinker://m/weights/a"}, "paths"),
        ("POST", "/v1/checkpoints/delete", None, {}, "paths"),
        ("PUT", "/v1/checkpoints/ttl", None, {"path": "tinker://m/weights/a", "ttl_seconds": 0}, "ttl_seconds"),
        ("PUT", "/v1/checkpoints/ttl", None, {"path": "tinker://m/weights/a", "ttl_seconds": -3}, "ttl_seconds"),
        ("PUT", "/v1/checkpoints/ttl", None, {"path": "tinker://m/weights/a", "ttl_seconds": 10**12}, "ttl_seconds"),
        ("PUT", "/v1/checkpoints/ttl", None, {"path": "tinker://m/weights/a", "ttl_seconds": 1.5}, "ttl_seconds"),
        ("PUT", "/v1/checkpoints/ttl", None, {"path": "tinker://m/weights", "ttl_seconds": 5}, "checkpoint path"),
        ("PUT", "/v1/checkpoints/ttl", None, {"path": "tinker://m/weights/a"}, "ttl_seconds"),
        ("POST", "/v1/weights_info", None, {"tinker_path": "file:///etc/passwd"}, "checkpoint path"),
        ("POST", "/v1/weights_info", None, {"tinker_path": "tinker://m/weights/a", "x": 1}, "x"),
        ("POST", "/v1/weights_info", None, {}, "tinker_path"),
    ],
)
def test_bad_input_is_a_4xx_with_a_message(stack, method, url, params, body, words):
    client, headers, _, _ = stack
    response = client.request(method, url, params=params, json=body, headers=headers["alice"])
    assert response.status_code in (400, 422), response.text
    assert words in response.text


def test_the_service_refuses_bad_pages_and_ttls_itself(stack):
    """The Tinker routes call the service with their own parsing: the rules hold there too (400s, not 500s)."""
    _, _, tenants, services = stack
    alice = TenantRef(tenants["alice"], "alice")
    for limit, offset in ((0, 0), (1001, 0), (5, -1), (True, 0)):
        with pytest.raises(InvalidRequestError):
            service.list_runs(services, alice, limit, offset)
        with pytest.raises(InvalidRequestError):
            service.list_all_checkpoints(services, alice, limit, offset)
    for ttl in (0, -1, 10**12, True):
        with pytest.raises(InvalidRequestError, match="ttl_seconds"):
            service.set_checkpoint_ttl(services, alice, "tinker://m/weights/a", ttl)
    with pytest.raises(InvalidRequestError, match="at most 1000"):
        service.delete_checkpoints(services, alice, [f"tinker://m/weights/n{i}" for i in range(1001)])
