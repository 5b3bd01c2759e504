"""The contract's table of request kinds and its typed payloads: every kind has one row, payloads parse from their
wire form (and back), and a payload of the wrong shape is a ValueError naming the field."""

from __future__ import annotations

import pytest

from loraplex.protocol import (
    CONTROL_KINDS,
    KINDS,
    SAVE_KINDS,
    CreateAdapterPayload,
    ForwardBackwardPayload,
    PlannedRequest,
    RequestKind,
    StepKind,
    kinds_of_step,
    parse_payload,
)

FB = {"data": [{"model_input": [1, 2, 3], "loss_fn_inputs": {"target_tokens": [2, 3, 4], "weights": [1.0, 0.5, 1]}}]}


def test_every_kind_has_one_row_and_the_derived_sets_follow_it() -> None:
    assert set(KINDS) == set(RequestKind)
    assert {RequestKind.CREATE_ADAPTER, RequestKind.DELETE_ADAPTER} == CONTROL_KINDS
    assert {RequestKind.SAVE_STATE, RequestKind.SAVE_SAMPLER} == SAVE_KINDS
    assert kinds_of_step(StepKind.FORWARD_BACKWARD) == {RequestKind.FORWARD_BACKWARD, RequestKind.FORWARD}
    assert [k for k, spec in KINDS.items() if spec.trains] == [RequestKind.FORWARD_BACKWARD]


@pytest.mark.parametrize(
    ("kind", "wire"),
    [
        (RequestKind.CREATE_ADAPTER, {"base_model": "tiny", "rank": 4, "alpha": 8.0, "seed": 3, "target_modules": ["q_proj"]}),
        (RequestKind.CREATE_ADAPTER, {"rank": 4, "from_checkpoint": {"directory": "/x", "path": "tinker://m/weights/a"}}),
        (RequestKind.DELETE_ADAPTER, {}),
        (RequestKind.FORWARD_BACKWARD, FB | {"loss_fn": "ppo", "loss_fn_config": {"clip_low_threshold": 0.8}}),
        (RequestKind.FORWARD, FB),
        (RequestKind.OPTIM_STEP, {"adam_params": {"learning_rate": 1e-4}}),
        (RequestKind.SAVE_STATE, {"name": "s", "path": "tinker://m/weights/s", "directory": "/d", "ttl_seconds": 60}),
        (RequestKind.SAVE_SAMPLER, {"name": "s", "directory": "/d", "overwrite": True}),
        (RequestKind.LOAD_STATE, {"path": "tinker://m/weights/s", "directory": "/d", "with_optimizer": False}),
    ],
)
def test_payloads_parse_from_their_wire_form_and_back(kind: RequestKind, wire: dict) -> None:
    payload = parse_payload(kind, wire)
    assert isinstance(payload, KINDS[kind].payload)
    again = parse_payload(kind, payload.to_wire())
    assert again == payload
    assert parse_payload(kind, payload) is payload


def test_a_planned_request_parses_a_mapping_payload_and_counts_its_tokens() -> None:
    r = PlannedRequest("r1", "t", "m", 1, RequestKind.FORWARD_BACKWARD, FB)
    assert isinstance(r.payload, ForwardBackwardPayload)
    assert r.num_tokens == 3
    assert r.payload.data[0].loss_fn_inputs["weights"] == [1.0, 0.5, 1]  # kept as sent: the engine checks elements
    assert PlannedRequest("r2", "t", "m", 2, "optim_step").num_tokens == 0
    assert PlannedRequest("r3", "t", "m", -1, RequestKind.CREATE_ADAPTER, {}).payload == CreateAdapterPayload()


@pytest.mark.parametrize(
    ("kind", "wire", "named"),
    [
        (RequestKind.FORWARD_BACKWARD, {"data": [{"model_input": "abc"}]}, "model_input"),
        (RequestKind.FORWARD_BACKWARD, {"data": [{"model_input": [1]}], "loss_fn": 3}, "loss_fn"),
        (RequestKind.FORWARD_BACKWARD, {"data": [], "forward_only": True}, "forward_only"),
        (RequestKind.CREATE_ADAPTER, {"rank": "big"}, "rank"),
        (RequestKind.CREATE_ADAPTER, {"rank": True}, "rank"),
        (RequestKind.CREATE_ADAPTER, {"rank": 4, "from_checkpoint": {"path": "p"}}, "from_checkpoint.directory"),
        (RequestKind.OPTIM_STEP, {"adam_params": [1]}, "adam_params"),
        (RequestKind.LOAD_STATE, {"with_optimizer": "yes"}, "with_optimizer"),
        (RequestKind.DELETE_ADAPTER, [], "object"),
    ],
)
def test_a_payload_of_the_wrong_shape_is_a_value_error_naming_the_field(kind: RequestKind, wire, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        parse_payload(kind, wire)
    with pytest.raises(ValueError, match="takes a"):
        parse_payload(RequestKind.OPTIM_STEP, parse_payload(RequestKind.DELETE_ADAPTER, {}))
