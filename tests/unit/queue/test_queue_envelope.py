"""Envelope codec: round trip through stream fields (the typed payload written once, by orjson), version and shape
rejection, entries written before this codec, PlannedRequest conversion, the fingerprint's input."""

from __future__ import annotations

import json
import pickle

import pytest

from loraplex.errors import InvalidRequestError
from loraplex.protocol import ForwardBackwardPayload, PlannedRequest, RejectedPayload, RequestKind
from loraplex.queue import keys
from loraplex.queue.envelope import (
    ENVELOPE_VERSION,
    Envelope,
    EnvelopeError,
    NonFiniteNumberError,
    decode,
    decode_data,
    encode,
    encode_payload,
    request_id_of,
    to_planned,
)
from loraplex.queue.producer import fingerprint

FB_PAYLOAD = {
    "data": [{"model_input": [1, 2, 3], "loss_fn_inputs": {"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 0.5]}}],
    "loss_fn": "cross_entropy",
    "loss_fn_config": {},
}


def _fb() -> Envelope:
    return Envelope.new(tenant_id="t1", model_id="m1", seq_id=7, kind="forward_backward", payload=FB_PAYLOAD)


def _bytes(fields: dict[str, str | bytes]) -> dict[bytes, bytes]:
    return {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in fields.items()}


def test_round_trip_str_and_bytes_fields() -> None:
    env = _fb()
    assert isinstance(env.payload, ForwardBackwardPayload)  # the envelope carries the typed payload
    fields = encode(env)
    assert fields["v"] == str(ENVELOPE_VERSION) and fields["request_id"] == env.request_id
    assert decode(fields) == env
    # A client without decode_responses hands back bytes; one with it, text.
    assert decode(_bytes(fields)) == env
    assert decode({k: v.decode() if isinstance(v, bytes) else v for k, v in fields.items()}) == env


def test_the_payload_bytes_are_spliced_into_the_entry_and_are_the_fingerprints_input() -> None:
    env = _fb()
    body = encode_payload(env.payload)
    data = encode(env, body)["data"]
    assert isinstance(data, bytes) and b'"payload":' + body + b"}" in data
    assert json.loads(data)["payload"] == json.loads(body)
    assert fingerprint(env, body) == fingerprint(env)
    # A retry (same kind and payload, another id and time) has the same fingerprint; another body or kind does not.
    retry = Envelope.new(tenant_id="t1", model_id="m1", seq_id=7, kind="forward_backward", payload=FB_PAYLOAD)
    assert fingerprint(retry) == fingerprint(env)
    other = {**FB_PAYLOAD, "loss_fn": "ppo"}
    assert fingerprint(Envelope.new(tenant_id="t1", model_id="m1", seq_id=7, kind="forward_backward",
                                    payload=other)) != fingerprint(env)  # fmt: skip
    assert fingerprint(Envelope.new(tenant_id="t1", model_id="m1", seq_id=7, kind="forward",
                                    payload=FB_PAYLOAD)) != fingerprint(env)  # fmt: skip


def test_an_entry_of_the_json_layout_written_before_this_codec_still_decodes() -> None:
    """Version 1's layout is unchanged (pydantic wrote it before): entries still in a stream, and request logs kept
    across an upgrade, read back as they were written."""
    old = (
        '{"request_id":"r1","tenant_id":"t1","model_id":"m1","seq_id":7,"kind":"create_adapter",'
        '"payload":{"base_model":"tiny","rank":4,"alpha":8.0,"seed":3,"target_modules":["q_proj"]},'
        '"created_at":1700000000.5}'
    )
    env = decode({"v": "1", "request_id": "r1", "data": old})
    assert env.kind == RequestKind.CREATE_ADAPTER and env.payload.rank == 4  # type: ignore[attr-defined]
    assert env.payload.target_modules == ("q_proj",)  # type: ignore[attr-defined]
    assert decode_data(old) == env


def test_unknown_version_is_rejected_clearly() -> None:
    fields = encode(_fb()) | {"v": "2"}
    with pytest.raises(EnvelopeError, match="unsupported envelope version '2'"):
        decode(fields)
    with pytest.raises(EnvelopeError, match="version None"):
        decode({k: v for k, v in encode(_fb()).items() if k != "v"})


_GOOD = json.loads(encode(_fb())["data"])


@pytest.mark.parametrize(
    "data",
    [
        "not json",
        "[1, 2]",
        json.dumps({"request_id": "r"}),
        json.dumps({**_GOOD, "kind": "train"}),
        json.dumps({**_GOOD, "seq_id": "7"}),
        json.dumps({**_GOOD, "extra": 1}),
        json.dumps({**_GOOD, "payload": {**_GOOD["payload"], "data": [{"model_input": [1, "2"]}]}}),
    ],
)
def test_malformed_bodies_are_rejected(data: str) -> None:
    fields = encode(_fb()) | {"data": data}
    with pytest.raises(EnvelopeError) as info:
        decode(fields)
    assert isinstance(info.value, InvalidRequestError)  # maps to a user error; the request_id is still readable
    assert request_id_of(fields) == fields["request_id"]
    assert pickle.loads(pickle.dumps(info.value)).message == info.value.message


def test_to_planned_keeps_every_field() -> None:
    env = _fb()
    planned = to_planned(env)
    assert planned == PlannedRequest(env.request_id, "t1", "m1", 7, RequestKind.FORWARD_BACKWARD, FB_PAYLOAD)
    assert planned.num_tokens == 3


def test_control_requests_default_to_control_seq_and_own_idempotency_key() -> None:
    create = Envelope.new(tenant_id="t", model_id="m", kind=RequestKind.CREATE_ADAPTER, payload={"rank": 8})
    assert create.seq_id == keys.CONTROL_SEQ_ID
    assert keys.request_idempotency_key(create.kind, "m", create.seq_id) == "loraplex:idem:m:create_adapter"
    assert keys.request_idempotency_key("optim_step", "m", 3) == "loraplex:idem:m:3"
    with pytest.raises(InvalidRequestError, match="needs a seq_id"):
        Envelope.new(tenant_id="t", model_id="m", kind="optim_step")


def test_every_key_is_prefixed() -> None:
    names = [
        keys.request_stream("p", "t"),
        keys.pool_tenants("p"),
        keys.pool_doorbell("p"),
        keys.queued_tokens("p"),
        keys.CONSUMER_GROUP,
        keys.result_key("r"),
        keys.notify_key("r"),
        keys.state_key("r"),
        keys.idempotency_key("m", 1),
    ]
    assert all(n.startswith("loraplex:") for n in names)
    assert len(set(names)) == len(names)
    assert [s.value for s in keys.JobState] == ["queued", "running", "complete", "failed"]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_float_anywhere_is_refused_not_written_as_null(bad: float) -> None:
    """orjson and pydantic write NaN as null, which reads back as a missing value (learning_rate=inf once ran with the
    default): the envelope refuses it, naming where it is."""
    payload = {**FB_PAYLOAD, "data": [{**FB_PAYLOAD["data"][0], "loss_fn_inputs": {"weights": [1.0, bad]}}]}
    env = Envelope.new(tenant_id="t1", model_id="m1", seq_id=7, kind="forward_backward", payload=payload)
    with pytest.raises(NonFiniteNumberError, match=r"envelope\.payload\.data\[0\]\.loss_fn_inputs\.weights\[1\]"):
        encode(env)
    assert issubclass(NonFiniteNumberError, InvalidRequestError)
    nested = Envelope.new(tenant_id="t1", model_id="m1", seq_id=1, kind="optim_step",
                          payload={"adam_params": {"learning_rate": bad}})  # fmt: skip
    with pytest.raises(NonFiniteNumberError, match="adam_params.learning_rate"):
        encode(nested)


def test_nan_inside_a_string_is_fine() -> None:
    payload = RejectedPayload("optim_step", message="NaN and Infinity are words here")
    env = Envelope.new(tenant_id="t1", model_id="m1", seq_id=1, kind="rejected", payload=payload)
    fields = encode(env)
    assert json.loads(fields["data"])["payload"]["message"] == "NaN and Infinity are words here"
    assert decode(fields).payload == payload


def test_a_payload_of_another_kind_or_shape_is_refused_when_the_envelope_is_built() -> None:
    with pytest.raises(ValueError, match="takes a"):
        Envelope.new(tenant_id="t", model_id="m", seq_id=1, kind="optim_step", payload=RejectedPayload())
    with pytest.raises(ValueError, match=r"data\[0\]\.model_input: expected list\[int\], got str"):
        Envelope.new(tenant_id="t", model_id="m", seq_id=1, kind="forward", payload={"data": [{"model_input": "x"}]})


def test_an_integer_json_cannot_hold_is_a_user_error() -> None:
    env = Envelope.new(tenant_id="t", model_id="m", seq_id=1, kind="optim_step", payload={"adam_params": {"x": 1 << 70}})
    with pytest.raises(InvalidRequestError, match="envelope.payload"):
        encode(env)
