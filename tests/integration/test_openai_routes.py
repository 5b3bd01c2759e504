"""The OpenAI-compatible routes on the gateway without a pool (real Redis and SQLite; the tiny preset's tokenizer in
the gateway's model cache): OpenAI's error shape (401, 404 the same for another tenant's model as for a made-up one,
400 for bad or unsupported fields), what a request queues (exactly one SAMPLE per prompt, its payload, consecutive
seq_ids under one cached sampler, an Idempotency-Key), chat prompts (the plain format and a jinja chat template), the
408 when no pool answers, and /v1/models."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from loraplex.api.openai.tokenizer import GatewayTokenizer, plain_chat_prompt
from loraplex.models.tokenizer import train_tiny_tokenizer
from loraplex.protocol import RequestKind
from loraplex.settings import Settings
from loraplex.storage.enums import CheckpointKind
from tests.helpers.checkpoint_rows import saved_checkpoint
from tests.helpers.queued import queued
from tests.integration.conftest import Gateway, gateway_app

CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture()
def gw(tmp_path, redis_url) -> Iterator[Gateway]:
    settings = Settings(home=tmp_path, redis_url=redis_url, pool=f"oai-{tmp_path.name}", max_rank=16,
                        openai_wait_seconds=0.2)  # fmt: skip
    train_tiny_tokenizer().save_pretrained(settings.resolved_model_cache / "tiny")
    with gateway_app(settings) as gateway:
        yield gateway


def _h(gw: Gateway, name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {gw.keys[name]}"}


def _tok(gw: Gateway) -> GatewayTokenizer:
    return GatewayTokenizer.load(str(gw.services.settings.resolved_model_cache / "tiny"))


def _adapter_with_sampler(gw: Gateway, name: str = "alice") -> tuple[str, str]:
    r = gw.client.post("/v1/adapters", json={"rank": 4}, headers=_h(gw, name))
    assert r.status_code == 202, r.text
    model_id = r.json()["model_id"]
    return model_id, saved_checkpoint(gw.services, gw.tenant_ids[name], model_id, CheckpointKind.SAMPLER, "w1")


def _samples(gw: Gateway) -> list:
    return [e for e in queued(gw.services).values() if e.kind == RequestKind.SAMPLE]


def _error(response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    if code is not None:
        assert error["code"] == code, error
    return error


def test_no_key_is_401_in_openai_shape(gw: Gateway) -> None:
    for method, path, body in (("POST", "/v1/completions", {"model": "tiny", "prompt": "a"}),
                               ("POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "a"}]}),
                               ("GET", "/v1/models", None)):  # fmt: skip
        for headers in ({}, {"Authorization": "Bearer nope"}):
            error = _error(gw.client.request(method, path, json=body, headers=headers), 401, "invalid_api_key")
            assert error["type"] == "invalid_request_error"
    assert not _samples(gw)


def test_another_tenants_model_is_the_404_of_a_made_up_one_and_queues_nothing(gw: Gateway) -> None:
    model_id, path = _adapter_with_sampler(gw, "alice")
    made_up = {path: "tinker://0123456789abcdef0123456789abcdef/sampler_weights/w1",
               model_id: "0123456789abcdef0123456789abcdef"}  # fmt: skip
    for theirs, nobodys in made_up.items():
        for route, extra in (("/v1/completions", {"prompt": "hi"}),
                             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):  # fmt: skip
            as_bob = gw.client.post(route, json={"model": theirs, **extra}, headers=_h(gw, "bob"))
            nobody = gw.client.post(route, json={"model": nobodys, **extra}, headers=_h(gw, "bob"))
            error = _error(as_bob, 404, "model_not_found")
            assert error["message"].replace(theirs, "<m>") == _error(nobody, 404)["message"].replace(nobodys, "<m>")
            assert "alice" not in as_bob.text
    _error(gw.client.post("/v1/completions", json={"model": "other-base", "prompt": "x"}, headers=_h(gw, "alice")), 404)
    assert not _samples(gw)


def test_bad_and_unsupported_fields_are_400s_naming_them(gw: Gateway) -> None:
    alice = _h(gw, "alice")
    cases = [
        ({"prompt": "x"}, "model"),
        ({"model": "tiny", "prompt": {"a": 1}}, "prompt"),
        ({"model": "tiny", "prompt": "x", "temperature": -1}, "temperature"),
        ({"model": "tiny", "prompt": "x", "logprobs": 21}, "logprobs"),
        ({"model": "tiny", "prompt": "x", "seed": -1}, "seed"),
    ]
    for body, param in cases:
        error = _error(gw.client.post("/v1/completions", json=body, headers=alice), 400, "invalid_request")
        assert error["param"] == param and param in error["message"], error
    for body, names in (({"presence_penalty": 0.5, "frequency_penalty": 1}, ["presence_penalty", "frequency_penalty"]),
                        ({"logit_bias": {"5": 10}}, ["logit_bias"]), ({"best_of": 3}, ["best_of"]),
                        ({"echo": True}, ["echo"]), ({"suffix": "z"}, ["suffix"])):  # fmt: skip
        r = gw.client.post("/v1/completions", json={"model": "tiny", "prompt": "x", **body}, headers=alice)
        error = _error(r, 400, "unsupported_parameter")
        assert all(n in error["message"] for n in names), error
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    for body, name in (({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
                       ({"response_format": {"type": "json_object"}}, "response_format"),
                       ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
                        "messages[0].content")):  # fmt: skip
        error = _error(gw.client.post("/v1/chat/completions", json={**chat, **body}, headers=alice), 400)
        assert name in error["message"], error
    for body, text in (({"stop": ""}, "empty"), ({"n": 65}, "at most"), ({"max_tokens": 5000}, "max_tokens"),
                       ({"prompt": ""}, "prompt")):  # fmt: skip
        error = _error(gw.client.post("/v1/completions", json={"model": "tiny", "prompt": "x", **body}, headers=alice), 400)
        assert text in error["message"], error
    assert not _samples(gw)


def test_a_completion_queues_one_sample_with_its_payload_then_408s_without_a_pool(gw: Gateway) -> None:
    _, path = _adapter_with_sampler(gw)
    body = {"model": path, "prompt": "The cat sat", "max_tokens": 5, "temperature": 0, "top_p": 0.9, "n": 2,
            "stop": ["\n", "."], "seed": 3, "logprobs": 2, "user": "u1", "some_future_field": {"x": 1}}  # fmt: skip
    r = gw.client.post("/v1/completions", json=body, headers=_h(gw, "alice"))
    error = _error(r, 408, "request_timeout")
    (env,) = _samples(gw)
    assert env.request_id in error["message"] and "/v1/futures/" in error["message"]
    p = env.payload.to_wire()
    assert p["prompt"] == _tok(gw).encode("The cat sat") and p["sampler_copy"] == path and p["sampler_copy_dir"]
    assert (p["num_samples"], p["max_tokens"], p["temperature"], p["top_p"], p["seed"]) == (2, 5, 0.0, 0.9, 3)
    assert list(p["stop_strings"]) == ["\n", "."] and p["stop_at_eos"] and p["topk_sample_logprobs"] == 2
    assert env.seq_id == 1

    # Token-id prompts, two of them: two requests, the next seq_ids of the same (cached) sampler.
    r = gw.client.post("/v1/completions", json={"model": path, "prompt": [[5, 6, 7], [8, 9]]}, headers=_h(gw, "alice"))
    _error(r, 408)
    later = sorted((e for e in _samples(gw) if e.request_id != env.request_id), key=lambda e: e.seq_id)
    assert [(e.model_id, e.seq_id, e.payload.to_wire()["prompt"]) for e in later] == [(env.model_id, 2, [5, 6, 7]), (env.model_id, 3, [8, 9])]
    assert all(e.payload.to_wire()["max_tokens"] == 16 and e.payload.to_wire()["stop_at_eos"] for e in later)  # OpenAI's default 16


def test_the_base_model_and_an_adapter_id_name_what_they_sample(gw: Gateway) -> None:
    alice = _h(gw, "alice")
    _error(gw.client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2]}, headers=alice), 408)
    (base,) = _samples(gw)
    assert base.payload.sampler_copy is None and base.payload.sampler_copy_dir is None

    r = gw.client.post("/v1/adapters", json={"rank": 4}, headers=alice)
    model_id = r.json()["model_id"]
    error = _error(gw.client.post("/v1/completions", json={"model": model_id, "prompt": [1]}, headers=alice), 400)
    assert "save" in error["message"] and "sampler weights" in error["message"]
    saved_checkpoint(gw.services, gw.tenant_ids["alice"], model_id, CheckpointKind.SAMPLER, "old", step=3)
    newest = saved_checkpoint(gw.services, gw.tenant_ids["alice"], model_id, CheckpointKind.SAMPLER, "new", step=5)
    _error(gw.client.post("/v1/completions", json={"model": model_id, "prompt": [1]}, headers=alice), 408)
    assert [e.payload.to_wire()["sampler_copy"] for e in _samples(gw) if e.request_id != base.request_id] == [newest]


def test_chat_renders_the_plain_format_or_the_models_template(gw: Gateway) -> None:
    alice, tok = _h(gw, "alice"), _tok(gw)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]  # fmt: skip
    chat = {"model": "tiny", "messages": messages, "max_tokens": 3, "logprobs": True, "top_logprobs": 4}
    _error(gw.client.post("/v1/chat/completions", json=chat, headers=alice), 408)
    (plain,) = _samples(gw)
    expected = "system: Be brief.\nuser: Hi there\nassistant:"
    assert plain_chat_prompt([("system", "Be brief."), ("user", "Hi there")]) == expected
    assert plain.payload.to_wire()["prompt"] == tok.encode(expected)
    assert plain.payload.to_wire()["max_tokens"] == 3 and plain.payload.to_wire()["topk_sample_logprobs"] == 4

    folder = gw.services.settings.resolved_model_cache / "tiny"
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(chat_template=CHATML, bos_token="<|pad|>")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    _error(gw.client.post("/v1/chat/completions", json={**chat, "max_completion_tokens": 7}, headers=alice), 408)
    (templated,) = [e for e in _samples(gw) if e.request_id != plain.request_id]
    text = ("<|pad|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
            "<|im_start|>assistant\n")  # fmt: skip
    assert GatewayTokenizer.load(str(folder)).render_chat([{"role": m["role"], "content": c} for m, c in
                                                           zip(messages, ["Be brief.", "Hi there"], strict=True)]) == (text, True)  # fmt: skip
    assert templated.payload.to_wire()["prompt"] == tok.encode(text, add_special_tokens=False)
    assert templated.payload.to_wire()["prompt"][0] == tok.tokenizer.token_to_id("<|pad|>")  # the special token, one id
    assert templated.payload.to_wire()["max_tokens"] == 7


def test_an_idempotency_key_retry_takes_the_first_requests_seq_id(gw: Gateway) -> None:
    headers = {**_h(gw, "alice"), "Idempotency-Key": "retry-1"}
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4}
    first = _error(gw.client.post("/v1/completions", json=body, headers=headers), 408)
    again = _error(gw.client.post("/v1/completions", json=body, headers=headers), 408)
    (env,) = _samples(gw)
    assert env.request_id in first["message"] and env.request_id in again["message"]
    _error(gw.client.post("/v1/completions", json={**body, "max_tokens": 5}, headers=headers), 409, "conflict")
    _error(gw.client.post("/v1/completions", json=body, headers=_h(gw, "alice")), 408)  # no key: a new request
    assert len(_samples(gw)) == 2


def test_models_lists_the_base_model_and_the_tenants_sampler_checkpoints(gw: Gateway) -> None:
    _, alice_path = _adapter_with_sampler(gw, "alice")
    _, bob_path = _adapter_with_sampler(gw, "bob")
    model_id, _ = _adapter_with_sampler(gw, "alice")
    saved_checkpoint(gw.services, gw.tenant_ids["alice"], model_id, CheckpointKind.STATE, "s1")
    r = gw.client.get("/v1/models", headers=_h(gw, "alice"))
    assert r.status_code == 200, r.text
    body = r.json()
    ids = [m["id"] for m in body["data"]]
    assert body["object"] == "list" and ids[0] == "tiny" and alice_path in ids and bob_path not in ids
    assert len(ids) == 3 and all(m["object"] == "model" for m in body["data"])
