"""Envelope codec: round trip through stream fields, version and shape rejection, PlannedRequest conversion."""

from __future__ import annotations

import json
import pickle

import pytest

from loraplex.errors import InvalidRequestError
from loraplex.protocol import PlannedRequest, RequestKind
from loraplex.queue import keys
from loraplex.queue.envelope import (
    ENVELOPE_VERSION,
    Envelope,
    EnvelopeError,
    NonFiniteNumberError,
    decode,
    encode,
    request_id_of,
    to_planned,
)

FB_PAYLOAD = {
    "data": [{"model_input": [1, 2, 3], "loss_fn_inputs": {"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 0.5]}}],
    "loss_fn": "cross_entropy",
    "loss_fn_config": {},
}


def _fb() -> Envelope:
    return Envelope.new(tenant_id="t1", model_id="m1", seq_id=7, kind="forward_backward", payload=FB_PAYLOAD)


def test_round_trip_str_and_bytes_fields() -> None:
    env = _fb()
    fields = encode(env)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in fields.items())
    assert fields["v"] == str(ENVELOPE_VERSION) and fields["request_id"] == env.request_id
    assert decode(fields) == env
    # A client without decode_responses hands back bytes.
    assert decode({k.encode(): v.encode() for k, v in fields.items()}) == env


def test_unknown_version_is_rejected_clearly() -> None:
    fields = encode(_fb()) | {"v": "2"}
    with pytest.raises(EnvelopeError, match="unsupported envelope version '2'"):
        decode(fields)
    with pytest.raises(EnvelopeError, match="version None"):
        decode({k: v for k, v in encode(_fb()).items() if k != "v"})


@pytest.mark.parametrize(
    "data",
    ["not json", json.dumps({"request_id": "r"}), json.dumps({**json.loads(_fb().model_dump_json()), "kind": "train"})],
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
    env = Envelope.new(tenant_id="t1", model_id="m1", seq_id=1, kind="optim_step",
                       payload={"note": "NaN and Infinity are words here", "x": 1.5})  # fmt: skip
    fields = encode(env)
    assert json.loads(fields["data"])["payload"]["note"] == "NaN and Infinity are words here"
