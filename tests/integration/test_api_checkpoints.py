"""Checkpoint routes of the gateway against real Redis and SQLite (no worker pool): name validation, the folder the
gateway chooses, 409 on an existing name, retries, and tenant isolation (404) for load, create-from, list and delete."""

from __future__ import annotations

import pytest

from loraplex.storage.enums import CheckpointKind
from tests.helpers.checkpoint_rows import saved_checkpoint
from tests.helpers.queued import queued, queued_work, rejections


@pytest.fixture()
def stack(gateway):
    headers = {name: {"X-API-Key": key} for name, key in gateway.keys.items()}
    return gateway.client, headers, gateway.tenant_ids, gateway.services


def _adapter(client, headers) -> str:
    response = client.post("/v1/adapters", json={"rank": 4}, headers=headers)
    assert response.status_code == 202, response.text
    return response.json()["model_id"]


def _queued(services, request_id: str):
    return queued(services)[request_id]


def test_save_queues_the_folder_the_gateway_chose(stack):
    client, headers, tenants, services = stack
    model_id = _adapter(client, headers["alice"])
    response = client.post(
        f"/v1/adapters/{model_id}/save_state",
        json={"seq_id": 1, "name": "step-1", "ttl_seconds": 60},
        headers=headers["alice"],
    )
    assert response.status_code == 202, response.text
    envelope = _queued(services, response.json()["request_id"])
    expected = services.settings.resolved_blob_root.resolve() / tenants["alice"] / model_id / "state" / "step-1"
    assert str(envelope.kind) == "save_state" and envelope.seq_id == 1
    assert envelope.payload.to_wire()["directory"] == str(expected)
    assert envelope.payload.to_wire()["blob_uri"] == expected.as_uri()
    assert envelope.payload.to_wire()["path"] == f"tinker://{model_id}/weights/step-1"
    assert envelope.payload.to_wire()["ttl_seconds"] == 60
    sampler = client.post(
        f"/v1/adapters/{model_id}/save_weights_for_sampler", json={"seq_id": 2, "name": "s"}, headers=headers["alice"]
    )
    payload = _queued(services, sampler.json()["request_id"]).payload.to_wire()
    assert payload["path"] == f"tinker://{model_id}/sampler_weights/s" and payload["directory"].endswith("/sampler/s")


@pytest.mark.parametrize("name", ["../escape", "a/b", "..", ".", "with space", "x" * 129, "ü"])
def test_bad_names_are_rejected_and_nothing_is_queued(stack, name):
    client, headers, _, services = stack
    model_id = _adapter(client, headers["alice"])
    before = queued_work(services)
    for route in ("save_state", "save_weights_for_sampler"):
        response = client.post(
            f"/v1/adapters/{model_id}/{route}", json={"seq_id": 1, "name": name}, headers=headers["alice"]
        )
        assert response.status_code in (400, 422), (name, response.text)
        assert "name" in response.text
    assert queued_work(services) == before and list(rejections(services)) == [(model_id, 1)]
    empty = client.post(f"/v1/adapters/{model_id}/save_state", json={"seq_id": 1, "name": ""}, headers=headers["alice"])
    assert empty.status_code == 422


def test_existing_name_is_409_unless_overwrite_and_a_retry_gets_its_first_request(stack):
    client, headers, tenants, services = stack
    model_id = _adapter(client, headers["alice"])
    alice = headers["alice"]
    first = client.post(f"/v1/adapters/{model_id}/save_state", json={"seq_id": 1, "name": "ckpt"}, headers=alice)
    assert first.status_code == 202
    saved_checkpoint(services, tenants["alice"], model_id, CheckpointKind.STATE, "ckpt")  # the save finished
    # The same request again (a client retry) gets the first request, not a conflict.
    again = client.post(f"/v1/adapters/{model_id}/save_state", json={"seq_id": 1, "name": "ckpt"}, headers=alice)
    assert again.status_code == 202 and again.json()["request_id"] == first.json()["request_id"]
    clash = client.post(f"/v1/adapters/{model_id}/save_state", json={"seq_id": 2, "name": "ckpt"}, headers=alice)
    assert clash.status_code == 409 and "overwrite" in clash.json()["detail"]
    replace = {"seq_id": 3, "name": "ckpt", "overwrite": True}  # the rejected seq_id 2 is spent (no hole left)
    assert client.post(f"/v1/adapters/{model_id}/save_state", json=replace, headers=alice).status_code == 202
    # The sampler kind is a separate namespace.
    other = client.post(
        f"/v1/adapters/{model_id}/save_weights_for_sampler", json={"seq_id": 4, "name": "ckpt"}, headers=alice
    )
    assert other.status_code == 202


def test_other_tenants_checkpoints_are_404_everywhere(stack):
    client, headers, tenants, services = stack
    alice, bob = headers["alice"], headers["bob"]
    model_id = _adapter(client, alice)
    path = saved_checkpoint(services, tenants["alice"], model_id, CheckpointKind.STATE, "final")
    bobs = _adapter(client, bob)
    # Load into bob's own adapter, create from it, list, delete: all 404, as for a checkpoint that does not exist.
    for p in (path, f"tinker://{model_id}/weights/nope", f"tinker://{'0' * 32}/weights/final"):
        load = client.post(f"/v1/adapters/{bobs}/load_state", json={"seq_id": 1, "path": p}, headers=bob)
        assert load.status_code == 404, load.text
        create = client.post("/v1/adapters", json={"from_checkpoint": p}, headers=bob)
        assert create.status_code == 404, create.text
    assert client.get(f"/v1/adapters/{model_id}/checkpoints", headers=bob).status_code == 404
    assert client.delete(f"/v1/adapters/{model_id}/checkpoints/weights/final", headers=bob).status_code == 404
    assert len(client.get("/v1/adapters", headers=bob).json()) == 1  # the failed creates left nothing behind
    # Alice can do all of it.
    listed = client.get(f"/v1/adapters/{model_id}/checkpoints", headers=alice).json()["checkpoints"]
    assert [(c["tinker_path"], c["checkpoint_id"], c["checkpoint_type"], c["step"]) for c in listed] == [
        (path, "weights/final", "training", 3)
    ]
    load = client.post(f"/v1/adapters/{model_id}/load_state", json={"seq_id": 1, "path": path}, headers=alice)
    assert load.status_code == 202
    payload = _queued(services, load.json()["request_id"]).payload.to_wire()
    assert payload["directory"].endswith(f"/{model_id}/state/final") and payload["with_optimizer"] is True
    created = client.post("/v1/adapters", json={"from_checkpoint": path, "with_optimizer": False}, headers=alice)
    assert created.status_code == 202, created.text
    envelope = _queued(services, created.json()["request_id"])
    assert envelope.payload.to_wire()["from_checkpoint"]["directory"] == payload["directory"]
    assert envelope.payload.to_wire()["rank"] == 4 and envelope.payload.to_wire()["from_checkpoint"]["with_optimizer"] is False
    folder = services.settings.resolved_blob_root / tenants["alice"] / model_id / "state" / "final"
    assert folder.is_dir()
    deleted = client.delete(f"/v1/adapters/{model_id}/checkpoints/weights/final", headers=alice)
    assert deleted.status_code == 200 and deleted.json()["tinker_path"] == path
    assert not folder.exists()
    assert client.get(f"/v1/adapters/{model_id}/checkpoints", headers=alice).json()["checkpoints"] == []
    assert client.delete(f"/v1/adapters/{model_id}/checkpoints/weights/final", headers=alice).status_code == 404


def test_bad_paths_and_options_are_400(stack):
    client, headers, tenants, services = stack
    alice = headers["alice"]
    model_id = _adapter(client, alice)
    sampler = saved_checkpoint(services, tenants["alice"], model_id, CheckpointKind.SAMPLER, "s1")
    for bad in ("weights/final", "tinker://x/weights", "tinker://x/other/n", "tinker://x/weights/a/b", "file:///etc"):
        response = client.post(f"/v1/adapters/{model_id}/load_state", json={"seq_id": 1, "path": bad}, headers=alice)
        assert response.status_code == 400, (bad, response.text)
    # A sampler checkpoint holds no optimizer state.
    response = client.post(f"/v1/adapters/{model_id}/load_state", json={"seq_id": 1, "path": sampler}, headers=alice)
    assert response.status_code == 400 and "with_optimizer" in response.json()["detail"]
    body = {"seq_id": 2, "path": sampler, "with_optimizer": False}  # seq_id 1 is spent by its first rejection
    assert client.post(f"/v1/adapters/{model_id}/load_state", json=body, headers=alice).status_code == 202
    # rank / alpha / seed come from the checkpoint.
    response = client.post(
        "/v1/adapters", json={"from_checkpoint": sampler, "rank": 8, "with_optimizer": False}, headers=alice
    )
    assert response.status_code == 400 and "rank" in response.json()["detail"]
