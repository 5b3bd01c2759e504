"""The versioned request envelope: what the gateway XADDs to a pool's stream and the dispatcher reads back.

Stream entry fields: `v` (ENVELOPE_VERSION), `request_id` (duplicated outside the JSON so a consumer can still answer
a request whose body is unreadable), `data` (the envelope as JSON: request_id, tenant_id, model_id, seq_id, kind,
payload, created_at), and `tokens` (its token count by its kind's row, added by the producer: what the tenant's
queued-tokens quota gets back when the entry is acked). The same `data` is what the request log keeps
(queue/replay_log.py).

The envelope carries the kind's typed payload (loraplex/protocol), and one codec writes it: orjson serializes the
payload dataclass once (`encode_payload`); those bytes are both the idempotency fingerprint's input (queue/producer.py)
and, spliced into the envelope's JSON, the entry's `data`. Reading back, `orjson.loads` then protocol/wire.py build
the payload by its type hints: a payload that does not fit its kind fails its request as undecodable. Encoding is
strict: a non-finite float anywhere in the payload raises NonFiniteNumberError naming where it is, instead of being
written as null. create_adapter / delete_adapter carry seq_id CONTROL_SEQ_ID (-1): they sit outside the adapter's
seq_id chain (idempotent per (model_id, kind)).
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields, is_dataclass

import orjson

from loraplex.errors import InvalidRequestError
from loraplex.protocol import CONTROL_KINDS, CONTROL_SEQ_ID, Payload, PlannedRequest, RequestKind, parse_payload
from loraplex.protocol.wire import from_json
from loraplex.queue.redis_text import text

# The JSON layout of `data` is the one version 1 always had (the payload an object of its fields), so entries and
# request logs written before this codec decode as they are.
ENVELOPE_VERSION = 1
TOKENS_FIELD = "tokens"


class EnvelopeError(InvalidRequestError):
    """A stream entry that cannot be decoded (unknown version, bad JSON, missing fields)."""


class NonFiniteNumberError(InvalidRequestError):
    """An envelope holds NaN or infinity: JSON has no such number (it would be written as null and read back as a
    missing value), so the envelope is refused."""


@dataclass(frozen=True)
class Envelope:
    request_id: str
    tenant_id: str
    model_id: str
    seq_id: int
    kind: RequestKind
    payload: Payload  # the kind's payload model (protocol/kinds.py says which)
    created_at: float  # unix seconds, set by the gateway

    def __post_init__(self) -> None:
        # A payload of another kind is a bug, raised here; a mapping (its JSON form) is parsed into the kind's model.
        object.__setattr__(self, "payload", parse_payload(self.kind, self.payload))

    @classmethod
    def new(
        cls,
        *,
        tenant_id: str,
        model_id: str,
        kind: RequestKind | str,
        seq_id: int | None = None,
        payload: Payload | Mapping[str, object] | None = None,
        request_id: str | None = None,
    ) -> Envelope:
        """A fresh envelope: random request_id, now as created_at, seq_id -1 for create/delete when not given.
        `payload`: the kind's payload, or its JSON form (a ValueError naming the field when it does not fit)."""
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
            payload=parse_payload(kind, payload),
            created_at=time.time(),
        )


def encode_payload(payload: Payload) -> bytes:
    """The payload's JSON bytes (keys of its mappings sorted, so equal payloads give equal bytes); NonFiniteNumberError
    when a float in it is NaN or infinite, InvalidRequestError when a value has no JSON form."""
    for where, value in _non_finite(payload, "envelope.payload"):
        raise NonFiniteNumberError(f"{where} is {value!r}: JSON has no NaN or infinity; send a finite number")
    try:
        return orjson.dumps(payload, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError as exc:
        raise InvalidRequestError(f"envelope.payload: {exc}") from None


def encode(env: Envelope, payload: bytes | None = None) -> dict[str, str | bytes]:
    """Stream entry fields for `env`; `payload`: its `encode_payload` bytes when the caller has them already."""
    body = encode_payload(env.payload) if payload is None else payload
    head = orjson.dumps(
        {"request_id": env.request_id, "tenant_id": env.tenant_id, "model_id": env.model_id, "seq_id": env.seq_id,
         "kind": env.kind, "created_at": env.created_at}  # fmt: skip
    )
    data = b"".join((head[:-1], b',"payload":', body, b"}"))  # the payload's bytes spliced in, never written twice
    return {"v": str(ENVELOPE_VERSION), "request_id": env.request_id, "data": data}


def _non_finite(value: object, where: str) -> Iterator[tuple[str, float]]:
    """(path, value) of every non-finite float in a payload (dataclasses, mappings, lists, scalars)."""
    if isinstance(value, float):
        if not math.isfinite(value):
            yield where, value
    elif isinstance(value, list | tuple):
        try:  # a list of numbers (tokens, weights): one C-speed sum is finite when every item is
            if math.isfinite(sum(value)):
                return
        except TypeError:
            pass  # not all numbers: look item by item
        for i, item in enumerate(value):
            yield from _non_finite(item, f"{where}[{i}]")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _non_finite(item, f"{where}.{key}")
    elif is_dataclass(value):
        for f in fields(value):
            yield from _non_finite(getattr(value, f.name), f"{where}.{f.name}")


def request_id_of(fields: Mapping[bytes | str, bytes | str]) -> str | None:
    """The request_id of an entry, if one can be read at all (used to fail undecodable entries)."""
    for key, value in fields.items():
        if text(key) == "request_id":
            return text(value) or None
    return None


def decode(fields: Mapping[bytes | str, bytes | str]) -> Envelope:
    """Rebuild an envelope from stream entry fields (bytes or str, whatever the client's decode_responses)."""
    version = data = None
    for key, value in fields.items():
        name = text(key)
        if name == "v":
            version = text(value)
        elif name == "data":
            data = value
    if version != str(ENVELOPE_VERSION):
        raise EnvelopeError(f"unsupported envelope version {version!r}; this build reads version {ENVELOPE_VERSION}")
    if data is None:
        raise EnvelopeError("envelope has no 'data' field")
    return decode_data(data)


def decode_data(data: bytes | str) -> Envelope:
    """An envelope from its `data` JSON (a stream entry's, or a request log member's); EnvelopeError when it does not
    fit (bad JSON, a missing or unknown field, a payload of the wrong shape for its kind)."""
    try:
        raw = orjson.loads(data)
        if not isinstance(raw, dict):
            raise ValueError(f"expected an object, got {type(raw).__name__}")
        kind = RequestKind(raw.get("kind", ""))
        payload = parse_payload(kind, raw.get("payload"))
        return from_json(Envelope, {**raw, "kind": kind, "payload": payload})
    except (ValueError, TypeError) as exc:  # orjson.JSONDecodeError is a ValueError
        raise EnvelopeError(f"malformed envelope: {exc}") from None


def to_planned(env: Envelope) -> PlannedRequest:
    return PlannedRequest(
        request_id=env.request_id,
        tenant_id=env.tenant_id,
        model_id=env.model_id,
        seq_id=env.seq_id,
        kind=env.kind,
        payload=env.payload,
    )
