"""The Tinker protobuf codec against the SDK's own converters: requests the SDK encodes (tinker.proto.request_conv)
decode straight to the contract's ForwardBackwardPayload, our outputs decode with the SDK's response reader (tinker.proto.response_conv), and any
bytes at all are an InvalidRequestError, never another exception."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from loraplex.api.tinker.codec import (
    decode_forward_backward,
    decompress,
    encode_forward_backward_output,
    optim_step_payload,
)
from loraplex.errors import InvalidRequestError, RequestTooLargeError
from loraplex.protocol import ForwardBackwardPayload, OptimStepPayload, RequestKind
from loraplex.protocol.adam import ADAM_DEFAULTS
from loraplex.settings import Settings


def _sdk_body(data: list[types.Datum], loss_fn: str = "cross_entropy", config=None, forward_only=False) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="s:train:0",
        seq_id=7,
    )
    msg = forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    return msg.SerializeToString()


def test_an_sdk_request_decodes_to_the_payload() -> None:
    tokens = [5, 9, 11, 300, 2]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:3]).append_int(tokens[3]).append_int(tokens[4]),
        loss_fn_inputs={"target_tokens": [9, 11, 300, 2, 1], "weights": [0.0, 1.0, 1.0, -0.5, 2.0],
                        "advantages": np.array([0.5, 0, 0, 1, 1], dtype=np.float32)},
    )  # fmt: skip
    decoded = decode_forward_backward(_sdk_body([datum, datum], "ppo", {"clip_low_threshold": 0.7}, forward_only=True))
    assert (decoded.model_id, decoded.seq_id, decoded.forward_only) == ("s:train:0", 7, True)
    assert decoded.kind is RequestKind.FORWARD
    payload = decoded.payload()
    assert isinstance(payload, ForwardBackwardPayload)
    assert payload.loss_fn == "ppo" and payload.loss_fn_config == pytest.approx({"clip_low_threshold": 0.7})
    assert len(payload.data) == 2
    first = payload.data[0]
    assert first.model_input == tokens and all(type(t) is int for t in first.model_input)
    assert first.loss_fn_inputs["target_tokens"] == [9, 11, 300, 2, 1]
    assert first.loss_fn_inputs["weights"] == [0.0, 1.0, 1.0, -0.5, 2.0]
    assert first.loss_fn_inputs["advantages"] == [0.5, 0, 0, 1, 1]
    # The payload is what the queue decodes again (its JSON form, read by its type hints).
    assert ForwardBackwardPayload.from_wire(payload.to_wire()) == payload


def test_sparse_2d_torch_inputs_the_sdk_sparsifies_decode_dense() -> None:
    """The SDK sends a 2-D torch tensor as sparse CSR when that is smaller (mostly-zero weights of a long datum, as a
    [1, N] row); it decodes to one value per token."""
    n = 40
    weights = torch.zeros(1, n)
    weights[0, 3], weights[0, 17] = 1.5, 2.0
    targets = torch.zeros(1, n, dtype=torch.int64)
    targets[0, 5] = 7
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(range(n))),
        loss_fn_inputs={"weights": types.TensorData.from_torch_sparse(weights),
                        "target_tokens": types.TensorData.from_torch_sparse(targets)},
    )  # fmt: skip
    msg = pb.ForwardBackwardRequest.FromString(_sdk_body([datum]))
    assert msg.data[0].loss_fn_inputs["weights"].WhichOneof("encoding") == "sparse_csr"
    inputs = decode_forward_backward(_sdk_body([datum])).payload().data[0].loss_fn_inputs
    assert inputs["weights"] == weights[0].tolist()
    assert inputs["target_tokens"] == targets[0].tolist()


def test_zstd_bodies_decompress_within_the_limit() -> None:
    body = _sdk_body([types.Datum(model_input=types.ModelInput.from_ints(list(range(200))),
                                  loss_fn_inputs={"target_tokens": list(range(1, 201))})])  # fmt: skip
    packed = zstandard.ZstdCompressor().compress(body)
    assert decompress(packed, "zstd", 10_000) == body
    assert decompress(body, None, 10_000) == body
    with pytest.raises(RequestTooLargeError):  # a small body may not expand past the body limit
        decompress(zstandard.ZstdCompressor().compress(b"\0" * 100_000), "zstd", 10_000)
    with pytest.raises(InvalidRequestError, match="zstd"):
        decompress(b"not zstd", "zstd", 10_000)
    with pytest.raises(InvalidRequestError, match="gzip"):
        decompress(body, "gzip", 10_000)


def test_unsupported_inputs_are_clear_errors() -> None:
    image = types.Datum(
        model_input=types.ModelInput(chunks=[types.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=4)]),
        loss_fn_inputs={},
    )
    with pytest.raises(InvalidRequestError, match="text tokens only"):
        decode_forward_backward(_sdk_body([image])).payload()
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1)
    msg.loss_fn_config_v2["mode"].text = "fancy"
    with pytest.raises(InvalidRequestError, match="numbers only"):
        decode_forward_backward(msg.SerializeToString()).payload()
    odd = pb.ForwardBackwardRequest(model_id="m", seq_id=1)
    odd.data.add().model_input.add().encoded_text.tokens = b"\x01\x02\x03"
    with pytest.raises(InvalidRequestError, match="int32"):
        decode_forward_backward(odd.SerializeToString()).payload()
    wide = pb.ForwardBackwardRequest(model_id="m", seq_id=1)
    tensor = wide.data.add().loss_fn_inputs["weights"]
    tensor.dtype, tensor.dense = pb.DTYPE_FLOAT32, np.zeros(6, dtype="<f4").tobytes()
    tensor.shape.extend([3, 2])
    with pytest.raises(InvalidRequestError, match=r"one value per token"):
        decode_forward_backward(wide.SerializeToString()).payload()
    with pytest.raises(InvalidRequestError, match="model_id"):
        decode_forward_backward(pb.ForwardBackwardRequest(seq_id=1).SerializeToString())
    with pytest.raises(InvalidRequestError, match="seq_id must be >= 0"):
        decode_forward_backward(pb.ForwardBackwardRequest(model_id="m", seq_id=-1).SerializeToString())


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_any_bytes_decode_or_fail_with_a_typed_error(body: bytes) -> None:
    with contextlib.suppress(InvalidRequestError):
        decode_forward_backward(body).payload()


def test_our_output_reads_back_with_the_sdk() -> None:
    result = {
        "loss_fn_outputs": [{"logprobs": [-0.5, -1.25, -3.0]}, {"logprobs": []}, {"logprobs": [-2.0]}],
        "metrics": {"loss:sum": 6.75, "importance_ratio:mean": 1.0},
    }
    out = deserialize_forward_backward_output(encode_forward_backward_output(result))
    assert out.metrics == pytest.approx(result["metrics"])
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-0.5, -1.25, -3.0], [], [-2.0]]
    assert all(o["logprobs"].dtype == "float32" for o in out.loss_fn_outputs)


def _sparse_zeros(tensor, n: int) -> None:
    """A [1, n] float32 sparse CSR tensor with no values: a few bytes declaring n zeros."""
    tensor.dtype = pb.DTYPE_FLOAT32
    tensor.shape.extend([1, n])
    tensor.sparse_csr.crow_indices = np.zeros(2, dtype="<i8").tobytes()


def test_declared_sizes_are_checked_before_anything_is_expanded(monkeypatch) -> None:
    """The service's size limits on the counts the message declares (the same messages as on the built payload),
    then each tensor's declared shape against its datum's tokens; a bomb never reaches `payload()`."""
    settings = Settings(max_datums_per_request=2, max_tokens_per_datum=8, max_tokens_per_request=12)
    monkeypatch.setattr(
        "loraplex.api.tinker.codec._tensor", lambda *a: pytest.fail("a tensor was expanded before the size check")
    )
    bomb = pb.ForwardBackwardRequest(model_id="m", seq_id=1)
    datum = bomb.data.add()
    datum.model_input.add().encoded_text.tokens = np.array([5], dtype="<i4").tobytes()
    _sparse_zeros(datum.loss_fn_inputs["weights"], 2**24)
    with pytest.raises(RequestTooLargeError, match=r"weights declares 16777216 values .*LORAPLEX_MAX_TOKENS_PER_DATUM"):
        decode_forward_backward(bomb.SerializeToString()).check_sizes(settings)
    short = pb.ForwardBackwardRequest(model_id="m", seq_id=1)
    datum = short.data.add()
    datum.model_input.add().encoded_text.tokens = np.arange(5, dtype="<i4").tobytes()
    _sparse_zeros(datum.loss_fn_inputs["weights"], 3)
    with pytest.raises(InvalidRequestError, match="declares 3 values, model_input has 5 tokens"):
        decode_forward_backward(short.SerializeToString()).check_sizes(settings)

    def body(*lengths: int) -> bytes:
        msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1)
        for n in lengths:
            msg.data.add().model_input.add().encoded_text.tokens = np.arange(n, dtype="<i4").tobytes()
        return msg.SerializeToString()

    for lengths, message in (
        ((1, 1, 1), r"data has 3 datums; at most 2 per request \(LORAPLEX_MAX_DATUMS_PER_REQUEST\)"),
        ((2, 9), r"data\[1\] has 9 tokens; at most 8 per datum \(LORAPLEX_MAX_TOKENS_PER_DATUM\)"),
        ((7, 7), r"data has 14 tokens; at most 12 per request \(LORAPLEX_MAX_TOKENS_PER_REQUEST\)"),
    ):
        with pytest.raises(RequestTooLargeError, match=message):
            decode_forward_backward(body(*lengths)).check_sizes(settings)
    decode_forward_backward(body(6, 6)).check_sizes(settings)


def test_optim_step_params_become_the_payload_with_the_defaults() -> None:
    assert optim_step_payload(None) == OptimStepPayload(adam_params=dict(ADAM_DEFAULTS))
    assert optim_step_payload({"learning_rate": 0.5}).adam_params == {**ADAM_DEFAULTS, "learning_rate": 0.5}
