"""Streaming samples on the pool's side, on real Redis: the native SAMPLE step in slices, wrapped as the pool wraps it
(pool/sample_partials.py), publishes a streaming request's tokens after each slice (a prefix of its result, growing)
and an end entry when its outcome is final; a request that does not stream publishes nothing. The entries carry a TTL
(shortened at the end), the reader deletes them, and a Redis that cannot be reached drops partials without failing
the sample."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.errors import NotSupportedError
from loraplex.models import load_base_model
from loraplex.pool.sample_partials import PublishingSampleStep
from loraplex.protocol import Outcome, PlannedRequest, RequestKind, Step, StepKind
from loraplex.protocol.results import SampleResult
from loraplex.queue import keys
from loraplex.queue.sample_partials import END_TTL_S, PARTIAL_TTL_S, PartialReader, PartialWriter
from loraplex.runtime.netutil import free_port
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.sampling.jobs import SampledSequence
from loraplex.workers.sampling.sampler import Sampler
from loraplex.workers.sampling.step import SampleStep
from loraplex.workers.state.adapter_store import AdapterStore


def _request(rid: str, stream: bool) -> PlannedRequest:
    payload = {"prompt": [3, 5, 7], "max_tokens": 24, "num_samples": 2, "seed": 5, "stop_at_eos": False,
               "topk_sample_logprobs": 1, "stream_partials": stream}  # fmt: skip
    return PlannedRequest(rid, "t", "sess", 0, RequestKind.SAMPLE, payload)


def test_a_streaming_request_publishes_its_tokens_each_slice_and_an_end(tiny_dir: Path, tmp_path: Path, redis_client) -> None:
    model, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    engine = build_engine(model, EngineConfig(num_slots=2, max_rank=8))
    inner = SampleStep(Sampler(engine, max_rows=4), AdapterStore(engine, 1 << 30, tmp_path / "spill"), slice_s=0.0)
    writer = PartialWriter(redis_client)
    step = PublishingSampleStep(inner, writer)
    rid, quiet = f"stream-{tmp_path.name}", f"quiet-{tmp_path.name}"
    requests = (_request(rid, True), _request(quiet, False))
    reader, after, seen = PartialReader(redis_client), {rid: "0"}, [[], []]
    ttls, entries = [], 0
    while True:
        outcomes = step(Step(StepKind.SAMPLE, requests))
        ttls.append(redis_client.ttl(keys.sample_partials(rid)))
        for _, entry_id, entry in reader.read(after, None):
            after[rid] = entry_id
            entries += 1
            for d in entry.deltas:
                assert d.start == len(seen[d.sample]) and len(d.topk) == len(d.tokens)  # in order, nothing lost
                seen[d.sample] += d.tokens
        if not any(o.unfinished for o in outcomes):
            break
        assert all(o.unfinished for o in outcomes)
    assert entry.end and not redis_client.exists(keys.sample_partials(quiet))
    result = outcomes[0].result.expect(SampleResult)
    for s, seq in enumerate(result.sequences):  # what streamed is the start of the result (its last slice comes with it)
        assert list(seq.tokens[: len(seen[s])]) == seen[s] and 0 < len(seen[s]) <= 24
    assert entries > 3 and writer.tracked == 0
    assert all(0 < t <= PARTIAL_TTL_S for t in ttls[:-1]) and 0 < ttls[-1] <= END_TTL_S
    reader.delete([rid])
    assert not redis_client.exists(keys.sample_partials(rid))


def test_a_redis_that_cannot_be_reached_drops_partials_without_failing() -> None:
    import redis

    gone = redis.Redis(port=free_port(), socket_connect_timeout=0.5, socket_timeout=0.5)  # a real refused connection
    writer = PartialWriter(gone)
    writer.update("r", [SampledSequence([1, 2], [-1.0, -1.0], "")])
    writer.end("r")
    writer.flush()  # logged, not raised
    assert writer.tracked == 0


def test_a_sampler_without_partials_or_that_fails_still_ends_its_streaming_requests(redis_client, tmp_path) -> None:
    """vLLM's step (no `progress`) and a pool without a sampler (the step raises): each streaming request's stream
    gets its end entry when its outcome is final, so its reader goes to the result at once."""
    done, failing = f"whole-{tmp_path.name}", f"fails-{tmp_path.name}"

    def whole(step: Step) -> list[Outcome]:  # answers every request whole, as the vLLM step does
        return [Outcome(r.request_id) for r in step.requests]

    def unavailable(step: Step) -> list[Outcome]:
        raise NotSupportedError("this pool has no native sampler")

    PublishingSampleStep(whole, PartialWriter(redis_client))(Step(StepKind.SAMPLE, (_request(done, True),)))
    with pytest.raises(NotSupportedError):  # the step's error stays the executor's to answer
        PublishingSampleStep(unavailable, PartialWriter(redis_client))(Step(StepKind.SAMPLE, (_request(failing, True),)))
    for rid in (done, failing):
        ((_, _, entry),) = PartialReader(redis_client).read({rid: "0"}, None)
        assert entry.end and 0 < redis_client.ttl(keys.sample_partials(rid)) <= END_TTL_S
