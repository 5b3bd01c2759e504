"""The contract's table of request kinds and its typed payloads: every kind has one row holding its per-kind facts,
payloads parse from their wire form (and back) through the one generic decoder, and a payload of the wrong shape is a
ValueError naming the field's path."""

from __future__ import annotations

import pytest

from loraplex.protocol import (
    CONTROL_KINDS,
    KINDS,
    RESIDENT_STEPS,
    SAVE_KINDS,
    STATE_KINDS,
    CreateAdapterPayload,
    ForwardBackwardPayload,
    PlannedRequest,
    RequestKind,
    SamplePayload,
    StepKind,
    kinds_of_step,
    parse_payload,
    tokens_of,
)

FB = {"data": [{"model_input": [1, 2, 3], "loss_fn_inputs": {"target_tokens": [2, 3, 4], "weights": [1.0, 0.5, 1]}}]}


def test_every_kind_has_one_row_and_the_derived_sets_follow_it() -> None:
    assert set(KINDS) == set(RequestKind)
    assert {RequestKind.CREATE_ADAPTER, RequestKind.DELETE_ADAPTER} == CONTROL_KINDS
    assert {RequestKind.SAVE_STATE, RequestKind.SAVE_SAMPLER} == SAVE_KINDS
    assert kinds_of_step(StepKind.FORWARD_BACKWARD) == {RequestKind.FORWARD_BACKWARD, RequestKind.FORWARD}
    assert [k for k, spec in KINDS.items() if spec.trains] == [RequestKind.FORWARD_BACKWARD]
    K = RequestKind
    assert {K.CREATE_ADAPTER, K.FORWARD_BACKWARD, K.OPTIM_STEP, K.LOAD_STATE} == STATE_KINDS
    assert {k for k, spec in KINDS.items() if spec.quota_exempt} == {K.CREATE_ADAPTER, K.DELETE_ADAPTER, K.REJECTED}
    assert {k for k, spec in KINDS.items() if spec.counts_usage} == {K.FORWARD_BACKWARD, K.FORWARD}
    assert {StepKind.FORWARD_BACKWARD, StepKind.OPTIM_STEP, StepKind.CHECKPOINT} == RESIDENT_STEPS


def test_tokens_are_counted_by_the_kinds_row_only() -> None:
    fb = parse_payload(RequestKind.FORWARD_BACKWARD, {"data": [{"model_input": [1, 2, 3]}, {"model_input": [4, 5]}]})
    assert tokens_of(RequestKind.FORWARD_BACKWARD, fb) == tokens_of(RequestKind.FORWARD, fb) == 5
    assert tokens_of(RequestKind.FORWARD, fb, (1, 2)) == 2  # a part: its datums only
    assert PlannedRequest("r", "t", "m", 1, RequestKind.FORWARD, fb, part=(0, 1)).num_tokens == 3
    sample = SamplePayload(prompt=(1, 2, 3), num_samples=4, max_tokens=10)
    assert tokens_of(RequestKind.SAMPLE, sample) == 3 + 4 * 10  # the prompt and the most it can add
    assert all(tokens_of(k, spec.payload()) == 0 for k, spec in KINDS.items() if spec.step not in
               (StepKind.FORWARD_BACKWARD, StepKind.SAMPLE))  # fmt: skip


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
        (RequestKind.FORWARD_BACKWARD, {"data": [{"model_input": "abc"}]}, r"data\[0\]\.model_input: expected list\[int\]"),
        (RequestKind.FORWARD_BACKWARD, {"data": [{"model_input": [1, True]}]}, r"data\[0\]\.model_input\[1\]: .* bool"),
        (RequestKind.FORWARD_BACKWARD, {"data": [{}]}, r"data\[0\]\.model_input: missing"),
        (RequestKind.FORWARD_BACKWARD, {"data": [{"model_input": [1], "loss_fn_inputs": {"w": 2}}]},
         r"data\[0\]\.loss_fn_inputs\.w: expected list"),
        (RequestKind.FORWARD_BACKWARD, {"data": [{"model_input": [1]}], "loss_fn": 3}, "loss_fn"),
        (RequestKind.FORWARD_BACKWARD, {"data": [], "forward_only": True}, "forward_only"),
        (RequestKind.CREATE_ADAPTER, {"rank": "big"}, "rank"),
        (RequestKind.CREATE_ADAPTER, {"rank": True}, "rank"),
        (RequestKind.CREATE_ADAPTER, {"rank": 4, "from_checkpoint": {"path": "p"}}, "from_checkpoint.directory"),
        (RequestKind.CREATE_ADAPTER, {"target_modules": ["q", 1]}, r"target_modules\[1\]: expected str"),
        (RequestKind.SAMPLE, {"prompt": [1], "temperature": "hot"}, "temperature: expected float, got str"),
        (RequestKind.SAMPLE, {"prompt": [1], "seed": 1.5}, "seed: expected int or None, got float"),
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


def test_the_decoder_takes_the_json_forms_and_builds_the_hinted_types() -> None:
    sample = parse_payload(RequestKind.SAMPLE, {"prompt": [1, 2], "temperature": 1, "stop_strings": ["x"], "seed": None})
    assert sample == SamplePayload(prompt=(1, 2), temperature=1.0, stop_strings=("x",))
    assert type(sample.temperature) is float and type(sample.prompt) is tuple  # an int is made a float; arrays tuples
    create = parse_payload(RequestKind.CREATE_ADAPTER, {"rank": 4, "from_checkpoint": None, "target_modules": None})
    assert create == CreateAdapterPayload(rank=4)
    tokens = [1, 2, 3]
    fb = parse_payload(RequestKind.FORWARD, {"data": [{"model_input": tokens}]})
    assert isinstance(fb, ForwardBackwardPayload) and fb.data[0].model_input is tokens  # checked, not copied
