"""The versioned request envelope: what the gateway XADDs to a pool's stream and the dispatcher reads back.

Stream entry fields (all strings): `v` (ENVELOPE_VERSION), `request_id` (duplicated outside the JSON so a consumer can
still answer a request whose body is unreadable), `data` (the envelope as JSON), and `tokens` (its token count, added
by the producer: what the tenant's queued-tokens quota gets back when the entry is acked).

`payload` is the wire form (JSON) of the kind's payload model, declared once in loraplex/protocol (kinds.py says
which model each kind takes); decoding checks it against that model, so a payload that does not fit fails its request
as undecodable. Encoding is strict JSON: a non-finite float anywhere (payload included) raises NonFiniteNumberError
naming where it is, instead of being written as null. create_adapter / delete_adapter carry seq_id CONTROL_SEQ_ID (-1): they sit outside the adapter's seq_id
chain (idempotent per (model_id, kind)).
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterator, Mapping
from functools import cached_property
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from loraplex.errors import InvalidRequestError
from loraplex.protocol import CONTROL_KINDS, CONTROL_SEQ_ID, Payload, PlannedRequest, RequestKind, parse_payload
from loraplex.queue.redis_text import text

ENVELOPE_VERSION = 1
TOKENS_FIELD = "tokens"


class EnvelopeError(InvalidRequestError):
    """A stream entry that cannot be decoded (unknown version, bad JSON, missing fields)."""


class NonFiniteNumberError(InvalidRequestError):
    """An envelope holds NaN or infinity: JSON has no such number (it would be written as null and read back as a
    missing value), so the envelope is refused."""


class Envelope(BaseModel):
    # "constants": non-finite floats come out as NaN / Infinity (not null), so `encode` can see them cheaply.
    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_inf_nan="constants")

    request_id: str
    tenant_id: str
    model_id: str
    seq_id: int
    kind: RequestKind
    payload: dict[str, Any] = Field(default_factory=dict)  # the wire form of the kind's payload model
    created_at: float  # unix seconds, set by the gateway

    @cached_property
    def body(self) -> Payload:
        """The payload as its kind's model (protocol/payloads.py); a ValueError when it does not fit."""
        return parse_payload(self.kind, self.payload)

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


def encode(env: Envelope) -> dict[str, str]:
    """Stream entry fields for `env`; NonFiniteNumberError when a float in it is NaN or infinite."""
    data = env.model_dump_json()
    # Fast path: no non-finite float can hide in output without these tokens (a payload is mostly token ids). When one
    # appears (maybe only inside a string), walk the values to find a real NaN / infinity and name its place.
    if "NaN" in data or "Infinity" in data:
        for where, value in _non_finite(env.model_dump(), "envelope"):
            raise NonFiniteNumberError(f"{where} is {value!r}: JSON has no NaN or infinity; send a finite number")
    return {"v": str(ENVELOPE_VERSION), "request_id": env.request_id, "data": data}


def _non_finite(value: object, where: str) -> Iterator[tuple[str, float]]:
    """(path, value) of every non-finite float in a JSON-like value."""
    if isinstance(value, float):
        if not math.isfinite(value):
            yield where, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _non_finite(item, f"{where}.{key}")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _non_finite(item, f"{where}[{i}]")


def token_count(env: Envelope) -> int:
    """Input tokens of a forward_backward / forward request, and a sample's prompt plus the most it can add (0 for
    other kinds), read from its wire payload."""
    if env.kind == RequestKind.SAMPLE:
        prompt, n, most = env.payload.get("prompt"), env.payload.get("num_samples", 1), env.payload.get("max_tokens", 0)
        ok = isinstance(prompt, list | tuple) and type(n) is int and type(most) is int
        return len(prompt) + max(n, 0) * max(most, 0) if ok else 0  # type: ignore[arg-type]
    data = env.payload.get("data") if env.kind in (RequestKind.FORWARD_BACKWARD, RequestKind.FORWARD) else None
    return sum(len(d.get("model_input", ())) for d in data) if isinstance(data, list | tuple) else 0


def request_id_of(fields: Mapping[bytes | str, bytes | str]) -> str | None:
    """The request_id of an entry, if one can be read at all (used to fail undecodable entries)."""
    for key, value in fields.items():
        if text(key) == "request_id":
            return text(value) or None
    return None


def decode(fields: Mapping[bytes | str, bytes | str]) -> Envelope:
    """Rebuild an envelope from stream entry fields (bytes or str, whatever the client's decode_responses)."""
    decoded = {text(k): text(v) for k, v in fields.items()}
    version = decoded.get("v")
    if version != str(ENVELOPE_VERSION):
        raise EnvelopeError(f"unsupported envelope version {version!r}; this build reads version {ENVELOPE_VERSION}")
    if "data" not in decoded:
        raise EnvelopeError("envelope has no 'data' field")
    try:
        env = Envelope.model_validate_json(decoded["data"])  # pydantic's own parser: half json.loads' time, one pass
        env.body  # noqa: B018 - parsed (and cached) here, so a payload that does not fit its kind fails as undecodable
    except (ValueError, ValidationError) as exc:
        raise EnvelopeError(f"malformed envelope: {exc}") from exc
    return env


def to_planned(env: Envelope) -> PlannedRequest:
    return PlannedRequest(
        request_id=env.request_id,
        tenant_id=env.tenant_id,
        model_id=env.model_id,
        seq_id=env.seq_id,
        kind=env.kind,
        payload=env.body,
    )
