"""The Tinker routes (/api/v1) on a gateway without a pool (real Redis, SQLite): handshake, sessions and their end,
create_model's mapping, what is refused and how (4xx with a message; a refused chain step holds its seq_id), the
protobuf and zstd bodies, futures while nothing runs them, and admission control as the SDK meets it."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import zstandard
from sqlalchemy import update
from tinker import types

from loraplex.api.tinker.training import ATTENTION_MODULES
from loraplex.protocol import RequestKind
from loraplex.service import reap_idle_sessions
from loraplex.settings import Settings
from loraplex.storage.enums import CheckpointKind
from loraplex.storage.models import Adapter, TrainingSession
from loraplex.storage.repositories import unit_of_work
from loraplex.storage.types import utcnow
from tests.helpers.checkpoint_rows import saved_checkpoint
from tests.helpers.queued import queued, rejections
from tests.helpers.tinker_wire import forward_backward_body, text_datum
from tests.integration.conftest import gateway_app

PROTOBUF = {"Content-Type": "application/x-protobuf"}


@pytest.fixture()
def tk(tmp_path, redis_url):
    settings = Settings(
        home=tmp_path,
        redis_url=redis_url,
        pool=f"tk-{tmp_path.name}",
        max_rank=16,
        tinker_long_poll_seconds=0.2,
        max_queued_requests_per_tenant=6,
    )
    with gateway_app(settings) as gw:
        yield gw


def _h(gw, who: str = "alice") -> dict[str, str]:
    return {"X-API-Key": gw.keys[who]}


def _session(gw, who: str = "alice") -> str:
    response = gw.client.post("/api/v1/create_session", json={"tags": ["t"], "user_metadata": None, "sdk_version": "0.38.0", "type": "create_session"}, headers=_h(gw, who))  # fmt: skip
    assert response.status_code == 200, response.text
    return response.json()["session_id"]


def _create(gw, session_id: str, seq: int = 0, who: str = "alice", **lora) -> dict:
    body = {"session_id": session_id, "model_seq_id": seq, "base_model": "tiny", "lora_config": {"rank": 4, **lora},
            "type": "create_model"}  # fmt: skip
    return gw.client.post("/api/v1/create_model", json=body, headers=_h(gw, who))


def _fb_body(model_id: str, seq_id: int, n: int = 6, forward_only: bool = False) -> bytes:
    return forward_backward_body(model_id, seq_id, [text_datum(list(range(1, n + 2)))], forward_only=forward_only)


def test_the_handshake_and_what_is_left_out(tk) -> None:
    config = tk.client.post("/api/v1/client/config", json={"sdk_version": "0.38.0"}, headers=_h(tk))
    assert config.status_code == 200 and config.json()["pjwt_auth_enabled"] is False
    assert tk.client.post("/api/v1/client/dynamic_config", json={}, headers=_h(tk)).status_code == 404  # defaults
    assert tk.client.post("/api/v1/client/config", json={}).status_code == 401
    info = tk.client.post("/api/v1/create_session", json={"tags": []}, headers=_h(tk)).json()
    assert "train_unembed" in info["info_message"]
    assert tk.client.post("/api/v1/telemetry", json={"events": []}, headers=_h(tk)).json() == {"status": "accepted"}
    caps = tk.client.get("/api/v1/get_server_capabilities", headers=_h(tk)).json()
    assert caps["supported_models"][0]["model_name"] == tk.services.settings.base_model
    health = tk.client.get("/api/v1/healthz")
    assert health.status_code == 503 and "pool" in str(health.json()["down"])  # no pool runs here
    join = tk.client.post("/api/v1/join_sampling_session", json={}, headers=_h(tk))
    assert join.status_code == 400 and "not offered" in join.json()["detail"]


def test_sessions_beat_finish_and_free_their_adapters(tk) -> None:
    sid = _session(tk)
    assert tk.client.post("/api/v1/session_heartbeat", json={"session_id": sid}, headers=_h(tk)).status_code == 200
    assert tk.client.post("/api/v1/session_heartbeat", json={"session_id": sid}, headers=_h(tk, "bob")).status_code == 404
    model_id = _create(tk, sid).json()["model_id"]
    native = tk.client.get("/v1/adapters", headers=_h(tk)).json()
    assert [a["model_id"] for a in native] == [model_id]  # the same adapter the native routes see

    finished = tk.client.post(f"/api/v1/sessions/{sid}/finish", json={"reason": {"type": "success"}}, headers=_h(tk))
    assert finished.status_code == 200 and finished.json()["freed_models"] == [model_id]
    assert tk.client.get("/v1/adapters", headers=_h(tk)).json() == []
    deletes = [e for e in queued(tk.services).values() if e.kind == RequestKind.DELETE_ADAPTER]
    assert [e.model_id for e in deletes] == [model_id]  # freed through the queue, after its queued steps
    gone = tk.client.post("/api/v1/session_heartbeat", json={"session_id": sid}, headers=_h(tk))
    assert gone.status_code == 410  # the SDK stops beating
    assert _create(tk, sid, seq=1).status_code == 410  # no new adapters in a finished session
    again = tk.client.post(f"/api/v1/sessions/{sid}/finish", json={}, headers=_h(tk))
    assert again.status_code == 200 and again.json()["freed_models"] == []
    assert tk.client.post(f"/api/v1/sessions/{sid}/finish", json={}, headers=_h(tk, "bob")).status_code == 404


def test_a_session_that_stops_beating_expires_and_frees_its_adapters(tk) -> None:
    sid, kept = _session(tk), _session(tk)
    model_id = _create(tk, sid).json()["model_id"]
    other = _create(tk, kept).json()["model_id"]
    with unit_of_work(tk.services.sessions) as db:
        db.execute(update(TrainingSession).where(TrainingSession.id == sid)
                   .values(last_heartbeat_at=utcnow() - timedelta(hours=1)))  # fmt: skip
    assert reap_idle_sessions(tk.services) == 1
    assert tk.client.post("/api/v1/session_heartbeat", json={"session_id": sid}, headers=_h(tk)).status_code == 410
    live = [a["model_id"] for a in tk.client.get("/v1/adapters", headers=_h(tk)).json()]
    assert live == [other] and model_id not in live
    assert reap_idle_sessions(tk.services) == 0  # the lock: one gateway per round


def test_create_model_maps_lora_config_and_answers_retries_with_the_first_future(tk) -> None:
    sid = _session(tk)
    first = _create(tk, sid, seed=5)
    assert first.status_code == 200, first.text
    ref = first.json()
    assert ref["model_id"] == f"{sid}:train:0" and ref["request_id"].startswith("create.")
    assert _create(tk, sid, seed=5).json() == ref  # the SDK's retry: the same future, nothing queued twice
    assert _create(tk, sid).json() == ref  # a retry without a seed too (the row keeps the drawn one)
    attn = _create(tk, sid, seq=1, train_mlp=False).json()["model_id"]
    with tk.services.sessions() as db:
        row = db.get(Adapter, attn)
        assert set(row.target_modules) == ATTENTION_MODULES and row.session_id == sid

    nothing = _create(tk, sid, seq=2, train_mlp=False, train_attn=False)
    assert nothing.status_code == 400 and "train_attn" in nothing.json()["detail"]
    too_big = _create(tk, sid, seq=3, rank=64)
    assert too_big.status_code == 400 and "maximum rank 16" in too_big.json()["detail"]
    body = {"session_id": sid, "model_seq_id": 4, "base_model": "tiny", "lora_config": {"rank": 4},
            "optimizer_config": {"type": "dimuon", "version": 1}}  # fmt: skip
    dimuon = tk.client.post("/api/v1/create_model", json=body, headers=_h(tk))
    assert dimuon.status_code == 400 and "dimuon" in dimuon.json()["detail"].lower()
    other_base = tk.client.post("/api/v1/create_model", json={**body, "optimizer_config": {"type": "adamw"},
                                                              "base_model": "Qwen/Qwen3-8B"}, headers=_h(tk))  # fmt: skip
    assert other_base.status_code == 400 and "not served here" in other_base.json()["detail"]
    assert _create(tk, sid, seq=5, who="bob").status_code == 404  # another tenant's session


def test_get_info_names_the_tokenizer_never_a_server_folder(tk) -> None:
    model_id = _create(tk, _session(tk)).json()["model_id"]
    folder = tk.services.settings.resolved_model_cache / "tiny"
    folder.mkdir(parents=True)
    (folder / "tokenizer.json").write_text("{}")
    info = tk.client.post("/api/v1/get_info", json={"model_id": model_id}, headers=_h(tk)).json()
    assert info["model_data"]["tokenizer_id"] == "tiny" and info["lora_rank"] == 4  # the base model's name
    assert str(tk.services.settings.home) not in json.dumps(info)
    assert tk.client.post("/api/v1/get_info", json={"model_id": model_id}, headers=_h(tk, "bob")).status_code == 404


def test_forward_backward_protobuf_and_zstd_bodies_queue_like_the_native_route(tk) -> None:
    model_id = _create(tk, _session(tk)).json()["model_id"]
    plain = tk.client.post("/api/v1/forward_backward", content=_fb_body(model_id, 1), headers={**_h(tk), **PROTOBUF})
    assert plain.status_code == 200, plain.text
    assert plain.json()["request_id"].startswith("fwd.")
    packed = zstandard.ZstdCompressor().compress(_fb_body(model_id, 2, forward_only=True))
    zstd = tk.client.post("/api/v1/forward_backward", content=packed,
                          headers={**_h(tk), **PROTOBUF, "Content-Encoding": "zstd"})  # fmt: skip
    assert zstd.status_code == 200, zstd.text
    kinds = {e.seq_id: e.kind for e in queued(tk.services).values() if e.model_id == model_id and e.seq_id > 0}
    assert kinds == {1: RequestKind.FORWARD_BACKWARD, 2: RequestKind.FORWARD}
    payload = next(e.payload.to_wire() for e in queued(tk.services).values() if e.seq_id == 1 and e.model_id == model_id)
    assert payload["data"][0]["model_input"] == [1, 2, 3, 4, 5, 6]
    retry = tk.client.post("/api/v1/forward_backward", content=_fb_body(model_id, 1), headers={**_h(tk), **PROTOBUF})
    assert retry.json()["request_id"] == plain.json()["request_id"]  # (model_id, seq_id) is the idempotency key


def test_refused_chain_steps_hold_their_seq_id_and_say_why(tk) -> None:
    """A refused step leaves no hole: its rejection is queued in its seq_id's place (as on the native routes)."""
    model_id = _create(tk, _session(tk)).json()["model_id"]
    h = {**_h(tk), **PROTOBUF}
    image = types.Datum(
        model_input=types.ModelInput(chunks=[types.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=2)]),
        loss_fn_inputs={},
    )
    bad = tk.client.post("/api/v1/forward_backward", content=forward_backward_body(model_id, 1, [image]), headers=h)
    assert bad.status_code == 400 and "text tokens only" in bad.json()["detail"]
    dimuon = tk.client.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 2, "optimizer_params": {"type": "dimuon", "learning_rate": 1e-3}}, headers=_h(tk))  # fmt: skip
    assert dimuon.status_code == 400 and "AdamW" in dimuon.json()["detail"]
    negative = tk.client.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 3, "adam_params": {"learning_rate": -1}}, headers=_h(tk))  # fmt: skip
    assert negative.status_code == 422 and "learning_rate" in negative.text
    unnamed = tk.client.post("/api/v1/save_weights_for_sampler", json={"model_id": model_id, "seq_id": 4}, headers=_h(tk))  # fmt: skip
    assert unnamed.status_code == 400 and "sampling_session_seq_id" in unnamed.json()["detail"]
    held = rejections(tk.services)
    assert {seq for (m, seq) in held if m == model_id} == {1, 2, 3, 4}
    ok = tk.client.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 5, "adam_params": {}}, headers=_h(tk))
    assert ok.status_code == 200 and ok.json()["request_id"].startswith("optim.")
    garbage = tk.client.post("/api/v1/forward_backward", content=b"\xff\x00junk", headers=h)
    assert garbage.status_code == 400 and "protobuf" in garbage.json()["detail"]


def test_a_clash_is_400_on_the_tinker_routes_so_the_sdk_does_not_retry_it(tk) -> None:
    """The SDK retries 409 for minutes; an existing checkpoint name never stops clashing."""
    model_id = _create(tk, _session(tk)).json()["model_id"]
    saved_checkpoint(tk.services, tk.tenant_ids["alice"], model_id, CheckpointKind.STATE, "s1")
    clash = tk.client.post("/api/v1/save_weights", json={"model_id": model_id, "seq_id": 1, "path": "s1"}, headers=_h(tk))
    assert clash.status_code == 400 and clash.json()["type"] == "ConflictError", clash.text
    native = tk.client.post(f"/v1/adapters/{model_id}/save_state", json={"seq_id": 2, "name": "s1"}, headers=_h(tk))
    assert native.status_code == 409  # the native route keeps its 409


def test_futures_wait_as_try_again_with_the_queue_state_while_no_pool_runs(tk) -> None:
    ref = _create(tk, _session(tk)).json()
    waiting = tk.client.post("/api/v1/retrieve_future", json={"request_id": ref["request_id"]}, headers=_h(tk))
    body = waiting.json()
    assert waiting.status_code == 200 and body["type"] == "try_again" and body["request_id"] == ref["request_id"]
    assert body["queue_state"] == "paused_capacity" and "pool" in body["queue_state_reason"]
    for unknown in ("nope", "fwd.nope", ref["request_id"].replace("create.", "bogus.")):
        missing = tk.client.post("/api/v1/retrieve_future", json={"request_id": unknown}, headers=_h(tk))
        assert missing.status_code == 404, unknown
    foreign = tk.client.post("/api/v1/retrieve_future", json={"request_id": ref["request_id"]}, headers=_h(tk, "bob"))
    assert foreign.status_code == 404


def test_one_tenants_queue_quota_never_pauses_another(tk) -> None:
    model_id = _create(tk, _session(tk)).json()["model_id"]
    h = {**_h(tk), **PROTOBUF}
    statuses = [tk.client.post("/api/v1/forward_backward", content=_fb_body(model_id, s), headers=h) for s in range(1, 8)]
    over = [r for r in statuses if r.status_code == 429]
    assert over and over[0].headers["retry-after"] == "1" and "quota" in over[0].json()["detail"]
    bobs = _create(tk, _session(tk, "bob"), who="bob").json()["model_id"]
    bob = tk.client.post("/api/v1/forward_backward", content=_fb_body(bobs, 1), headers={**_h(tk, "bob"), **PROTOBUF})
    assert bob.status_code == 200, bob.text


def test_each_tenants_request_rate_is_limited_on_every_route(tmp_path, redis_url) -> None:
    settings = Settings(home=tmp_path, redis_url=redis_url, pool=f"rl-{tmp_path.name}", tenant_requests_per_second=0.5,
                        tenant_request_burst=3)  # fmt: skip
    with gateway_app(settings) as gw:
        calls = [gw.client.get("/v1/adapters", headers=_h(gw)),
                 gw.client.post("/api/v1/client/config", json={}, headers=_h(gw)),
                 gw.client.get("/api/v1/training_runs", headers=_h(gw))]  # fmt: skip
        assert [c.status_code for c in calls] == [200, 200, 200]
        over = gw.client.post("/api/v1/create_session", json={"tags": []}, headers=_h(gw))
        assert over.status_code == 429 and int(over.headers["retry-after"]) >= 1
        assert "requests/s" in over.json()["detail"]
        assert gw.client.get("/v1/adapters", headers=_h(gw, "bob")).status_code == 200  # bob has his own budget


def test_many_waiting_long_polls_do_not_hold_up_other_calls(tmp_path, redis_url) -> None:
    """Each retrieve_future waits on a worker thread; 80 of them waiting (more than anyio's default 40 threads) leave
    room for a submit, which is answered while they all still wait (the tenant's long-poll limit raised to 80 here;
    tests/security/test_gateway_door.py goes past it)."""
    import threading

    settings = Settings(home=tmp_path, redis_url=redis_url, pool=f"lp-{tmp_path.name}", max_rank=16,
                        tinker_long_poll_seconds=6, max_long_polls_per_tenant=80)  # fmt: skip
    with gateway_app(settings) as gw:
        ref = _create(gw, _session(gw)).json()
        answered: list[float] = []
        import time

        def poll() -> None:
            gw.client.post("/api/v1/retrieve_future", json={"request_id": ref["request_id"]}, headers=_h(gw))
            answered.append(time.monotonic())

        pollers = [threading.Thread(target=poll) for _ in range(80)]
        for t in pollers:
            t.start()
        time.sleep(1.0)  # all 80 are waiting now
        started = time.monotonic()
        session = gw.client.post("/api/v1/create_session", json={"tags": []}, headers=_h(gw))
        done = time.monotonic()
        assert session.status_code == 200 and not answered, "the submit waited for the long polls"
        assert done - started < 5  # well inside the polls' 6 s wait
        for t in pollers:
            t.join()
        assert len(answered) == 80


def test_samplers_and_samples_queue_outside_any_chain(tk) -> None:
    sid = _session(tk)
    model_id = _create(tk, sid).json()["model_id"]
    path = saved_checkpoint(tk.services, tk.tenant_ids["alice"], model_id, CheckpointKind.SAMPLER, "w1")
    body = {"session_id": sid, "sampling_session_seq_id": 0, "model_path": path}
    created = tk.client.post("/api/v1/create_sampling_session", json=body, headers=_h(tk))
    assert created.status_code == 200, created.text
    sampler_id = created.json()["sampling_session_id"]
    assert tk.client.post("/api/v1/create_sampling_session", json=body, headers=_h(tk)).json() == created.json()
    info = tk.client.get(f"/api/v1/samplers/{sampler_id}", headers=_h(tk)).json()
    assert (info["sampler_id"], info["model_path"]) == (sampler_id, path)
    assert tk.client.get(f"/api/v1/samplers/{sampler_id}", headers=_h(tk, "bob")).status_code == 404

    sample = {"sampling_session_id": sampler_id, "seq_id": 7, "num_samples": 3,
              "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
              "sampling_params": {"max_tokens": 5, "stop": [9], "seed": 1}, "prompt_logprobs": True}  # fmt: skip
    future = tk.client.post("/api/v1/asample", json=sample, headers=_h(tk))
    assert future.status_code == 200, future.text
    ref = future.json()
    assert ref["request_id"].startswith("sample.") and len(ref["sample_sequence_ids"]) == 3
    queued_sample = next(e for e in queued(tk.services).values() if e.kind == RequestKind.SAMPLE)
    assert (queued_sample.model_id, queued_sample.seq_id) == (sampler_id, 7)
    assert queued_sample.payload.to_wire()["sampler_copy"] == path and queued_sample.payload.to_wire()["stop_token_ids"] == [9]
    assert queued_sample.payload.to_wire()["sampler_copy_dir"]  # a restarted pool loads the copy from the checkpoint
    assert tk.client.post("/api/v1/asample", json=sample, headers=_h(tk)).json() == ref  # (sampler, seq_id) idempotent
    assert tk.client.post("/api/v1/asample", json=sample, headers=_h(tk, "bob")).status_code == 404

    state = saved_checkpoint(tk.services, tk.tenant_ids["alice"], model_id, CheckpointKind.STATE, "s1")
    wrong = tk.client.post("/api/v1/create_sampling_session", json={**body, "sampling_session_seq_id": 1,
                                                                       "model_path": state}, headers=_h(tk))  # fmt: skip
    assert wrong.status_code == 400 and "sampler checkpoint" in wrong.json()["detail"]
    base = tk.client.post("/api/v1/create_sampling_session", json={"session_id": sid, "sampling_session_seq_id": 2,
                                                                      "base_model": "tiny"}, headers=_h(tk))  # fmt: skip
    assert base.status_code == 200 and base.json()["sampling_session_id"] != sampler_id
    image = {**sample, "seq_id": 8, "prompt": {"chunks": [{"type": "image", "data": "AA==", "format": "png"}]}}
    assert tk.client.post("/api/v1/asample", json=image, headers=_h(tk)).status_code == 400
    huge = {**sample, "seq_id": 9, "num_samples": 10_000}
    assert tk.client.post("/api/v1/asample", json=huge, headers=_h(tk)).status_code == 400


def test_the_unnamed_sampler_save_answers_a_sampler_over_its_own_checkpoint(tk) -> None:
    sid = _session(tk)
    model_id = _create(tk, sid).json()["model_id"]
    body = {"model_id": model_id, "seq_id": 1, "sampling_session_seq_id": 0, "kind": "snapshot"}
    ref = tk.client.post("/api/v1/save_weights_for_sampler", json=body, headers=_h(tk))
    assert ref.status_code == 200, ref.text
    tag, request_id, sampler_id = ref.json()["request_id"].split(".")
    assert tag == "ssave"
    info = tk.client.get(f"/api/v1/samplers/{sampler_id}", headers=_h(tk)).json()
    assert info["model_path"] == f"tinker://{model_id}/sampler_weights/sampling-0-1"
    saves = [e for e in queued(tk.services).values() if e.kind == RequestKind.SAVE_SAMPLER]
    assert [e.request_id for e in saves] == [request_id] and saves[0].payload.to_wire()["ttl_seconds"] == 86400
    again = tk.client.post("/api/v1/save_weights_for_sampler", json=body, headers=_h(tk))
    assert again.json() == ref.json()  # the SDK's retry: the same save, the same sampler
