"""The gateway on PostgreSQL (a throwaway cluster), with what PostgreSQL refuses to store or compare that SQLite
takes: NUL characters in ids, paths, metadata and tags, and integers past bigint. Each is a 4xx with a message,
nothing is half-written, and the tenant's next call works."""

from __future__ import annotations

import pytest

from loraplex.settings import Settings
from tests.helpers.services.postgres import postgres_server
from tests.helpers.tinker_wire import forward_backward_body
from tests.integration.conftest import gateway_app

NUL = "a\x00b"
NUL_IN_URL = "a%00b"  # the same, as a URL carries it


@pytest.fixture(scope="module")
def pg_url():
    with postgres_server() as server:
        yield server.create_database("gateway")


@pytest.fixture()
def pg(tmp_path, redis_url, pg_url):
    settings = Settings(home=tmp_path, redis_url=redis_url, database_url=pg_url, pool=f"pg-{tmp_path.name}",
                        max_rank=16)  # fmt: skip
    with gateway_app(settings) as gw:
        yield gw


def test_values_postgresql_cannot_hold_are_4xx_and_the_next_call_works(pg) -> None:
    h = {"X-API-Key": pg.keys["alice"]}
    sid = pg.client.post("/api/v1/create_session", json={"tags": []}, headers=h).json()["session_id"]
    model_id = pg.client.post("/v1/adapters", json={"rank": 4}, headers=h).json()["model_id"]
    fb = forward_backward_body(NUL, 1)
    calls = [
        ("GET", f"/v1/adapters/{NUL_IN_URL}", None),
        ("GET", f"/v1/runs/{NUL_IN_URL}", None),
        ("GET", f"/v1/adapters/{model_id}/checkpoints", None),  # a control: answers 200
        ("POST", "/v1/adapters", {"rank": 4, "user_metadata": {"k": NUL}}),
        ("POST", "/v1/adapters", {"from_checkpoint": f"tinker://{NUL}/weights/x"}),
        ("POST", "/api/v1/create_session", {"tags": [NUL]}),
        ("POST", "/api/v1/session_heartbeat", {"session_id": NUL}),
        ("POST", "/api/v1/get_info", {"model_id": NUL}),
        ("POST", "/api/v1/create_model", {"session_id": sid, "model_seq_id": 0, "base_model": "tiny",
                                          "lora_config": {"rank": 4}, "user_metadata": {NUL: "v"}}),
        ("POST", "/api/v1/optim_step", {"model_id": NUL, "seq_id": 1, "adam_params": {}}),
        ("POST", "/api/v1/retrieve_future", {"request_id": f"fwd.{NUL}"}),
        ("POST", "/api/v1/weights_info", {"tinker_path": f"tinker://{model_id}/weights/{NUL}"}),
        ("GET", f"/api/v1/training_runs/{NUL_IN_URL}/checkpoints", None),
        ("GET", "/api/v1/training_runs?offset=9223372036854775808", None),
        ("GET", "/v1/pipelines?offset=9223372036854775808", None),
    ]  # fmt: skip
    for method, path, body in calls:
        response = pg.client.request(method, path, json=body, headers=h)
        ok = path.endswith(f"{model_id}/checkpoints")
        assert response.status_code == (200 if ok else response.status_code) and response.status_code < 500, (
            method, path, body, response.status_code, response.text)  # fmt: skip
        if not ok:
            assert 400 <= response.status_code < 500 and response.text, (method, path, response.text)
    response = pg.client.post("/api/v1/forward_backward", content=fb, headers={**h, "Content-Type": "application/x-protobuf"})
    assert 400 <= response.status_code < 500, response.text
    adapters = pg.client.get("/v1/adapters", headers=h).json()
    assert [a["model_id"] for a in adapters] == [model_id]  # nothing half-created
    assert pg.client.post(f"/v1/adapters/{model_id}/optim_step", json={"seq_id": 1}, headers=h).status_code == 202
