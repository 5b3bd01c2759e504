"""Samplers and sampling: a sampler (a sampling session) names what its requests sample from, one of the tenant's
sampler checkpoints (`tinker://<model_id>/sampler_weights/<name>`) or the bare base model; a sample is a request of
kind `sample` queued under (sampler id, seq_id), the idempotency key, outside every adapter's seq_id chain.

The pool samples from the sampler copy (the frozen weights) a named save_weights_for_sampler left in its memory (workers/state/adapter_store.py:
freeze_copy), or loads it from the checkpoint's folder when it has none (a restarted pool): the payload carries both."""

from __future__ import annotations

from collections.abc import Sequence

from loraplex.errors import InvalidRequestError, RequestTooLargeError
from loraplex.protocol import RequestKind, SamplePayload
from loraplex.protocol.checkpoint_paths import CheckpointKind, parse_tinker_path
from loraplex.queue.pool_registry import can_sample
from loraplex.service.adapters import served_model
from loraplex.service.checkpoints import checkpoint_dir, resolve_checkpoint
from loraplex.service.context import Services, TenantRef, fleet, write_session
from loraplex.service.fleet import ServedModel
from loraplex.service.placement import PoolLoad, choose_pool
from loraplex.service.schemas import CreateSamplerRequest, FutureRef, SampleRequest, SamplerOut
from loraplex.service.submit import submit
from loraplex.settings import Settings
from loraplex.storage.models import SamplingSession
from loraplex.storage.repositories import AdapterRepository, SamplerRepository, SessionRepository


def sampleable(services: Services, model: ServedModel) -> bool:
    """Whether a pool of this served base model samples (queue/pool_registry.can_sample): as each live pool registered
    it; the gateway's own pool standing in unregistered: by this gateway's sampler setting and the world size the
    pool's heartbeat last reported (settings.world_size before its first beat)."""
    if model.sampleable_live:
        return True
    if not model.stand_in:
        return False
    settings = services.settings
    world = services.pool_view.get(settings, services.sessions).world_size
    return can_sample(settings.sampler, world if world is not None else settings.world_size)


def check_stops(settings: Settings, stops: Sequence[str | int]) -> None:
    """Every sampling route's rule for stop sequences (strings or token ids; an id counts as one): how many
    (LORAPLEX_MAX_STOP_SEQUENCES), how long each string (LORAPLEX_MAX_STOP_CHARS), none empty, ids in range. The
    sampler matches each against every new token of every row, so their count and length are work."""
    if len(stops) > settings.max_stop_sequences:
        raise RequestTooLargeError(
            f"stop: {len(stops)} sequences; at most {settings.max_stop_sequences} (LORAPLEX_MAX_STOP_SEQUENCES)"
        )
    for i, stop in enumerate(stops):
        if isinstance(stop, str):
            if not stop:
                raise InvalidRequestError(f"stop[{i}]: an empty string")
            if len(stop) > settings.max_stop_chars:
                raise RequestTooLargeError(
                    f"stop[{i}]: {len(stop)} characters; at most {settings.max_stop_chars} (LORAPLEX_MAX_STOP_CHARS)"
                )
        elif isinstance(stop, int) and not 0 <= stop < 2**31:
            raise InvalidRequestError(f"stop[{i}]: token id {stop} is out of range")


def sample_work(num_samples: int, prompt_tokens: int, max_tokens: int) -> int:
    """What a sample request asks of the sampler, in tokens: every row attends over its prompt and decodes up to
    max_tokens."""
    return num_samples * (prompt_tokens + max_tokens)


def check_sample_work(settings: Settings, work: int, what: str) -> None:
    """A request's sample work within LORAPLEX_MAX_SAMPLE_TOKENS_PER_REQUEST (413)."""
    if work > settings.max_sample_tokens_per_request:
        raise RequestTooLargeError(
            f"{what} = {work} tokens of sampling; at most {settings.max_sample_tokens_per_request} per request "
            "(LORAPLEX_MAX_SAMPLE_TOKENS_PER_REQUEST): fewer samples or max_tokens, or several requests"
        )


def sampler_out(row: SamplingSession) -> SamplerOut:
    return SamplerOut(sampler_id=row.id, base_model=row.base_model, model_path=row.model_path)


def create_sampler(
    services: Services,
    tenant: TenantRef,
    request: CreateSamplerRequest,
    *,
    session_id: str | None = None,
    sampling_session_seq_id: int | None = None,
    saved_by: str | None = None,
) -> SamplerOut:
    """A sampler over one of the tenant's sampler checkpoints (404 for a missing or foreign one; 400 for a state
    checkpoint: sample from save_weights_for_sampler's) or the base model. In a client session (Tinker) the same
    (session, sampling_session_seq_id) again answers the first sampler (the SDK retries). `saved_by`: the queued
    save that writes the checkpoint (the unnamed save_weights_for_sampler): it need not exist yet."""
    base_model = served_model(services, request.base_model or None).name  # 400 naming the served models
    with write_session(services) as db:
        samplers = SamplerRepository(db, tenant.id)
        if session_id is not None:
            SessionRepository(db, tenant.id).get_active(session_id)
            if sampling_session_seq_id is not None:
                found = samplers.find_by_seq(session_id, sampling_session_seq_id)
                if found is not None:
                    return sampler_out(found)
        if request.model_path is not None:
            parsed = parse_tinker_path(request.model_path)
            if parsed.kind != CheckpointKind.SAMPLER:
                raise InvalidRequestError(
                    f"{request.model_path} is a training state; sample from a sampler checkpoint "
                    "(save_weights_for_sampler's tinker://<model_id>/sampler_weights/<name>)"
                )
            if saved_by is None:
                resolve_checkpoint(db, tenant.id, request.model_path, with_optimizer=False)  # 404: missing or foreign
        row = samplers.create(base_model, request.model_path, session_id, sampling_session_seq_id)
        return sampler_out(row)


def get_sampler(services: Services, tenant: TenantRef, sampler_id: str) -> SamplerOut:
    with services.sessions() as db:
        return sampler_out(SamplerRepository(db, tenant.id).get(sampler_id))


def sample(
    services: Services, tenant: TenantRef, sampler_id: str, request: SampleRequest, stream_partials: bool = False
) -> FutureRef:
    """Queue `num_samples` continuations of the prompt; the future's result holds the sequences (tokens, logprobs,
    stop_reason) and, when asked, the prompt's logprobs. stream_partials: the pool also publishes the tokens sampled
    so far while it samples (queue/sample_partials.py; the OpenAI routes' `stream: true`)."""
    settings = services.settings
    if len(request.prompt) > settings.max_tokens_per_datum:
        raise InvalidRequestError(f"the prompt has {len(request.prompt)} tokens; at most {settings.max_tokens_per_datum} "
                                  "(LORAPLEX_MAX_TOKENS_PER_DATUM)")
    if request.num_samples > settings.max_samples_per_request:
        raise InvalidRequestError(f"num_samples {request.num_samples}; at most {settings.max_samples_per_request} "
                                  "(LORAPLEX_MAX_SAMPLES_PER_REQUEST)")
    if request.max_tokens > settings.max_sample_tokens:
        raise InvalidRequestError(f"max_tokens {request.max_tokens}; at most {settings.max_sample_tokens} "
                                  "(LORAPLEX_MAX_SAMPLE_TOKENS)")
    if any(t < 0 for t in request.prompt):
        raise InvalidRequestError("the prompt holds a negative token id")
    if any(t >= 2**31 for t in request.prompt):  # no vocabulary is this big; past 2**64 the envelope's JSON fails
        raise InvalidRequestError("the prompt holds a token id of 2**31 or more")
    stop = request.stop
    stops: list[str | int] = [stop] if isinstance(stop, str) else list(stop or [])
    check_stops(settings, stops)
    n, prompt, new = request.num_samples, len(request.prompt), request.max_tokens
    check_sample_work(settings, sample_work(n, prompt, new), f"{n} samples x ({prompt} prompt + {new} new) tokens")
    with services.sessions() as db:
        sampler = SamplerRepository(db, tenant.id).get(sampler_id)
        directory = None
        if sampler.model_path is not None:
            checkpoint = resolve_checkpoint(db, tenant.id, sampler.model_path, with_optimizer=False)
            directory = str(checkpoint_dir(services, checkpoint))
            # The adapter's pool holds its sampler copies (a save is answered before its files are written).
            pool = AdapterRepository(db, tenant.id).get(checkpoint.model_id, include_deleted=True).pool
        else:
            pool = base_model_pool(services, sampler.base_model)
    payload = SamplePayload(
        prompt=tuple(request.prompt),
        sampler_copy=sampler.model_path,
        sampler_copy_dir=directory,
        num_samples=request.num_samples,
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_k=request.top_k,
        top_p=request.top_p,
        seed=request.seed,
        stop_token_ids=tuple(s for s in stops if isinstance(s, int)),
        stop_strings=tuple(s for s in stops if isinstance(s, str)),
        stop_at_eos=stop is None or bool(stops),  # Tinker: `stop=[]` samples through EOS
        prompt_logprobs=request.prompt_logprobs,
        topk_prompt_logprobs=request.topk_prompt_logprobs,
        topk_sample_logprobs=request.topk_sample_logprobs,
        stream_partials=stream_partials,
    )
    return submit(services, tenant, sampler_id, RequestKind.SAMPLE, payload, seq_id=request.seq_id, pool=pool)


def base_model_pool(services: Services, base_model: str) -> str:
    """The pool that samples the bare base model for one request: the placement rule over its served pools, no
    adapter counted (a base-model sample holds no adapter): most slots, then fewest queued tokens, then the name."""
    pools = fleet(services).model(base_model).pools
    return choose_pool([PoolLoad(p.name, p.slots, 0, p.queued_tokens) for p in pools])
