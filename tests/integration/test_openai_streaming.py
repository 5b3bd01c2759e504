"""`stream: true` on the gateway over real HTTP (uvicorn) and real Redis, the test playing the pool: it reads the queued
SAMPLE requests and writes what a pool writes (partial entries through PartialWriter, results through ResultStore).
Each slice's text reaches the client before the next slice is published; n x prompts choices interleave by index and
join to the non-streaming answer's text; the partial streams are deleted at the end. A sample that fails before any
text is its HTTP error, one that fails later an error event; nothing at all is a 408; a client that leaves mid-stream
gives its long-poll slot back, and the next call is answered."""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from loraplex.api.app import create_app
from loraplex.api.openai import responses
from loraplex.api.openai.tokenizer import GatewayTokenizer
from loraplex.errors import InvalidRequestError
from loraplex.models.tokenizer import train_tiny_tokenizer
from loraplex.protocol import Outcome, RequestKind
from loraplex.protocol.results import SampledSequence, SampleResult
from loraplex.queue import keys
from loraplex.queue.results import ResultStore
from loraplex.queue.sample_partials import PartialWriter
from loraplex.service.context import Services
from loraplex.settings import Settings
from loraplex.storage.db import migrate
from loraplex.storage.repositories import TenantRepository, unit_of_work
from tests.helpers.http_server import serving
from tests.helpers.queued import queued

STOPS = ["sat on"]


@dataclass
class Served:
    url: str
    services: Services
    tenant_id: str
    key: str
    tok: GatewayTokenizer


@pytest.fixture()
def served(request, tmp_path, redis_url) -> Iterator[Served]:
    """The gateway; its openai_wait_seconds the test's parameter (default 30)."""
    settings = Settings(home=tmp_path, redis_url=redis_url, pool=f"oais-{tmp_path.name}", max_rank=16,
                        openai_wait_seconds=getattr(request, "param", 30.0), max_long_polls_per_tenant=1)  # fmt: skip
    train_tiny_tokenizer().save_pretrained(settings.resolved_model_cache / "tiny")
    migrate(settings.resolved_database_url)
    app = create_app(settings)
    with serving(app) as url:
        services = app.state.services
        with unit_of_work(services.sessions) as session:
            tenant, key = TenantRepository(session).create_tenant("alice")
        yield Served(url, services, tenant.id, key, GatewayTokenizer.load(str(settings.resolved_model_cache / "tiny")))


def _samples(s: Served, count: int) -> list:
    """The SAMPLE requests the gateway queued, once there are `count` (oldest first)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = [e for e in queued(s.services).values() if e.kind == RequestKind.SAMPLE]
        if len(found) >= count:
            return found
        time.sleep(0.01)
    raise AssertionError("the gateway queued nothing")


def _read(s: Served, body: dict, into: queue.Queue, leave_after_text: bool = False) -> threading.Thread:
    """A client in a thread: each line of the response into `into`, then None (its status first)."""

    def run() -> None:
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {s.key}"}) as r:  # fmt: skip
            into.put(r.status_code)
            for line in r.iter_lines():
                into.put(line)
                if leave_after_text and line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                    break  # the connection closes here
        into.put(None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _events(lines: queue.Queue, until_text: bool = False) -> list:
    """The data events read so far, waiting for the stream's end (or, until_text, for the next one with text)."""
    events = []
    while True:
        line = lines.get(timeout=10)
        if line is None:
            return events
        if isinstance(line, str) and line.startswith("data: "):
            events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
            if until_text and isinstance(events[-1], dict) and events[-1]["choices"][0].get("text"):
                return events


def _sequence(tokens: list[int], reason: str) -> SampledSequence:
    return SampledSequence(tokens, [-0.5] * len(tokens), reason)


def test_each_slice_streams_before_the_next_and_the_text_is_the_whole_answers(served: Served) -> None:
    s, tok = served, served.tok
    texts = [["the cat sat on the mat", "héllo wörld ✓ and more"], ["a dog ran far away", "猫 and the dog"]]
    lines: queue.Queue = queue.Queue()
    body = {"model": "tiny", "prompt": ["one", "two"], "n": 2, "max_tokens": 40, "stop": STOPS, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    _read(s, body, lines)
    requests = _samples(s, 2)
    assert all(e.payload.stream_partials for e in requests)
    tokens = [[tok.encode(t) for t in pair] for pair in texts]
    writer = PartialWriter(s.services.redis)
    events: list = []
    for upto in (3, 6):  # two slices: the client sees each one's text before the next is published
        for env, pair in zip(requests, tokens, strict=True):
            writer.update(env.request_id, [_sequence(t[:upto], "") for t in pair])
        writer.flush()
        events += _events(lines, until_text=True)
    results = ResultStore(s.services.redis)
    finals = []
    for env, pair in zip(requests, tokens, strict=True):
        writer.end(env.request_id)
        writer.flush()
        seqs = []
        for t in pair:  # the first sample stops at "sat on" (the token that completes it is its last)
            cut = next((k for k in range(1, len(t) + 1) if "sat on" in tok.decode(t[:k])), None)
            seqs.append(_sequence(t[:cut], "stop") if cut else _sequence(t, "length"))
        finals += seqs
        results.put(Outcome(env.request_id, result=SampleResult(sequences=tuple(seqs))))
    events += _events(lines)
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == sum(len(q.tokens) for q in finals)
    want = [responses.decode_sequence(tok, {"tokens": q.tokens, "stop_reason": q.stop_reason}, STOPS, False)
            for q in finals]  # fmt: skip
    assert want[0].text == "the cat "
    for i, d in enumerate(want):
        mine = [e["choices"][0] for e in events[:-1] if e["choices"] and e["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == d.text and mine[-1]["finish_reason"] == d.finish_reason
    for env in requests:
        assert not s.services.redis.exists(keys.sample_partials(env.request_id))


@pytest.mark.parametrize("served", [1.0], indirect=True)
def test_failures_before_and_after_the_first_text_and_a_408_without_a_pool(served: Served) -> None:
    s = served
    results, writer = ResultStore(s.services.redis), PartialWriter(s.services.redis)
    body = {"model": "tiny", "prompt": "one", "max_tokens": 8, "stream": True}
    lines: queue.Queue = queue.Queue()
    _read(s, body, lines)
    (first,) = _samples(s, 1)
    results.put(Outcome.failed(first.request_id, InvalidRequestError("token id 99999 is out of range")))
    assert lines.get(timeout=10) == 400
    refused = json.loads("".join(x for x in iter(lines.get, None) if isinstance(x, str)))
    assert "out of range" in refused["error"]["message"]

    _read(s, body, lines)
    second = next(e for e in _samples(s, 2) if e.request_id != first.request_id)
    writer.update(second.request_id, [_sequence(s.tok.encode("the cat sat"), "")])
    writer.flush()
    assert lines.get(timeout=10) == 200
    assert _events(lines, until_text=True)
    results.put(Outcome.failed(second.request_id, RuntimeError("the device fell over")))
    events = _events(lines)
    assert events[-1]["error"]["type"] == "server_error" and "[DONE]" not in events

    # No pool answers: nothing to send within openai_wait_seconds is the 408 a non-streaming call gets.
    r = httpx.post(f"{s.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {s.key}"}, timeout=30)
    assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout", r.text


def test_a_client_that_leaves_mid_stream_gives_its_long_poll_slot_back(served: Served) -> None:
    s = served  # one long-poll slot for the tenant: a slot still held would 429 the next call
    writer = PartialWriter(s.services.redis)
    lines: queue.Queue = queue.Queue()
    body = {"model": "tiny", "prompt": "one", "max_tokens": 8, "stream": True}
    client = _read(s, body, lines, leave_after_text=True)
    (env,) = _samples(s, 1)
    writer.update(env.request_id, [_sequence(s.tok.encode("the cat sat on"), "")])
    writer.flush()
    client.join(timeout=10)
    assert not client.is_alive() and lines.get(timeout=1) == 200
    deadline = time.monotonic() + 2  # within a few polls, long before the stream's 30 s of silence would end it
    while s.services.long_polls.held(s.tenant_id) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s.services.long_polls.held(s.tenant_id) == 0
    # The sample finishes anyway; the next call (the tenant's one slot) is answered in full.
    ResultStore(s.services.redis).put(Outcome(env.request_id, result=SampleResult((_sequence([5, 6], "length"),))))
    lines = queue.Queue()
    _read(s, body, lines)
    nxt = next(e for e in _samples(s, 2) if e.request_id != env.request_id)
    ResultStore(s.services.redis).put(Outcome(nxt.request_id, result=SampleResult((_sequence([5, 6], "length"),))))
    assert lines.get(timeout=10) == 200 and _events(lines)[-1] == "[DONE]"
