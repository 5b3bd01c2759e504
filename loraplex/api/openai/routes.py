"""OpenAI-compatible routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, authenticated like
every route (`Authorization: Bearer <key>`, which OpenAI clients send, or X-API-Key).

A call answers in one response: it tokenizes on the gateway (tokenizer.py), queues one SAMPLE request per prompt
through service.sample (`n` samples each) under the model's sampler and fresh seq_ids (models.py), waits for their
results (`services.results.wait`, at most `openai_wait_seconds`, 120 s), then decodes them (responses.py). A wait that
ends first is a 408 naming the request ids: they stay queued, and their results are readable at GET /v1/futures/{id}
(the official client retries a 408 twice, each retry queueing new samples, unless the call sends an Idempotency-Key).
A sample the pool failed is that error (a bad token id 400, a checkpoint gone 404; a failure of the pool itself 500).
`stream: true` answers Server-Sent Events as the pool samples (streaming.py: the samples publish their tokens after
each sampling slice), holding the long-poll slot until the stream ends."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Annotated, Any

from fastapi import APIRouter, Header
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.responses import Response

from loraplex import service
from loraplex.api.deps import ServicesDep, TenantDep
from loraplex.api.errors import validation_summary
from loraplex.api.openai import responses
from loraplex.api.openai.body_bound import BoundedBodyRoute
from loraplex.api.openai.bounds import check_chat, check_prompt_bytes, check_prompt_count
from loraplex.api.openai.models import list_models, resolve_model, take_seq_ids
from loraplex.api.openai.schemas import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from loraplex.api.openai.stream_state import StreamState
from loraplex.api.openai.streaming import SampleStream, SseResponse
from loraplex.api.openai.tokenizer import GatewayTokenizer, gateway_tokenizer
from loraplex.errors import InvalidRequestError, NotSupportedError, WaitTimeoutError
from loraplex.service.context import Services, TenantRef
from loraplex.service.sampling import check_sample_work, check_stops, sample_work
from loraplex.service.schemas import FutureRef, SampleRequest
from loraplex.settings import Settings

# Bodies bounded before they are parsed (body_bound.py).
router = APIRouter(tags=["openai"], route_class=BoundedBodyRoute)

IdempotencyKey = Annotated[
    str | None, Header(max_length=256, description="Same key (and body): the first call's samples")
]


def _refuse(names: list[str]) -> None:
    if names:
        raise NotSupportedError(f"not supported by this server's sampler: {', '.join(names)}")


def _stops(settings: Settings, body: SamplingFields) -> list[str]:
    """The stop strings, by the rule every sampling route shares (service/sampling.py)."""
    stops = body.stops()
    check_stops(settings, stops)
    return stops


def _queue_all(
    services: Services, tenant: TenantRef, body: SamplingFields, model: tuple[str, str | None],
    prompts: list[list[int]], request_for: Callable[[list[int]], dict[str, Any]], idempotency_key: str | None,
    slot: ExitStack,
) -> list[FutureRef]:  # fmt: skip
    """Queue one sample request per prompt of `model` (resolve_model's (base model, model path)), in prompt order,
    holding one of the tenant's long-poll slots in `slot` for the wait that follows (service/long_polls.py; taken
    before anything is queued, so a 429 leaves nothing behind)."""
    settings = services.settings
    check_prompt_count(settings, len(prompts), body.n)
    base_model, model_path = model
    requests = []
    for prompt in prompts:
        try:
            requests.append(SampleRequest.model_validate(request_for(prompt)))
        except ValidationError as exc:
            raise InvalidRequestError(validation_summary(exc.errors())) from None
    # The whole call's work (one sample request per prompt), before any of them is queued.
    work = sum(sample_work(r.num_samples, len(r.prompt), r.max_tokens) for r in requests)
    check_sample_work(settings, work, f"{len(requests)} prompts x n={body.n}")
    slot.enter_context(services.long_polls.hold(tenant.id, tenant.name))
    sampler_id, first = take_seq_ids(services, tenant, body.model, base_model, model_path, len(prompts),
                                     idempotency_key)  # fmt: skip
    return [service.sample(services, tenant, sampler_id, r.model_copy(update={"seq_id": first + i}),
                           stream_partials=body.stream) for i, r in enumerate(requests)]  # fmt: skip


def _wait_all(services: Services, refs: list[FutureRef]) -> list[dict[str, Any]]:
    """Every request's result, in order, within `openai_wait_seconds` (else a 408 naming them)."""
    settings = services.settings
    deadline = time.monotonic() + settings.openai_wait_seconds
    results = []
    for ref in refs:
        outcome = services.results.wait(ref.request_id, max(deadline - time.monotonic(), 0.0))
        if outcome is None:
            pending = ", ".join(r.request_id for r in refs)
            raise WaitTimeoutError(
                f"the samples were not done within {settings.openai_wait_seconds:g} s; they stay queued (requests "
                f"{pending}: their results are at GET /v1/futures/<id>)"
            )
        if not outcome.ok:
            raise outcome.exception("sampling failed")
        results.append({} if outcome.result is None else outcome.result.to_wire())
    return results


def _decoded(
    tok: GatewayTokenizer, results: list[dict[str, Any]], stops: list[str], pieces: bool
) -> list[responses.Decoded]:
    """Every sequence in OpenAI's choice order: prompt by prompt, its n samples each."""
    return [responses.decode_sequence(tok, seq, stops, pieces) for r in results for seq in r.get("sequences", [])]


def _streamed(
    services: Services, body: SamplingFields, refs: list[FutureRef], chunks: responses.ChunkBuilder,
    stops: list[str], prompt_tokens: int, slot: ExitStack,
) -> Response:  # fmt: skip
    """The answer as Server-Sent Events while the pool samples (streaming.py); the long-poll slot goes with it."""
    rids = [r.request_id for r in refs]
    state = StreamState(chunks.tok, chunks, stops, rids, body.n)
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    stream = SampleStream(services.results, rids, state, services.settings.openai_wait_seconds, prompt_tokens,
                          include_usage)  # fmt: skip
    try:
        first = stream.first()
    except BaseException:
        stream.close()
        raise
    return SseResponse(first, stream, slot.pop_all().close)


def _sampling(body: SamplingFields, prompt: list[int], max_tokens: int, stops: list[str], topk: int) -> dict[str, Any]:
    return {"seq_id": 0, "prompt": prompt, "num_samples": body.n, "max_tokens": max_tokens,
            "temperature": body.temperature, "top_k": body.top_k, "top_p": body.top_p, "seed": body.seed,
            "stop": stops or None, "topk_sample_logprobs": topk}  # fmt: skip


@router.post("/v1/completions", response_model=None)
def completions(body: CompletionRequest, tenant: TenantDep, services: ServicesDep,
                idempotency_key: IdempotencyKey = None) -> Response:  # fmt: skip
    """OpenAI's completions: `prompt` a string, a list of token ids, or a list of either (each answered; choice
    index = prompt index * n + sample)."""
    _refuse(body.unsupported())
    settings = services.settings
    stops = _stops(settings, body)
    given = body.prompts()
    check_prompt_count(settings, len(given), body.n)
    check_prompt_bytes(settings, [p for p in given if isinstance(p, str)])
    model = resolve_model(services, tenant, body.model)
    tok = gateway_tokenizer(settings, model[0])
    prompts = [tok.encode(p) if isinstance(p, str) else list(p) for p in given]
    max_tokens = body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
    topk = body.logprobs or 0
    with_lp = body.logprobs is not None
    prompt_tokens = sum(len(p) for p in prompts)
    with ExitStack() as slot:
        refs = _queue_all(services, tenant, body, model, prompts, lambda p: _sampling(body, p, max_tokens, stops, topk),
                          idempotency_key, slot)  # fmt: skip
        created, cid = int(time.time()), f"cmpl-{refs[0].request_id}"
        if body.stream:
            chunks = responses.ChunkBuilder(tok, cid, created, body.model, chat=False, with_logprobs=with_lp)
            return _streamed(services, body, refs, chunks, stops, prompt_tokens, slot)
        results = _wait_all(services, refs)
    choices = _decoded(tok, results, stops, pieces=with_lp)
    return JSONResponse(responses.completion_body(tok, cid, created, body.model, choices, with_lp, prompt_tokens))


@router.post("/v1/chat/completions", response_model=None)
def chat_completions(body: ChatCompletionRequest, tenant: TenantDep, services: ServicesDep,
                     idempotency_key: IdempotencyKey = None) -> Response:  # fmt: skip
    """OpenAI's chat completions: the messages rendered with the model's chat template (or `role: content` lines
    ending in `assistant:` where it has none: tokenizer.py), text content only."""
    _refuse(body.unsupported())
    settings = services.settings
    stops = _stops(settings, body)
    check_prompt_count(settings, 1, body.n)
    check_chat(settings, body.messages)
    model = resolve_model(services, tenant, body.model)
    tok = gateway_tokenizer(settings, model[0])
    messages = []
    for i, m in enumerate(body.messages):
        try:
            content = m.text()
        except ValidationError:
            raise NotSupportedError(f"messages[{i}].content: only text parts are supported") from None
        messages.append({"role": m.role, "content": content, **({"name": m.name} if m.name else {})})
    text, templated = tok.render_chat(messages)
    check_prompt_bytes(settings, [text])
    prompt = tok.encode(text, add_special_tokens=not templated)
    with_lp = body.logprobs
    topk = (body.top_logprobs or 0) if with_lp else 0
    with ExitStack() as slot:
        refs = _queue_all(services, tenant, body, model, [prompt],
                          lambda p: _sampling(body, p, body.new_tokens(), stops, topk), idempotency_key, slot)  # fmt: skip
        created, cid = int(time.time()), f"chatcmpl-{refs[0].request_id}"
        if body.stream:
            chunks = responses.ChunkBuilder(tok, cid, created, body.model, chat=True, with_logprobs=with_lp)
            return _streamed(services, body, refs, chunks, stops, len(prompt), slot)
        results = _wait_all(services, refs)
    choices = _decoded(tok, results, stops, pieces=with_lp)
    return JSONResponse(responses.chat_body(tok, cid, created, body.model, choices, with_lp, len(prompt)))


@router.get("/v1/models")
def models(tenant: TenantDep, services: ServicesDep) -> dict[str, Any]:
    """The served base models, then the tenant's sampler checkpoints by tinker path (an adapter id works as `model`
    too)."""
    return {"object": "list", "data": list_models(services, tenant)}
