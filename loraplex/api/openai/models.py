"""What an OpenAI request's `model` names, the sampler it is sampled through, and the seq_ids its samples take.

`model` is one of (else 404 "model_not_found", the same answer for another tenant's as for a made-up one):
- a served base model's name (any pool of the fleet's: service/fleet.py): that bare base model;
- `tinker://<model_id>/sampler_weights/<name>`: that frozen sampler checkpoint of the tenant's;
- one of the tenant's adapter ids: its newest sampler checkpoint at the time of the request (a 400 saying to save
  sampler weights first while it has none). The adapter's live, still-training weights are never sampled: only what
  a save_weights_for_sampler froze.

Each (tenant, model path or base model name) gets one sampler (service.create_sampler), kept in a Redis hash with its seq_id counter
(`keys.openai_sampler`, 24 h from its last use), so every gateway replica shares it: a request takes consecutive
seq_ids with one HINCRBY (two concurrent requests never collide), and (sampler, seq_id) is the queue's idempotency
key. An `Idempotency-Key` header makes a retry (the same key, model and body, within 24 h) take the seq_ids the first
attempt took: it answers the first request's samples instead of queueing new ones (another body under the key: 409)."""

from __future__ import annotations

import hashlib
from datetime import datetime
from typing import Any

from loraplex import service
from loraplex.errors import ConflictError, InvalidRequestError, NotFoundError
from loraplex.protocol.checkpoint_paths import parse_tinker_path
from loraplex.queue import keys
from loraplex.queue.redis_text import text
from loraplex.service.context import Services, TenantRef, fleet
from loraplex.service.schemas import CreateSamplerRequest

SAMPLER_TTL_S = 24 * 3600
SEQ_LIMIT = 2**31  # SampleRequest.seq_id < 2**31: a counter that reaches it starts a fresh sampler

# KEYS[1] the sampler hash, KEYS[2] (optional) the Idempotency-Key's; ARGV: ttl, count, sampler id to install or "",
# seq limit. Answers {sampler_id, first seq_id, count}, or nil when the hash has no sampler (create one, call again).
_TAKE = """
local ttl, count = tonumber(ARGV[1]), tonumber(ARGV[2])
if #KEYS == 2 then
  local taken = redis.call('GET', KEYS[2])
  if taken then return {'idem', taken} end
end
local id = redis.call('HGET', KEYS[1], 'sampler_id')
if not id then
  if ARGV[3] == '' then return false end
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], 'sampler_id', ARGV[3])
  id = ARGV[3]
end
local last = redis.call('HINCRBY', KEYS[1], 'seq', count)
if last >= tonumber(ARGV[4]) then
  redis.call('DEL', KEYS[1])
  return false
end
redis.call('EXPIRE', KEYS[1], ttl)
local first = last - count + 1
if #KEYS == 2 then redis.call('SET', KEYS[2], id .. ' ' .. first .. ' ' .. count, 'EX', ttl) end
return {id, tostring(first), tostring(count)}
"""


def not_found(model: str) -> NotFoundError:
    return NotFoundError(f"The model {model!r} does not exist or you do not have access to it.")


def resolve_model(services: Services, tenant: TenantRef, model: str) -> tuple[str, str | None]:
    """(the base model, the sampler checkpoint `model` names: a tinker path, or None for the bare base model)."""
    if model in fleet(services).models:
        return model, None
    if model.startswith("tinker://"):
        try:
            model_id = parse_tinker_path(model).model_id
            return service.get_run(services, tenant, model_id).base_model, model
        except (InvalidRequestError, NotFoundError):
            raise not_found(model) from None
    try:
        run = service.get_run(services, tenant, model)
    except NotFoundError:
        raise not_found(model) from None
    if run.last_sampler_checkpoint is None:
        raise InvalidRequestError(
            f"adapter {model!r} has no sampler weights yet: save them first (save_weights_for_sampler), then name the "
            "adapter (its newest sampler weights are sampled) or their tinker:// path as the model"
        )
    return run.base_model, run.last_sampler_checkpoint.tinker_path


def take_seq_ids(
    services: Services, tenant: TenantRef, model: str, base_model: str, model_path: str | None, count: int,
    idempotency_key: str | None = None,
) -> tuple[str, int]:  # fmt: skip
    """(sampler_id, the first of `count` consecutive seq_ids) for sampling `model_path` (None: the bare base model)."""
    script = services.redis.register_script(_TAKE)
    script_keys = [keys.openai_sampler(tenant.id, model_path or base_model)]
    if idempotency_key is not None:
        digest = hashlib.sha256(f"{model}\0{idempotency_key}".encode()).hexdigest()
        script_keys.append(keys.openai_idempotency(tenant.id, digest))
    new_id = ""
    for _ in range(3):
        answer = script(keys=script_keys, args=[SAMPLER_TTL_S, count, new_id, SEQ_LIMIT])
        if answer is None:
            new_id = _create_sampler(services, tenant, model, base_model, model_path)
            continue
        first, second = text(answer[0]), text(answer[1])
        if first == "idem":
            sampler_id, seq, taken = second.split(" ")
            if int(taken) != count:
                raise ConflictError(f"Idempotency-Key {idempotency_key!r} was used for a request with {taken} prompts")
            return sampler_id, int(seq)
        return first, int(second)
    raise InvalidRequestError(f"could not take {count} seq_ids for {model!r}")  # only for count >= SEQ_LIMIT


def _create_sampler(services: Services, tenant: TenantRef, model: str, base_model: str, model_path: str | None) -> str:
    request = CreateSamplerRequest(model_path=model_path, base_model=base_model)
    try:
        return service.create_sampler(services, tenant, request).sampler_id
    except NotFoundError:
        raise not_found(model) from None


def list_models(services: Services, tenant: TenantRef) -> list[dict[str, Any]]:
    """OpenAI's model objects: the served base models, then the tenant's sampler checkpoints (newest first) by tinker
    path, each with its base model as `root`."""
    models: list[dict[str, Any]] = [
        {"id": base, "object": "model", "created": 0, "owned_by": "loraplex"} for base in fleet(services).names
    ]
    roots: dict[str, str] = {}
    offset = 0
    while True:
        page = service.list_all_checkpoints(services, tenant, 1000, offset)
        for c in page.checkpoints:
            if c.checkpoint_type == "sampler":
                created = int(c.time.timestamp()) if isinstance(c.time, datetime) else 0
                if c.model_id not in roots:
                    roots[c.model_id] = service.get_run(services, tenant, c.model_id).base_model
                models.append({"id": c.tinker_path, "object": "model", "created": created, "owned_by": tenant.name,
                               "root": roots[c.model_id], "parent": c.model_id})  # fmt: skip
        offset += len(page.checkpoints)
        if not page.checkpoints or offset >= page.cursor.total_count:
            return models
