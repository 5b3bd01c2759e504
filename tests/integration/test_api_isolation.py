"""Tenant isolation over the whole route table. The routes are walked from `app.routes` (every APIRoute under /v1 and
/api/v1): each one whose path takes an adapter/run, session, request or sampler id, or whose JSON body takes one (a
model_id, session_id, request_id or a tinker path of a checkpoint; plus the protobuf forward_backward), must have an
entry in CALLS saying how to call it, else its test fails naming it. For each entry, on real Redis and SQLite (no
pool; checkpoint rows as the recorder makes them), with resources of alice's and bob's set up first:
- bob calling it on alice's resource with a body that would be valid for alice gets a 404 with a message: never a
  403 or a 2xx, and the same answer (status, type, message with the ids swapped) as for ids that do not exist, so
  it tells bob nothing; its body names none of alice's details (tenant id or name, metadata, tags, blob folders);
- it writes nothing: no row or session changes and nothing is queued in alice's stream (bob's own stream may hold a
  rejection in the seq_id of his own adapter, where the entry pairs his adapter with alice's checkpoint);
- no key at all gets 401 with a message;
- alice's own call is accepted (so bob's 404 is about ownership, not a bad body)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi.routing import APIRoute

from loraplex.api.app import create_app
from loraplex.api.tinker.codec import PROTOBUF_MEDIA_TYPE
from loraplex.models.tokenizer import train_tiny_tokenizer
from loraplex.protocol import RequestKind
from loraplex.queue import keys
from loraplex.service import write_session
from loraplex.service.pipelines import export_dir, sweep_dir
from loraplex.settings import Settings
from loraplex.storage.enums import CheckpointKind
from loraplex.storage.repositories import PipelineRepository
from tests.helpers.checkpoint_rows import saved_checkpoint
from tests.helpers.tenant_state import db_state, stream_of
from tests.helpers.tinker_wire import forward_backward_body
from tests.integration.conftest import gateway_app

PREFIXES = ("/v1/", "/api/v1/")
ID_PATH_PARAMS = ("{model_id}", "{training_run_id}", "{session_id}", "{request_id}", "{sampler_id}", "{pipeline_id}",
                  "{sweep_id}")  # fmt: skip
# Body fields that name another resource: adapters/runs, sessions, futures, checkpoints (tinker paths).
ID_BODY_FIELDS = frozenset({
    "model_id", "training_run_id", "session_id", "request_id", "from_checkpoint",
    "path", "paths", "tinker_path", "tinker_paths", "model_path", "sampling_session_id",
    "model",  # the OpenAI routes: a sampler checkpoint's tinker path or an adapter id
})  # fmt: skip
# Routes whose body carries an id but has no JSON schema to find it in (the protobuf forward_backward).
BODY_ID_ROUTES_WITHOUT_SCHEMA = frozenset({("POST", "/api/v1/forward_backward")})
DATUM = {"model_input": [1, 2, 3], "loss_fn_inputs": {"target_tokens": [2, 3, 4]}}
SECRET = "alice-secret-7f3c"


@dataclass(frozen=True)
class Owned:
    """One tenant's resources (or made-up ids of the same shapes, for the 'no such thing' answer)."""

    model_id: str  # a native adapter
    tinker_model_id: str  # "<session_id>:train:0", made by create_model
    session_id: str
    request_id: str  # a native future: an optim_step on model_id
    future_id: str  # a Tinker future: "<tag>.<request_id>" of tinker_model_id's creation
    sampler_id: str  # a sampler over the sampler checkpoint
    state_name: str = "s1"
    sampler_name: str = "w1"
    pipeline_id: str = ""  # a pipeline (queued: no Celery worker here), a point of the sweep `sweep_id`
    sweep_id: str = ""

    @property
    def state_path(self) -> str:
        return f"tinker://{self.model_id}/weights/{self.state_name}"

    @property
    def sampler_path(self) -> str:
        return f"tinker://{self.model_id}/sampler_weights/{self.sampler_name}"

    def ids(self) -> dict[str, str]:
        return {"model_id": self.model_id, "tinker_model_id": self.tinker_model_id, "session_id": self.session_id,
                "request_id": self.request_id, "future_id": self.future_id, "sampler_id": self.sampler_id,
                "pipeline_id": self.pipeline_id, "sweep_id": self.sweep_id}  # fmt: skip


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    json: Any = None
    content: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    params: dict[str, Any] | None = None


@dataclass(frozen=True)
class Variant:
    """How to call a route: `build(own, other)` -> the call, as the tenant owning `own` acting on `other`'s
    resources. `ok`: the statuses alice's own call may get. `foreign`: what bob gets: "404"; "same_4xx" for a call
    refused before any lookup (a 4xx, the same as for ids nobody owns); "ignored" for a route that reads nothing by
    the id (the same answer whoever owns it); "not_built" (every caller gets the same 400)."""

    name: str
    build: Callable[[Owned, Owned], Call]
    ok: frozenset[int] = frozenset({200})
    foreign: str = "404"


def _fb_proto(model_id: str, seq_id: int, forward_only: bool = False) -> bytes:
    return forward_backward_body(model_id, seq_id, forward_only=forward_only)


def _proto(path: str, body: bytes) -> Call:
    return Call("POST", path, content=body, headers={"Content-Type": PROTOBUF_MEDIA_TYPE})


def V(name: str, build: Callable[[Owned, Owned], Call], ok: tuple[int, ...] = (200,), foreign: str = "404") -> Variant:
    return Variant(name, build, frozenset(ok), foreign)


A = "/v1/adapters/{model_id}"
R = "/api/v1/training_runs/{training_run_id}"
CK = "/{kind}/{name}"

# (method, path template) -> how to call it. A route taking an id that is missing here fails its test.
# fmt: off
CALLS: dict[tuple[str, str], list[Variant]] = {
    # ---- native /v1 ----------------------------------------------------------------------------------------------
    ("POST", "/v1/adapters"): [
        V("from_state", lambda o, x: Call("POST", "/v1/adapters", json={"from_checkpoint": x.state_path}), (202,)),
        V("from_sampler", lambda o, x: Call("POST", "/v1/adapters",
                                            json={"from_checkpoint": x.sampler_path, "with_optimizer": False}), (202,)),
    ],
    ("GET", A): [V("get", lambda o, x: Call("GET", f"/v1/adapters/{x.model_id}"))],
    ("DELETE", A): [V("delete", lambda o, x: Call("DELETE", f"/v1/adapters/{x.model_id}"), (202,))],
    ("POST", A + "/forward_backward"): [
        V("fb", lambda o, x: Call("POST", f"/v1/adapters/{x.model_id}/forward_backward",
                                  json={"seq_id": 2, "data": [DATUM]}), (202,)),
    ],
    ("POST", A + "/forward"): [
        V("fwd", lambda o, x: Call("POST", f"/v1/adapters/{x.model_id}/forward", json={"seq_id": 2, "data": [DATUM]}),
          (202,)),
    ],
    ("POST", A + "/optim_step"): [
        V("optim", lambda o, x: Call("POST", f"/v1/adapters/{x.model_id}/optim_step",
                                     json={"seq_id": 2, "adam_params": {"learning_rate": 1e-3}}), (202,)),
    ],
    ("POST", A + "/save_state"): [
        V("save", lambda o, x: Call("POST", f"/v1/adapters/{x.model_id}/save_state", json={"seq_id": 2, "name": "n"}),
          (202,)),
    ],
    ("POST", A + "/save_weights_for_sampler"): [
        V("save", lambda o, x: Call("POST", f"/v1/adapters/{x.model_id}/save_weights_for_sampler",
                                    json={"seq_id": 2, "name": "n"}), (202,)),
    ],
    ("POST", A + "/load_state"): [
        V("into_theirs", lambda o, x: Call("POST", f"/v1/adapters/{x.model_id}/load_state",
                                           json={"seq_id": 2, "path": x.state_path}), (202,)),
        V("theirs_into_own", lambda o, x: Call("POST", f"/v1/adapters/{o.model_id}/load_state",
                                               json={"seq_id": 2, "path": x.state_path}), (202,)),
    ],
    ("GET", A + "/checkpoints"): [V("list", lambda o, x: Call("GET", f"/v1/adapters/{x.model_id}/checkpoints"))],
    ("DELETE", A + "/checkpoints" + CK): [
        V("state", lambda o, x: Call("DELETE", f"/v1/adapters/{x.model_id}/checkpoints/weights/{x.state_name}")),
        V("sampler", lambda o, x: Call("DELETE", f"/v1/adapters/{x.model_id}/checkpoints/sampler/{x.sampler_name}")),
    ],
    # Alice's export reaches her checkpoint, whose files are a stand-in here (400: not a readable checkpoint).
    ("GET", A + "/export"): [
        V("latest", lambda o, x: Call("GET", f"/v1/adapters/{x.model_id}/export"), (200, 400)),
        V("named", lambda o, x: Call("GET", f"/v1/adapters/{x.model_id}/export", params={"checkpoint": x.state_path}),
          (200, 400)),
        # A checkpoint of another adapter than the URL's is a 400 whoever owns it (no lookup): the same answer.
        V("theirs_via_own", lambda o, x: Call("GET", f"/v1/adapters/{o.model_id}/export",
                                              params={"checkpoint": x.state_path}), (400,), "same_4xx"),
    ],
    ("GET", A + "/trace"): [V("trace", lambda o, x: Call("GET", f"/v1/adapters/{x.model_id}/trace"))],
    ("GET", A + "/stats"): [V("stats", lambda o, x: Call("GET", f"/v1/adapters/{x.model_id}/stats"))],
    ("GET", "/v1/sessions/{session_id}/trace"): [
        V("trace", lambda o, x: Call("GET", f"/v1/sessions/{x.session_id}/trace")),
    ],
    ("GET", "/v1/sessions/{session_id}/stats"): [
        V("stats", lambda o, x: Call("GET", f"/v1/sessions/{x.session_id}/stats")),
    ],
    ("GET", "/v1/futures/{request_id}"): [
        V("get", lambda o, x: Call("GET", f"/v1/futures/{x.request_id}", params={"timeout": 0})),
    ],
    ("GET", "/v1/runs/{model_id}"): [V("get", lambda o, x: Call("GET", f"/v1/runs/{x.model_id}"))],
    ("POST", "/v1/checkpoints/delete"): [
        V("theirs", lambda o, x: Call("POST", "/v1/checkpoints/delete", json={"paths": [x.state_path]})),
        V("own_and_theirs", lambda o, x: Call("POST", "/v1/checkpoints/delete",
                                              json={"paths": [o.sampler_path, x.state_path]})),
    ],
    ("PUT", "/v1/checkpoints/ttl"): [
        V("ttl", lambda o, x: Call("PUT", "/v1/checkpoints/ttl", json={"path": x.state_path, "ttl_seconds": 3600})),
    ],
    ("POST", "/v1/weights_info"): [
        V("info", lambda o, x: Call("POST", "/v1/weights_info", json={"tinker_path": x.sampler_path})),
    ],
    # ---- Tinker /api/v1 ------------------------------------------------------------------------------------------
    ("POST", "/api/v1/session_heartbeat"): [
        V("beat", lambda o, x: Call("POST", "/api/v1/session_heartbeat",
                                    json={"session_id": x.session_id, "type": "session_heartbeat"})),
    ],
    ("POST", "/api/v1/sessions/{session_id}/finish"): [
        V("finish", lambda o, x: Call("POST", f"/api/v1/sessions/{x.session_id}/finish",
                                      json={"reason": {"type": "success"}, "detail": None})),
    ],
    ("POST", "/api/v1/telemetry"): [  # the batch is dropped unread: no session is looked up
        V("events", lambda o, x: Call("POST", "/api/v1/telemetry",
                                      json={"events": [], "platform": "linux", "sdk_version": "0.38.0",
                                            "session_id": x.session_id, "process_uuid": "p"}), foreign="ignored"),
    ],
    ("POST", "/api/v1/create_model"): [
        V("create", lambda o, x: Call("POST", "/api/v1/create_model",
                                      json={"session_id": x.session_id, "model_seq_id": 7, "lora_config": {"rank": 4},
                                            "type": "create_model"})),
    ],
    ("POST", "/api/v1/get_info"): [
        V("info", lambda o, x: Call("POST", "/api/v1/get_info", json={"model_id": x.tinker_model_id, "type": "get_info"})),
    ],
    ("POST", "/api/v1/forward_backward"): [
        V("fb", lambda o, x: _proto("/api/v1/forward_backward", _fb_proto(x.tinker_model_id, 2))),
        V("forward_only", lambda o, x: _proto("/api/v1/forward_backward", _fb_proto(x.tinker_model_id, 2, True))),
    ],
    ("POST", "/api/v1/optim_step"): [
        V("optim", lambda o, x: Call("POST", "/api/v1/optim_step",
                                     json={"model_id": x.tinker_model_id, "seq_id": 2,
                                           "adam_params": {"learning_rate": 1e-4}, "type": "optim_step"})),
    ],
    ("POST", "/api/v1/save_weights"): [
        V("save", lambda o, x: Call("POST", "/api/v1/save_weights",
                                    json={"model_id": x.tinker_model_id, "path": "n", "seq_id": 2})),
    ],
    ("POST", "/api/v1/save_weights_for_sampler"): [
        V("save", lambda o, x: Call("POST", "/api/v1/save_weights_for_sampler",
                                    json={"model_id": x.tinker_model_id, "path": "n", "seq_id": 2})),
    ],
    ("POST", "/api/v1/load_weights"): [
        V("create_in_their_session", lambda o, x: Call("POST", "/api/v1/load_weights",
                                                       json={"session_id": x.session_id, "model_seq_id": 9,
                                                             "path": x.state_path, "optimizer": True})),
        V("their_checkpoint_in_own_session", lambda o, x: Call("POST", "/api/v1/load_weights",
                                                               json={"session_id": o.session_id, "model_seq_id": 9,
                                                                     "path": x.state_path, "optimizer": True})),
        V("into_their_model", lambda o, x: Call("POST", "/api/v1/load_weights",
                                                json={"model_id": x.tinker_model_id, "seq_id": 2,
                                                      "path": x.state_path, "optimizer": False})),
        V("their_checkpoint_into_own_model", lambda o, x: Call("POST", "/api/v1/load_weights",
                                                               json={"model_id": o.tinker_model_id, "seq_id": 2,
                                                                     "path": x.sampler_path, "optimizer": False})),
    ],
    ("POST", "/api/v1/retrieve_future"): [
        V("future", lambda o, x: Call("POST", "/api/v1/retrieve_future",
                                      json={"request_id": x.future_id, "allow_metadata_only": True})),
        V("retagged", lambda o, x: Call("POST", "/api/v1/retrieve_future",
                                        json={"request_id": f"fwd.{x.request_id}", "allow_metadata_only": True})),
    ],
    ("GET", R): [V("get", lambda o, x: Call("GET", f"/api/v1/training_runs/{x.model_id}",
                                           params={"access_scope": "owned"}))],
    ("GET", R + "/checkpoints"): [
        V("list", lambda o, x: Call("GET", f"/api/v1/training_runs/{x.tinker_model_id}/checkpoints")),
    ],
    ("DELETE", R + "/checkpoints" + CK): [
        V("delete", lambda o, x: Call("DELETE", f"/api/v1/training_runs/{x.model_id}/checkpoints/weights/{x.state_name}"),
          (204,)),
    ],
    ("PUT", R + "/checkpoints" + CK + "/ttl"): [
        V("ttl", lambda o, x: Call("PUT", f"/api/v1/training_runs/{x.model_id}/checkpoints/sampler_weights/"
                                          f"{x.sampler_name}/ttl", json={"ttl_seconds": 60})),
    ],
    ("GET", R + "/checkpoints" + CK + "/archive"): [
        V("archive", lambda o, x: Call("GET", f"/api/v1/training_runs/{x.model_id}/checkpoints/weights/"
                                              f"{x.state_name}/archive"), (200, 400)),
    ],
    ("POST", "/api/v1/checkpoints/delete"): [
        V("theirs", lambda o, x: Call("POST", "/api/v1/checkpoints/delete", json={"tinker_paths": [x.state_path]})),
        V("own_and_theirs", lambda o, x: Call("POST", "/api/v1/checkpoints/delete",
                                              json={"tinker_paths": [o.state_path, x.sampler_path]})),
    ],
    ("POST", "/api/v1/weights_info"): [
        V("info", lambda o, x: Call("POST", "/api/v1/weights_info", json={"tinker_path": x.state_path})),
    ],
    ("GET", "/api/v1/samplers/{sampler_id}"): [
        V("get", lambda o, x: Call("GET", f"/api/v1/samplers/{x.sampler_id}")),
    ],
    ("POST", "/api/v1/create_sampling_session"): [
        V("in_their_session", lambda o, x: Call("POST", "/api/v1/create_sampling_session",
                                                json={"session_id": x.session_id, "sampling_session_seq_id": 5})),
        V("their_checkpoint", lambda o, x: Call("POST", "/api/v1/create_sampling_session",
                                                json={"session_id": o.session_id, "sampling_session_seq_id": 6,
                                                      "model_path": x.sampler_path})),
    ],
    ("POST", "/api/v1/asample"): [
        V("sample", lambda o, x: Call("POST", "/api/v1/asample", json={
            "sampling_session_id": x.sampler_id, "seq_id": 1, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
            "sampling_params": {"max_tokens": 2}})),
    ],
    ("POST", "/v1/samplers"): [
        V("their_checkpoint", lambda o, x: Call("POST", "/v1/samplers", json={"model_path": x.sampler_path}), (201,)),
    ],
    # The OpenAI routes (api/openai/): no pool here, so alice's own call waits its (short) openai_wait_seconds: 408.
    ("POST", "/v1/completions"): [
        V("sampler_path", lambda o, x: Call("POST", "/v1/completions",
                                            json={"model": x.sampler_path, "prompt": [1, 2], "max_tokens": 2}), (408,)),
        V("adapter_id", lambda o, x: Call("POST", "/v1/completions",
                                          json={"model": x.model_id, "prompt": "hi", "max_tokens": 2}), (408,)),
    ],
    ("POST", "/v1/chat/completions"): [
        V("sampler_path", lambda o, x: Call("POST", "/v1/chat/completions",
                                            json={"model": x.sampler_path, "messages": [{"role": "user", "content": "hi"}],
                                                  "stream": True}), (408,)),
    ],
    ("GET", "/v1/samplers/{sampler_id}"): [
        V("get", lambda o, x: Call("GET", f"/v1/samplers/{x.sampler_id}")),
    ],
    ("GET", "/v1/pipelines/{pipeline_id}"): [V("get", lambda o, x: Call("GET", f"/v1/pipelines/{x.pipeline_id}"))],
    ("POST", "/v1/pipelines/{pipeline_id}/cancel"): [
        V("cancel", lambda o, x: Call("POST", f"/v1/pipelines/{x.pipeline_id}/cancel")),
    ],
    ("GET", "/v1/pipelines/{pipeline_id}/export"): [
        V("export", lambda o, x: Call("GET", f"/v1/pipelines/{x.pipeline_id}/export")),
    ],
    ("GET", "/v1/sweeps/{sweep_id}/report/{name}"): [
        V("report", lambda o, x: Call("GET", f"/v1/sweeps/{x.sweep_id}/report/report.md")),
    ],
    ("POST", "/v1/samplers/{sampler_id}/sample"): [
        V("sample", lambda o, x: Call("POST", f"/v1/samplers/{x.sampler_id}/sample",
                                      json={"seq_id": 1, "prompt": [1, 2], "max_tokens": 2}), (202,)),
    ],
}
# fmt: on


def _api_routes(app) -> list[APIRoute]:
    return [r for r in app.routes if isinstance(r, APIRoute) and r.path.startswith(PREFIXES)]


def _body_field_names(openapi: dict[str, Any], schema: dict[str, Any], seen: frozenset[str] = frozenset()) -> set[str]:
    """Every property name in a request body schema, following $refs (and anyOf/allOf/items) into nested models."""
    names: set[str] = set()
    ref = schema.get("$ref")
    if ref:
        if ref in seen:
            return names
        target = openapi
        for part in ref.lstrip("#/").split("/"):
            target = target[part]
        return _body_field_names(openapi, target, seen | {ref})
    for name, sub in (schema.get("properties") or {}).items():
        names.add(name)
        names |= _body_field_names(openapi, sub, seen)
    for key in ("anyOf", "allOf", "oneOf"):
        for sub in schema.get(key) or []:
            names |= _body_field_names(openapi, sub, seen)
    if isinstance(schema.get("items"), dict):
        names |= _body_field_names(openapi, schema["items"], seen)
    return names


def routes_taking_ids(app) -> list[tuple[str, str]]:
    """(method, path) of every route under /v1 and /api/v1 that takes an id in its path or its body."""
    openapi = app.openapi()
    found = []
    for route in _api_routes(app):
        for method in sorted(route.methods or ()):
            operation = openapi["paths"].get(route.path, {}).get(method.lower(), {})
            body = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
            takes_id = (
                any(p in route.path for p in ID_PATH_PARAMS)
                or bool(_body_field_names(openapi, body) & ID_BODY_FIELDS)
                or (method, route.path) in BODY_ID_ROUTES_WITHOUT_SCHEMA
            )
            if takes_id:
                found.append((method, route.path))
    return found


_APP = create_app(Settings(redis_url="redis://unused.invalid:1"))  # only its route table (no lifespan runs)
ROUTES = routes_taking_ids(_APP)


def test_the_call_table_names_only_real_routes() -> None:
    real = {(m, r.path) for r in _api_routes(_APP) for m in r.methods or ()}
    stale = sorted(set(CALLS) - real)
    assert not stale, f"CALLS names routes that no longer exist: {stale}"
    assert ("POST", "/api/v1/forward_backward") in ROUTES and ("POST", "/api/v1/create_model") in ROUTES


# ---- the resources ------------------------------------------------------------------------------------------------------
@dataclass
class World:
    gateway: Any
    alice: Owned
    bob: Owned
    phantom: Owned  # ids of the same shapes that nobody owns
    headers: dict[str, dict[str, str]]


def _ok(response, status: int = 200) -> dict[str, Any]:
    assert response.status_code == status, response.text
    return response.json()


def _resources(gateway, name: str) -> Owned:
    client, services = gateway.client, gateway.services
    headers = {"X-API-Key": gateway.keys[name]}
    tenant_id = gateway.tenant_ids[name]
    meta = {"secret": SECRET} if name == "alice" else {}
    model_id = _ok(client.post("/v1/adapters", json={"rank": 4, "user_metadata": meta}, headers=headers), 202)["model_id"]
    for kind, checkpoint in ((CheckpointKind.STATE, "s1"), (CheckpointKind.SAMPLER, "w1")):
        saved_checkpoint(services, tenant_id, model_id, kind, checkpoint)
    request_id = _ok(client.post(f"/v1/adapters/{model_id}/optim_step", json={"seq_id": 1}, headers=headers),
                     202)["request_id"]  # fmt: skip
    session_id = _ok(client.post("/api/v1/create_session", json={"tags": [SECRET] if meta else [], "user_metadata": meta,
                                                                 "sdk_version": "0.38.0", "type": "create_session"},
                                 headers=headers))["session_id"]  # fmt: skip
    created = _ok(client.post("/api/v1/create_model",
                              json={"session_id": session_id, "model_seq_id": 0, "lora_config": {"rank": 4},
                                    "user_metadata": meta, "type": "create_model"}, headers=headers))  # fmt: skip
    tinker_model_id = created["model_id"]
    assert tinker_model_id == f"{session_id}:train:0"
    # Each adapter's seq_id 1 is taken (an optim_step), so the calls under test use seq_id 2 on both.
    _ok(client.post("/api/v1/optim_step", json={"model_id": tinker_model_id, "seq_id": 1}, headers=headers))
    sampler_path = f"tinker://{model_id}/sampler_weights/w1"
    sampler_id = _ok(client.post("/v1/samplers", json={"model_path": sampler_path}, headers=headers), 201)["sampler_id"]
    pipeline_config = {"name": "iso", "lora": {"rank": 4}, "sweep": {"grid": {"lora.rank": [4]}}}
    submitted = _ok(client.post("/v1/pipelines", json={"config": pipeline_config, "train": [
        {"prompt": SECRET if meta else "p", "completion": "c"}]}, headers=headers))  # fmt: skip
    report = sweep_dir(services, tenant_id, submitted["sweep_id"]) / "report.md"
    report.parent.mkdir(parents=True)
    report.write_text("# a finished sweep's report\n")
    pipeline_id = submitted["pipelines"][0]["id"]
    export = export_dir(services, tenant_id, pipeline_id)  # as if its pipeline had succeeded and exported
    export.mkdir(parents=True)
    (export / "adapter_config.json").write_text("{}")
    with write_session(services) as db:
        PipelineRepository(db, tenant_id).record_export(pipeline_id, str(export))
    return Owned(model_id, tinker_model_id, session_id, request_id, created["request_id"], sampler_id,
                 pipeline_id=submitted["pipelines"][0]["id"], sweep_id=submitted["sweep_id"])  # fmt: skip


def _phantom() -> Owned:
    session_id = str(uuid.uuid4())
    return Owned(uuid.uuid4().hex, f"{session_id}:train:0", session_id, str(uuid.uuid4()), f"create.{uuid.uuid4()}",
                 str(uuid.uuid4()), pipeline_id=str(uuid.uuid4()), sweep_id=uuid.uuid4().hex)  # fmt: skip


@pytest.fixture()
def world(tmp_path, redis_url) -> Iterator[World]:
    settings = Settings(home=tmp_path, redis_url=redis_url, pool=f"iso-{tmp_path.name}", max_rank=16,
                        tinker_long_poll_seconds=0, long_poll_seconds=0, openai_wait_seconds=0.01)  # fmt: skip
    train_tiny_tokenizer().save_pretrained(settings.resolved_model_cache / "tiny")  # the OpenAI routes tokenize
    with gateway_app(settings) as gateway:
        headers = {name: {"X-API-Key": key} for name, key in gateway.keys.items()}
        yield World(gateway, _resources(gateway, "alice"), _resources(gateway, "bob"), _phantom(), headers)


def _send(client, call: Call, headers: dict[str, str]):
    return client.request(call.method, call.path, json=call.json, content=call.content, params=call.params,
                          headers={**call.headers, **headers})  # fmt: skip


def _normalised(response, owned: Owned) -> tuple[int, str]:
    """Status and body with `owned`'s ids replaced by their names (so two tenants' answers compare)."""
    text = response.text
    for name, value in sorted(owned.ids().items(), key=lambda kv: -len(kv[1])):
        text = text.replace(value, f"<{name}>")
    return response.status_code, text


def _message(response) -> str:
    body = response.json()
    if isinstance(body, dict) and isinstance(body.get("error"), dict):  # OpenAI's error shape (api/openai/errors.py)
        body = {"detail": body["error"].get("message")}
    detail = body.get("detail") if isinstance(body, dict) else None
    assert isinstance(detail, str) and detail.strip(), f"{response.status_code} without a message: {response.text}"
    return detail


def _cases() -> list[Any]:
    cases = []
    for method, path in sorted(set(ROUTES) | set(CALLS)):
        for variant in CALLS.get((method, path), [None]):
            label = f"{method} {path}" + (f" [{variant.name}]" if variant else " [NOT IN CALLS]")
            cases.append(pytest.param(method, path, variant, id=label))
    return cases


@pytest.mark.parametrize(("method", "path", "variant"), _cases())
def test_another_tenant_gets_404_and_no_key_gets_401(world: World, method: str, path: str, variant: Variant | None):
    assert variant is not None, (
        f"{method} {path} takes an id but has no entry in CALLS: add how to call it (bob on alice's resource, "
        "a body valid for alice) so that its tenant isolation is tested"
    )
    gateway, alice, bob = world.gateway, world.alice, world.bob
    client, services = gateway.client, gateway.services
    call = variant.build(bob, alice)
    assert (call.method, _template_of(call.path)) == (method, path), f"{variant.name} calls {call.method} {call.path}"
    rows_before = db_state(services)
    alice_queue = stream_of(services, gateway.tenant_ids["alice"])
    bob_queue = stream_of(services, gateway.tenant_ids["bob"])

    as_bob = _send(client, call, world.headers["bob"])
    nobody = _send(client, variant.build(bob, world.phantom), world.headers["bob"])
    no_key = _send(client, call, {})

    if variant.foreign == "404":
        assert as_bob.status_code == 404, f"bob on alice's resource: {as_bob.status_code} {as_bob.text}"
        _message(as_bob)
        assert _normalised(as_bob, alice) == _normalised(nobody, world.phantom), "bob can tell alice's ids exist"
    else:  # refused before any lookup, or nothing is read by the id: the same answer as for ids nobody owns
        assert _normalised(as_bob, alice) == _normalised(nobody, world.phantom)
        assert as_bob.status_code != 403
        if variant.foreign in ("same_4xx", "not_built"):
            assert 400 <= as_bob.status_code < 500 and as_bob.status_code != 403, as_bob.text
            _message(as_bob)
    leaked = [s for s in _alice_details(world) if s in as_bob.text]
    assert not leaked, f"bob's answer names alice's {leaked}: {as_bob.text}"
    assert no_key.status_code == 401, f"no key: {no_key.status_code} {no_key.text}"
    _message(no_key)

    assert db_state(services) == rows_before, "bob's (or a keyless) call changed rows"
    assert stream_of(services, gateway.tenant_ids["alice"]) == alice_queue, "bob's call queued on alice's adapter"
    new_for_bob = stream_of(services, gateway.tenant_ids["bob"])[len(bob_queue):]
    assert all(e.kind == RequestKind.REJECTED and e.model_id in (bob.model_id, bob.tinker_model_id)
               for e in new_for_bob), new_for_bob  # fmt: skip
    # Bob claimed none of alice's seq_ids: her own call goes through (and shows the body was a valid one).
    assert not [k for k in services.redis.keys(keys.idempotency_key(alice.model_id, "*")) if k.endswith(b":2")]
    mine = _send(client, variant.build(alice, alice), world.headers["alice"])
    assert mine.status_code in variant.ok, f"alice's own call: {mine.status_code} {mine.text}"


def _alice_details(world: World) -> list[str]:
    gateway = world.gateway
    return [gateway.tenant_ids["alice"], gateway.keys["alice"], SECRET, '"alice"', "alice",
            str(gateway.services.settings.resolved_blob_root)]  # fmt: skip


def _template_of(path: str) -> str:
    """The route template a concrete path matches (the first route of the app that matches it)."""
    for route in _api_routes(_APP):
        if re.fullmatch(route.path_regex, path):
            return route.path
    return path


def test_a_protobuf_forward_backward_for_alices_adapter_sent_by_bob_is_404_and_queues_nothing(world: World):
    gateway, alice = world.gateway, world.alice
    stream = keys.request_stream(gateway.services.settings.pool, gateway.tenant_ids["alice"])
    before = gateway.services.redis.xlen(stream)
    for forward_only in (False, True):
        response = gateway.client.post("/api/v1/forward_backward", content=_fb_proto(alice.tinker_model_id, 2, forward_only),
                                       headers={**world.headers["bob"], "Content-Type": PROTOBUF_MEDIA_TYPE})  # fmt: skip
        assert response.status_code == 404 and alice.tinker_model_id in _message(response), response.text
    assert gateway.services.redis.xlen(stream) == before
    own = gateway.client.post("/api/v1/forward_backward", content=_fb_proto(alice.tinker_model_id, 2),
                              headers={**world.headers["alice"], "Content-Type": PROTOBUF_MEDIA_TYPE})  # fmt: skip
    assert own.status_code == 200 and own.json()["request_id"].startswith("fwd.")
    assert gateway.services.redis.xlen(stream) == before + 1


def test_listings_show_bob_none_of_alices_resources(world: World):
    client, alice = world.gateway.client, world.alice
    for path in ("/v1/adapters", "/v1/runs", "/v1/checkpoints", "/api/v1/training_runs", "/api/v1/checkpoints"):
        response = client.get(path, params={"limit": 1000} if "adapters" not in path else None,
                              headers=world.headers["bob"])  # fmt: skip
        assert response.status_code == 200, response.text
        assert world.bob.model_id in response.text, path
        for value in (alice.model_id, alice.tinker_model_id, alice.session_id, *_alice_details(world)):
            assert value not in response.text, f"{path} shows bob alice's {value}"
