"""Fuzzing the gateway on real Redis and SQLite (no pool), authenticated as alice, with alice's and bob's adapters,
checkpoint rows, sessions and futures in place:
- schemathesis 4 over the native routes' OpenAPI schema (every operation under /v1; positive and negative data,
  the path ids either made up or alice's real ones): never a server error (a 503 only from /v1/healthz, which says
  the pool is down: there is none), and a response that fits the schema where one is documented;
- hypothesis over the Tinker routes: forward_backward with arbitrary bytes, mutated SDK-encoded protobufs and zstd
  garbage; every JSON route with arbitrary JSON values, with plausible bodies whose fields get wrong types, huge,
  negative or non-finite values, and with malformed JSON text.
Every response is a 4xx with a message or a well-formed 2xx, never a 5xx. After each test the queue and the
database agree (tests/helpers/tenant_state.check_consistent). Examples are derandomized: a failure reproduces."""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import schemathesis
import zstandard
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance

from loraplex.api.app import create_app
from loraplex.api.tinker.codec import PROTOBUF_MEDIA_TYPE
from loraplex.models.tokenizer import train_tiny_tokenizer
from loraplex.settings import Settings
from loraplex.storage.enums import CheckpointKind
from tests.helpers.checkpoint_rows import saved_checkpoint
from tests.helpers.tenant_state import check_consistent
from tests.helpers.tinker_wire import forward_backward_body, text_datum
from tests.integration.conftest import gateway_app

_HEALTH = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]
FUZZ = settings(max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=_HEALTH)
FUZZ_MORE = settings(FUZZ, max_examples=120)  # the Tinker routes: cheap requests, more shapes to reach


# ---- the world the fuzzing runs in --------------------------------------------------------------------------------------
@dataclass
class World:
    gateway: Any
    model_id: str  # alice's native adapter
    tinker_model_id: str  # alice's Tinker model, "<session_id>:train:0"
    session_id: str
    request_id: str  # a native future of alice's
    future_id: str  # a Tinker future of alice's
    bob_model_id: str
    bob_session_id: str

    @property
    def client(self):
        return self.gateway.client

    @property
    def headers(self) -> dict[str, str]:
        return {"X-API-Key": self.gateway.keys["alice"]}

    @property
    def state_path(self) -> str:
        return f"tinker://{self.model_id}/weights/s1"

    @property
    def sampler_path(self) -> str:
        return f"tinker://{self.model_id}/sampler_weights/w1"


def _ok(response, status: int = 200) -> dict[str, Any]:
    assert response.status_code == status, response.text
    return response.json()


def _tenant(gateway, name: str) -> tuple[str, str, str, str, str]:
    client, headers, tenant_id = gateway.client, {"X-API-Key": gateway.keys[name]}, gateway.tenant_ids[name]
    model_id = _ok(client.post("/v1/adapters", json={"rank": 4}, headers=headers), 202)["model_id"]
    saved_checkpoint(gateway.services, tenant_id, model_id, CheckpointKind.STATE, "s1")
    saved_checkpoint(gateway.services, tenant_id, model_id, CheckpointKind.SAMPLER, "w1")
    request_id = _ok(client.post(f"/v1/adapters/{model_id}/optim_step", json={"seq_id": 1}, headers=headers), 202)
    session_id = _ok(client.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}, headers=headers))
    created = _ok(client.post("/api/v1/create_model", headers=headers,
                              json={"session_id": session_id["session_id"], "model_seq_id": 0, "lora_config": {"rank": 4}}))  # fmt: skip
    return model_id, created["model_id"], session_id["session_id"], request_id["request_id"], created["request_id"]


@pytest.fixture()
def world(tmp_path, redis_url) -> Iterator[World]:
    settings_ = Settings(home=tmp_path, redis_url=redis_url, pool=f"fuzz-{tmp_path.name}", max_rank=16,
                         tinker_long_poll_seconds=0, long_poll_seconds=0, openai_wait_seconds=0.01)  # fmt: skip
    train_tiny_tokenizer().save_pretrained(settings_.resolved_model_cache / "tiny")  # the OpenAI routes tokenize
    with gateway_app(settings_) as gateway:
        model_id, tinker_model_id, session_id, request_id, future_id = _tenant(gateway, "alice")
        bob_model, _, bob_session, _, _ = _tenant(gateway, "bob")
        world = World(gateway, model_id, tinker_model_id, session_id, request_id, future_id, bob_model, bob_session)
        yield world
        read_back(world)
        check_consistent(gateway.services, gateway.tenant_ids)


def read_back(world: World) -> None:
    """Whatever the fuzzing stored, alice's listings and each of her adapters, runs and checkpoints still answer."""
    client, headers = world.client, world.headers
    for path in ("/v1/adapters", "/v1/runs?limit=1000", "/v1/checkpoints?limit=1000", "/api/v1/training_runs?limit=1000",
                 "/api/v1/checkpoints?limit=1000"):  # fmt: skip
        response = client.get(path, headers=headers)
        assert response.status_code == 200, f"GET {path} after the fuzzing: {response.status_code} {response.text[:2000]}"
    for run in client.get("/v1/runs?limit=1000", headers=headers).json()["training_runs"]:
        model_id = run["training_run_id"]
        for path in (f"/v1/runs/{model_id}", f"/api/v1/training_runs/{model_id}", f"/v1/adapters/{model_id}/checkpoints",
                     f"/api/v1/training_runs/{model_id}/checkpoints"):  # fmt: skip
            response = client.get(path, headers=headers)
            assert response.status_code in (200, 404), f"GET {path} after the fuzzing: {response.text[:2000]}"


def assert_answered(response, what: str) -> None:
    """A 4xx with a message (OpenAI's error shape on the OpenAI-compatible routes), or a 2xx with a well-formed body;
    never a 5xx."""
    status = response.status_code
    assert status < 500, f"{what}: {status} {response.text[:2000]}"
    if status >= 400:
        body = response.json()
        if isinstance(body, dict) and isinstance(body.get("error"), dict):  # api/openai/errors.py
            assert isinstance(body["error"].get("message"), str) and body["error"]["message"], response.text[:2000]
            return
        detail = body.get("detail") if isinstance(body, dict) else None
        assert detail, f"{what}: {status} without a message: {response.text[:2000]}"
        assert isinstance(detail, str) or (isinstance(detail, list) and all("msg" in d for d in detail)), response.text
    elif status != 204 and response.headers.get("content-type", "").startswith("application/json"):
        response.json()  # parses


# ---- schemathesis over the native routes -----------------------------------------------------------------------------
_APP = create_app(Settings(redis_url="redis://unused.invalid:1"))  # only its OpenAPI schema (no lifespan runs)
NATIVE = schemathesis.openapi.from_dict(_APP.openapi()).include(path_regex=r"^/v1/")
OPERATIONS = {op.label: op for op in (result.ok() for result in NATIVE.get_all_operations())}
HEALTHZ = "GET /v1/healthz"


def _fixed_path_parameters(world: World, path: str) -> dict[str, str]:
    """Alice's real ids for the path's parameters, so the generated bodies reach the service rules too."""
    real = {"model_id": world.model_id, "request_id": world.request_id, "kind": "weights", "name": "s1"}
    return {name: value for name, value in real.items() if "{" + name + "}" in path}


def _send_case(world: World, case) -> Any:
    kwargs = case.as_transport_kwargs(base_url="http://testserver")
    headers = {k: v for k, v in (kwargs.get("headers") or {}).items() if k.lower() not in ("authorization", "x-api-key")}
    body: dict[str, Any] = {}
    if "json" in kwargs:
        body["content"] = json.dumps(kwargs["json"]).encode()
        headers.setdefault("Content-Type", "application/json")
    elif kwargs.get("data") is not None:
        data = kwargs["data"]
        body["content"] = data if isinstance(data, bytes) else str(data).encode()
    return world.client.request(kwargs["method"], kwargs["url"], params=kwargs.get("params"), content=body.get("content"),
                                headers={**headers, **world.headers})  # fmt: skip


@pytest.mark.parametrize("label", sorted(OPERATIONS))
def test_native_routes_never_answer_a_server_error(world: World, label: str) -> None:
    operation = OPERATIONS[label]
    fixed = _fixed_path_parameters(world, operation.path)
    strategies = [operation.as_strategy(mode) for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
    if fixed:
        strategies += [operation.as_strategy(mode, path_parameters=fixed) for mode in GenerationMode]

    @FUZZ
    @given(case=st.one_of(strategies))
    def fuzz(case) -> None:
        response = _send_case(world, case)
        if label == HEALTHZ and response.status_code == 503:  # no pool here: healthz says so, by design
            assert "pool" in response.text
            return
        checks = [not_a_server_error, content_type_conformance, response_schema_conformance]
        case.validate_response(response, checks=checks)
        assert_answered(response, f"{label} {case.path_parameters} {case.query} {case.body!r}"[:3000])

    fuzz()


# ---- hypothesis over the Tinker routes -----------------------------------------------------------------------------
def _sdk_forward_backward(model_id: str, seq_id: int) -> bytes:
    datum = text_datum([5, 9, 11, 300, 2], weights=[1.0, 0.5, 1.0, 0.0])
    return forward_backward_body(model_id, seq_id, [datum, datum], "importance_sampling", {"clip": 0.2})


@st.composite
def mutated(draw: st.DrawFn, base: bytes) -> bytes:
    """`base` with a few bytes flipped, set, inserted or removed, truncated, or with bytes appended."""
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "append"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[at] = draw(st.integers(0, 255))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and data:
            del data[at : at + draw(st.integers(1, 8))]
        elif op == "truncate":
            del data[at:]
        elif op == "append":
            data += draw(st.binary(min_size=1, max_size=32))
    return bytes(data)


def _post_proto(world: World, body: bytes, encoding: str | None = None):
    headers = {**world.headers, "Content-Type": PROTOBUF_MEDIA_TYPE}
    if encoding:
        headers["Content-Encoding"] = encoding
    return world.client.post("/api/v1/forward_backward", content=body, headers=headers)


def test_forward_backward_takes_any_bytes(world: World) -> None:
    valid = _sdk_forward_backward(world.tinker_model_id, 2)
    first = _post_proto(world, valid)
    assert first.status_code == 200 and first.json()["request_id"].startswith("fwd."), first.text
    zstd = zstandard.ZstdCompressor()
    bodies = st.one_of(
        st.binary(max_size=2048),
        mutated(valid),
        mutated(_sdk_forward_backward(world.tinker_model_id, 3)),
    )
    encodings = st.sampled_from([None, "identity", "zstd", "ZSTD", "gzip", "zstd, gzip", ""])

    @FUZZ_MORE
    @given(body=bodies, encoding=encodings, compress=st.booleans())
    def fuzz(body: bytes, encoding: str | None, compress: bool) -> None:
        if compress and encoding and encoding.lower() == "zstd":
            body = zstd.compress(body)  # a real frame of a mutated body
        response = _post_proto(world, body, encoding)
        assert_answered(response, f"forward_backward {encoding} {body[:200]!r}")
        if response.status_code == 200:
            assert response.json()["request_id"].startswith("fwd.")

    fuzz()

    @FUZZ_MORE
    @given(garbage=st.binary(max_size=512), frame=mutated(zstd.compress(valid)))
    def zstd_garbage(garbage: bytes, frame: bytes) -> None:
        for body in (garbage, frame, zstandard.FRAME_HEADER + garbage):
            assert_answered(_post_proto(world, body, "zstd"), f"zstd {body[:200]!r}")

    zstd_garbage()


JSON_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.sampled_from(["\ud800", "\udc00x", "\x00", "a\u202eb"])
)
JSON = st.recursive(JSON_LEAVES, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)
WEIRD_STRINGS = [
    "", " ", "\x00", "\ud800", "a" * 5000, "../../etc/passwd", "tinker://", "tinker://x/weights/../y",
    "tinker://a/b/c/d", "x:train:-1", "%00", "\u202e", "😀" * 40, "create.", ".", "fwd..x", "null",
]  # fmt: skip
WEIRD = st.one_of(
    st.sampled_from(WEIRD_STRINGS),
    st.sampled_from([-1, -(2**63), 2**31, 2**63, 2**64, 10**30, 0, True, 1.5, -0.0]),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -1e-320]),
    JSON,
)


def _plausible(world: World, seq: int) -> dict[str, tuple[str, str, dict[str, Any] | None]]:
    """Each JSON Tinker route: (method, path, a body valid for alice)."""
    w = world
    return {
        "create_session": ("POST", "/api/v1/create_session",
                           {"tags": ["t"], "user_metadata": {"k": "v"}, "sdk_version": "0.38.0", "type": "create_session"}),
        "session_heartbeat": ("POST", "/api/v1/session_heartbeat", {"session_id": w.session_id, "type": "session_heartbeat"}),
        "create_model": ("POST", "/api/v1/create_model",
                         {"session_id": w.session_id, "model_seq_id": seq, "base_model": None,
                          "user_metadata": {"renderer_name": "r"},
                          "lora_config": {"rank": 4, "seed": 3, "train_unembed": True, "train_mlp": True,
                                          "train_attn": True}, "optimizer_config": {"type": "adamw"},
                          "type": "create_model"}),
        "get_info": ("POST", "/api/v1/get_info", {"model_id": w.tinker_model_id, "type": "get_info"}),
        "optim_step": ("POST", "/api/v1/optim_step",
                       {"model_id": w.tinker_model_id, "seq_id": seq,
                        "adam_params": {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12,
                                        "weight_decay": 0.0, "grad_clip_norm": 1.0}, "type": "optim_step"}),
        "save_weights": ("POST", "/api/v1/save_weights",
                         {"model_id": w.tinker_model_id, "path": f"s{seq}", "seq_id": seq, "ttl_seconds": 3600}),
        "save_weights_for_sampler": ("POST", "/api/v1/save_weights_for_sampler",
                                     {"model_id": w.tinker_model_id, "path": f"w{seq}", "seq_id": seq,
                                      "sampling_session_seq_id": None, "kind": "snapshot"}),
        "load_weights": ("POST", "/api/v1/load_weights",
                         {"session_id": w.session_id, "model_seq_id": seq, "path": w.state_path, "optimizer": True}),
        "load_state": ("POST", "/api/v1/load_weights",
                       {"model_id": w.tinker_model_id, "seq_id": seq, "path": w.sampler_path, "optimizer": False}),
        "retrieve_future": ("POST", "/api/v1/retrieve_future", {"request_id": w.future_id, "allow_metadata_only": True}),
        "telemetry": ("POST", "/api/v1/telemetry",
                      {"events": [{"event": "x"}], "platform": "linux", "sdk_version": "0.38.0",
                       "session_id": w.session_id, "process_uuid": str(uuid.uuid4())}),
        "weights_info": ("POST", "/api/v1/weights_info", {"tinker_path": w.state_path}),
        "checkpoints_delete": ("POST", "/api/v1/checkpoints/delete", {"tinker_paths": [w.sampler_path]}),
        "finish": ("POST", f"/api/v1/sessions/{w.bob_session_id}/finish", {"reason": {"type": "success"}, "detail": None}),
        "ttl": ("PUT", f"/api/v1/training_runs/{w.model_id}/checkpoints/weights/s1/ttl", {"ttl_seconds": 60}),
        "client_config": ("POST", "/api/v1/client/config", {"sdk_version": "0.38.0"}),
        "create_sampling_session": ("POST", "/api/v1/create_sampling_session",
                                    {"session_id": w.session_id, "sampling_session_seq_id": seq, "base_model": None,
                                     "model_path": w.sampler_path, "type": "create_sampling_session"}),
        "asample": ("POST", "/api/v1/asample",
                    {"sampling_session_id": w.session_id, "seq_id": seq, "num_samples": 2,
                     "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
                     "sampling_params": {"max_tokens": 4, "seed": 1, "stop": ["\n"], "temperature": 0.7,
                                         "top_k": 5, "top_p": 0.9},
                     "prompt_logprobs": True, "topk_prompt_logprobs": 2, "topk_sample_logprobs": 1, "type": "sample"}),
    }  # fmt: skip


ROUTE_NAMES = sorted(_plausible(World(None, "m", "t", "s", "r", "f", "b", "bs"), 1))


def _post_json_text(world: World, method: str, path: str, text: str | bytes):
    content = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    return world.client.request(method, path, content=content, headers={**world.headers, "Content-Type": "application/json"})


def _dumps(value: Any) -> str:
    return json.dumps(value, allow_nan=True)  # NaN and Infinity as Python writes them (its parser takes them back)


def _json_check(world: World, method: str, path: str, value: Any, what: str) -> None:
    response = _post_json_text(world, method, path, _dumps(value))
    assert_answered(response, f"{what} {method} {path} {_dumps(value)[:1500]}")
    if response.status_code == 200 and path.endswith(("/create_model", "/optim_step", "/save_weights",
                                                      "/save_weights_for_sampler", "/load_weights")):  # fmt: skip
        assert "." in response.json()["request_id"]


@pytest.mark.parametrize("route", ROUTE_NAMES)
def test_json_tinker_routes_take_any_json(world: World, route: str) -> None:
    method, path, _ = _plausible(world, 1)[route]

    @FUZZ_MORE
    @given(value=JSON)
    def fuzz(value: Any) -> None:
        _json_check(world, method, path, value, "arbitrary JSON")

    fuzz()


@pytest.mark.parametrize("route", ROUTE_NAMES)
def test_json_tinker_routes_take_wrong_field_values(world: World, route: str) -> None:
    fields = sorted(_plausible(world, 1)[route][2] or {})

    @FUZZ_MORE
    @given(seq=st.integers(2, 10**6), replaced=st.dictionaries(st.sampled_from(fields), WEIRD, min_size=1, max_size=3),
           nested=st.booleans())  # fmt: skip
    def fuzz(seq: int, replaced: dict[str, Any], nested: bool) -> None:
        method, path, body = _plausible(world, seq)[route]
        body = dict(body or {})
        for name, value in replaced.items():
            if nested and isinstance(body.get(name), dict) and body[name]:
                inner = dict(body[name])
                inner[sorted(inner)[0]] = value  # a nested field (lora_config.rank, adam_params.learning_rate...)
                body[name] = inner
            else:
                body[name] = value
        _json_check(world, method, path, body, "wrong field values")

    fuzz()


STORED_TEXT_ROUTES = {  # route -> the free-form fields it stores (and later answers back in runs and listings)
    "create_session": ("tags", "user_metadata"),
    "create_model": ("user_metadata",),
    "load_weights": ("user_metadata",),
    "native_create": ("user_metadata",),
}


@pytest.mark.parametrize("route", sorted(STORED_TEXT_ROUTES))
def test_stored_free_text_reads_back(world: World, route: str) -> None:
    """Metadata and tags are stored as given and answered back later (runs, listings): whatever is accepted must
    read back (read_back at the end), and what cannot be stored as UTF-8 is a 4xx at once."""
    text = st.one_of(st.sampled_from(WEIRD_STRINGS), st.text(max_size=12))

    @FUZZ_MORE
    @given(seq=st.integers(2, 10**6), key=text, value=st.one_of(text, WEIRD))
    def fuzz(seq: int, key: str, value: Any) -> None:
        if route == "native_create":
            method, path, body = "POST", "/v1/adapters", {"rank": 4}
        else:
            method, path, body = _plausible(world, seq)[route]
        body = {**(body or {}), "user_metadata": {key: value, "nested": [value, {key: value}]}}
        if "tags" in STORED_TEXT_ROUTES[route]:
            body["tags"] = [key, value if isinstance(value, str) else "t"]
        response = _post_json_text(world, method, path, _dumps(body))
        assert_answered(response, f"stored text {path} {_dumps(body)[:1500]}")

    fuzz()


MALFORMED = st.one_of(
    st.sampled_from([b"", b"{", b"}", b"[", b'{"a":}', b'{"model_id": "x",}', b"nul", b"\xff\xfe", b"{'a': 1}",
                     b'{"a": 1} trailing', b'"\\ud800"', b"1e999999", b"-", b'{"a": NaN}', b"[" * 10000,
                     b'{"model_id": "\x00"}', "{\"x\": \"\u00e9\"}".encode("latin-1")]),
    st.binary(max_size=200),
    st.text(max_size=200).map(str.encode),
)  # fmt: skip


@pytest.mark.parametrize("route", ROUTE_NAMES)
def test_json_tinker_routes_take_malformed_json_text(world: World, route: str) -> None:
    method, path, body = _plausible(world, 1)[route]
    valid = _dumps(body).encode()

    @FUZZ_MORE
    @given(text=st.one_of(MALFORMED, mutated(valid)))
    def fuzz(text: bytes) -> None:
        response = _post_json_text(world, method, path, text)
        assert_answered(response, f"malformed JSON {method} {path} {text[:500]!r}")

    fuzz()


def test_listings_paging_takes_any_query(world: World) -> None:
    values = st.one_of(st.integers(-(2**70), 2**70).map(str), st.sampled_from(WEIRD_STRINGS), st.text(max_size=20))
    listings = ["/api/v1/training_runs", "/api/v1/checkpoints", "/v1/runs", "/v1/pipelines"]

    @FUZZ_MORE
    @example(limit="1", offset=str(2**64), path="/v1/pipelines")  # SQLite's INTEGER overflowed: a 500
    @given(limit=values, offset=values, path=st.sampled_from(listings))
    def fuzz(limit: str, offset: str, path: str) -> None:
        try:
            params = {"limit": limit.encode("utf-8").decode(), "offset": offset.encode("utf-8").decode()}
        except UnicodeEncodeError:
            params = {"limit": "\ufffd", "offset": "0"}
        response = world.client.get(path, params=params, headers=world.headers)
        assert_answered(response, f"GET {path} {params}")

    fuzz()
