"""The OpenAI-compatible endpoint on the embedded stack with the native sampler: an adapter trained a few steps with our
client and its sampler weights saved, then /v1/completions and /v1/chat/completions with plain httpx and with the
official `openai` package (skipped where it is not installed): greedy text equals the decoded tokens our
SamplingClient samples for the same prompt (and the logprobs agree), a stream carries the same text, the adapter id
samples its newest sampler weights, /v1/models lists them, and another tenant's key gets a 404. A long stream sends its
text as the pool samples it (the first piece well before the end, many pieces) and ends as the non-streaming answer for
the same seed; a client that leaves mid-stream leaves the service answering the next call."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx
import pytest
import redis

from loraplex.api.openai.tokenizer import GatewayTokenizer, plain_chat_prompt
from loraplex.client import Datum, ServiceClient
from loraplex.queue.sample_partials import END_TTL_S
from tests.helpers.stack import create_tenants

TEXT = "The cat sat on the"
MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Where is the cat?"}]
NEW = 8


@dataclass(frozen=True)
class Trained:
    keys: dict[str, str]
    model_id: str
    path: str
    tok: GatewayTokenizer
    completion: dict  # our SamplingClient's greedy sample of TEXT
    chat: dict  # ... of the plain chat prompt of MESSAGES


@pytest.fixture(scope="module")
def trained(stack) -> Trained:
    keys = create_tenants(stack, "oai-alice", "oai-bob")
    tok = GatewayTokenizer.load(str(stack.settings.resolved_model_cache / "tiny"))
    with ServiceClient(stack.base_url, keys["oai-alice"]) as client:
        trainer = client.create_lora_training_client(rank=8, seed=4)
        for _ in range(3):
            trainer.forward_backward([Datum.for_next_token(tok.encode("The cat sat on the mat. The dog sat on the rug."))])
            trainer.optim_step({"learning_rate": 5e-2}).result()
        sampler = trainer.save_weights_and_get_sampling_client("oai-w")
        greedy = {"max_tokens": NEW, "temperature": 0.0, "topk_sample_logprobs": 2}
        completion = sampler.sample(tok.encode(TEXT), **greedy).result()["sequences"][0]
        chat_prompt = tok.encode(plain_chat_prompt([(m["role"], m["content"]) for m in MESSAGES]))
        chat = sampler.sample(chat_prompt, **greedy).result()["sequences"][0]
        return Trained(keys, trainer.model_id, sampler.model_path, tok, completion, chat)


def _post(stack, key: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{stack.base_url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=150)


def _sse(response: httpx.Response) -> list[dict]:
    events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_completions_over_httpx_equal_our_sampling_client(stack, trained: Trained) -> None:
    key, want = trained.keys["oai-alice"], trained.completion
    expected = trained.tok.decode(want["tokens"])
    assert expected.strip() and len(want["tokens"]) == NEW, want  # a real continuation to compare
    body = {"model": trained.path, "prompt": TEXT, "max_tokens": NEW, "temperature": 0, "logprobs": 2}
    r = _post(stack, key, "/v1/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    (choice,) = out["choices"]
    assert out["object"] == "text_completion" and choice["text"] == expected
    assert choice["finish_reason"] == want["stop_reason"]
    assert out["usage"] == {"prompt_tokens": len(trained.tok.encode(TEXT)), "completion_tokens": len(want["tokens"]),
                            "total_tokens": len(trained.tok.encode(TEXT)) + len(want["tokens"])}  # fmt: skip
    lp = choice["logprobs"]
    assert lp["token_logprobs"] == pytest.approx(want["logprobs"], abs=1e-5)
    assert lp["tokens"] == [trained.tok.token_text(t) for t in want["tokens"]]
    assert [len(row) for row in lp["top_logprobs"]] == [2] * NEW  # two distinct token texts each
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])

    # The adapter id samples its newest sampler weights: the same text. Two prompts (text, token ids): two choices.
    r = _post(stack, key, "/v1/completions", {**body, "model": trained.model_id, "prompt": [trained.tok.encode(TEXT)] * 2})
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == [expected, expected]

    stream = _post(stack, key, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
    chunks = _sse(stream)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == want["stop_reason"]
    assert chunks[-1]["usage"]["completion_tokens"] == len(want["tokens"])


def test_chat_over_httpx_equals_our_sampling_client_and_streams_the_same(stack, trained: Trained) -> None:
    key, want = trained.keys["oai-alice"], trained.chat
    expected = trained.tok.decode(want["tokens"])
    assert expected.strip(), want
    body = {"model": trained.path, "messages": MESSAGES, "max_tokens": NEW, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}  # fmt: skip
    r = _post(stack, key, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["message"] == {"role": "assistant", "content": expected, "refusal": None}
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == pytest.approx(want["logprobs"], abs=1e-5)
    assert all(len(e["top_logprobs"]) == 2 for e in choice["logprobs"]["content"])
    chunks = _sse(_post(stack, key, "/v1/chat/completions", {**body, "stream": True}))
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == want["stop_reason"]


def test_another_tenant_gets_404(stack, trained: Trained) -> None:
    bob = trained.keys["oai-bob"]
    for model in (trained.path, trained.model_id):
        r = _post(stack, bob, "/v1/completions", {"model": model, "prompt": TEXT})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    models = httpx.get(f"{stack.base_url}/v1/models", headers={"Authorization": f"Bearer {bob}"}).json()
    assert trained.path not in [m["id"] for m in models["data"]]


def test_the_official_openai_client(stack, trained: Trained) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=trained.keys["oai-alice"], max_retries=0)
    want_text = trained.tok.decode(trained.completion["tokens"])
    out = client.completions.create(model=trained.path, prompt=TEXT, max_tokens=NEW, temperature=0)
    assert out.choices[0].text == want_text and out.usage.completion_tokens == len(trained.completion["tokens"])
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=trained.path, prompt=TEXT, max_tokens=NEW, temperature=0, stream=True) if c.choices)  # fmt: skip
    assert streamed == want_text

    want_chat = trained.tok.decode(trained.chat["tokens"])
    chat = client.chat.completions.create(model=trained.path, messages=MESSAGES, max_tokens=NEW, temperature=0,
                                          logprobs=True, top_logprobs=1)  # fmt: skip
    assert chat.choices[0].message.content == want_chat
    assert [e.logprob for e in chat.choices[0].logprobs.content] == pytest.approx(trained.chat["logprobs"], abs=1e-5)
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=trained.path, messages=MESSAGES, max_tokens=NEW, temperature=0, stream=True) if c.choices]  # fmt: skip
    assert "".join(pieces) == want_chat

    assert trained.path in [m.id for m in client.models.list()]
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.completions.create(model=trained.path, prompt=TEXT, presence_penalty=1.0)
    bob = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=trained.keys["oai-bob"], max_retries=0)
    with pytest.raises(openai.NotFoundError):
        bob.chat.completions.create(model=trained.path, messages=MESSAGES)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="nope", max_retries=0).models.list()


# ---- streaming as the pool samples ------------------------------------------------------------------------------------
LONG = 256  # new tokens: long enough that a stream's first piece comes well before its end on the CPU pool
SEED = 11  # this seed's sample of TEXT runs past LONG / 2 tokens before an EOS


def _timed_stream(stack, key: str, path: str, body: dict) -> tuple[list[tuple[float, dict]], float]:
    """(each chunk with the seconds since the call when it arrived, the seconds until `[DONE]`), over httpx."""
    start, chunks = time.monotonic(), []
    with httpx.stream("POST", f"{stack.base_url}{path}", json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {key}"}, timeout=150) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                return chunks, time.monotonic() - start
            if line.startswith("data: "):
                chunks.append((time.monotonic() - start, json.loads(line[len("data: "):])))
    raise AssertionError("the stream ended without [DONE]")


def test_a_stream_sends_text_while_the_pool_samples_and_ends_as_the_whole_answer(stack, trained: Trained) -> None:
    key = trained.keys["oai-alice"]
    body = {"model": trained.path, "prompt": TEXT, "max_tokens": LONG, "temperature": 1.0, "seed": SEED, "n": 2,
            "stream_options": {"include_usage": True}}  # fmt: skip
    chunks, total = _timed_stream(stack, key, "/v1/completions", body)
    whole = _post(stack, key, "/v1/completions", body | {"stream_options": None}).json()
    assert len(whole["usage"]) == 3 and whole["usage"]["completion_tokens"] > LONG // 2, whole["usage"]
    for i, choice in enumerate(whole["choices"]):  # n = 2 choices, interleaved, each naming its index
        mine = [c["choices"][0] for _, c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert mine[-1]["finish_reason"] == choice["finish_reason"]
    assert chunks[-1][1]["usage"] == whole["usage"]
    # The text came in several bursts (one per sampling slice of 100 ms, each holding both choices' pieces), the
    # first a slice or more before the end, not all at the end. How many depends on the machine's speed: a fast one
    # samples the LONG tokens in three slices.
    text_times = [t for t, c in chunks if c["choices"] and c["choices"][0]["text"]]
    bursts = sorted({round(t, 2) for t in text_times})
    assert text_times[0] < total - 0.1 and len(bursts) >= 3, (total, text_times)

    # Chat through the official client: its pieces join to the non-streaming answer for the same seed.
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0)
    ask = {"model": trained.path, "messages": MESSAGES, "max_tokens": LONG // 2, "temperature": 1.0, "seed": SEED,
           "logprobs": True}  # fmt: skip
    answer = client.chat.completions.create(**ask)
    pieces, logprobs = [], []
    for c in client.chat.completions.create(**ask, stream=True):
        if c.choices:
            pieces.append(c.choices[0].delta.content or "")
            logprobs += [e.logprob for e in (c.choices[0].logprobs.content if c.choices[0].logprobs else [])]
    assert "".join(pieces) == answer.choices[0].message.content
    assert logprobs == pytest.approx([e.logprob for e in answer.choices[0].logprobs.content], abs=1e-6)


def test_a_client_that_leaves_mid_stream_leaves_the_service_healthy(stack, trained: Trained) -> None:
    key = trained.keys["oai-alice"]
    body = {"model": trained.path, "prompt": TEXT, "max_tokens": LONG, "temperature": 1.0, "seed": SEED + 1,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{stack.base_url}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {key}"}, timeout=150) as r:  # fmt: skip
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[len("data: "):])["choices"][0]["text"]:
                rid = json.loads(line[len("data: "):])["id"].removeprefix("cmpl-")
                break  # leave mid-stream: the connection closes here
    # The sample finishes on the pool; its result is readable, and its partial stream is on its way out.
    done = httpx.get(f"{stack.base_url}/v1/futures/{rid}", params={"timeout": 30},
                     headers={"Authorization": f"Bearer {key}"}, timeout=60).json()  # fmt: skip
    assert done["state"] == "complete", done
    ttl = redis.Redis.from_url(stack.settings.redis_url).ttl(f"loraplex:partial:{rid}")
    assert ttl == -2 or 0 < ttl <= END_TTL_S, ttl
    # The next call, streaming or not, is answered in full.
    chunks, _ = _timed_stream(stack, key, "/v1/completions", {**body, "max_tokens": NEW})
    whole = _post(stack, key, "/v1/completions", {**body, "max_tokens": NEW, "stream": False})
    assert whole.status_code == 200
    assert "".join(c["choices"][0]["text"] for _, c in chunks if c["choices"]) == whole.json()["choices"][0]["text"]
