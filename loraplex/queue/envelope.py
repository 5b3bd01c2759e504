"""The versioned request envelope: what the gateway XADDs to a pool's stream and the dispatcher reads back.

Stream entry fields (all strings): `v` (ENVELOPE_VERSION), `request_id` (duplicated outside the JSON so a consumer can
still answer a request whose body is unreadable), `data` (the envelope as JSON).

Payload fields per kind (the gateway validates them; the engine reads them):
- create_adapter: {base_model: str, rank: int, alpha: float, seed: int, target_modules: [str]}.
  seq_id is CONTROL_SEQ_ID (-1): create/delete sit outside the adapter's seq_id chain (idempotent per (model_id, kind)).
- delete_adapter: {}  (seq_id -1, as above)
- forward_backward, forward: {data: [{model_input: [int], loss_fn_inputs: {target_tokens: [int], weights: [float], ...}}],
  loss_fn: str, loss_fn_config: dict}. loss_fn_inputs may also carry logprobs, advantages, clip thresholds (per loss).
- optim_step: {adam_params: {learning_rate, beta1, beta2, eps, weight_decay, grad_clip_norm}}.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from loraplex.dispatch.plan import PlannedRequest, RequestKind
from loraplex.errors import InvalidRequestError
from loraplex.queue.keys import CONTROL_KINDS, CONTROL_SEQ_ID

ENVELOPE_VERSION = 1


class EnvelopeError(InvalidRequestError):
    """A stream entry that cannot be decoded (unknown version, bad JSON, missing fields)."""


class Envelope(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    request_id: str
    tenant_id: str
    model_id: str
    seq_id: int
    kind: RequestKind
    payload: dict[str, Any] = Field(default_factory=dict)
    created_at: float  # unix seconds, set by the gateway

    @classmethod
    def new(
        cls,
        *,
        tenant_id: str,
        model_id: str,
        kind: RequestKind | str,
        seq_id: int | None = None,
        payload: Mapping[str, Any] | None = None,
        request_id: str | None = None,
    ) -> Envelope:
        """A fresh envelope: random request_id, now as created_at, seq_id -1 for create/delete when not given."""
        kind = RequestKind(kind)
        if seq_id is None:
            if kind not in CONTROL_KINDS:
                raise InvalidRequestError(f"{kind} needs a seq_id")
            seq_id = CONTROL_SEQ_ID
        return cls(
            request_id=request_id or uuid.uuid4().hex,
            tenant_id=tenant_id,
            model_id=model_id,
            seq_id=seq_id,
            kind=kind,
            payload=dict(payload or {}),
            created_at=time.time(),
        )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def encode(env: Envelope) -> dict[str, str]:
    """Stream entry fields for `env`."""
    return {"v": str(ENVELOPE_VERSION), "request_id": env.request_id, "data": env.model_dump_json()}


def request_id_of(fields: Mapping[bytes | str, bytes | str]) -> str | None:
    """The request_id of an entry, if one can be read at all (used to fail undecodable entries)."""
    for key, value in fields.items():
        if _text(key) == "request_id":
            return _text(value) or None
    return None


def decode(fields: Mapping[bytes | str, bytes | str]) -> Envelope:
    """Rebuild an envelope from stream entry fields (bytes or str, whatever the client's decode_responses)."""
    text = {_text(k): _text(v) for k, v in fields.items()}
    version = text.get("v")
    if version != str(ENVELOPE_VERSION):
        raise EnvelopeError(f"unsupported envelope version {version!r}; this build reads version {ENVELOPE_VERSION}")
    if "data" not in text:
        raise EnvelopeError("envelope has no 'data' field")
    try:
        return Envelope.model_validate_json(text["data"])  # pydantic's own parser: half json.loads' time, one pass
    except (ValueError, ValidationError) as exc:
        raise EnvelopeError(f"malformed envelope: {exc}") from exc


def to_planned(env: Envelope) -> PlannedRequest:
    return PlannedRequest(
        request_id=env.request_id,
        tenant_id=env.tenant_id,
        model_id=env.model_id,
        seq_id=env.seq_id,
        kind=env.kind,
        payload=dict(env.payload),
    )
