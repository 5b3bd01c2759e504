"""The Tinker protobuf codec against the SDK's own converters: requests the SDK encodes (tinker.proto.request_conv)
decode to the native body, our outputs decode with the SDK's response reader (tinker.proto.response_conv), and any
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

from loraplex.api.tinker.codec import decode_forward_backward, decompress, encode_forward_backward_output
from loraplex.errors import InvalidRequestError, RequestTooLargeError


def _sdk_body(data: list[types.Datum], loss_fn: str = "cross_entropy", config=None, forward_only=False) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="s:train:0",
        seq_id=7,
    )
    msg = forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    return msg.SerializeToString()


def test_an_sdk_request_decodes_to_the_native_body() -> None:
    tokens = [5, 9, 11, 300, 2]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:3]).append_int(tokens[3]).append_int(tokens[4]),
        loss_fn_inputs={"target_tokens": [9, 11, 300, 2, 1], "weights": [0.0, 1.0, 1.0, -0.5, 2.0],
                        "advantages": np.array([0.5, 0, 0, 1, 1], dtype=np.float32)},
    )  # fmt: skip
    decoded = decode_forward_backward(_sdk_body([datum, datum], "ppo", {"clip_low_threshold": 0.7}, forward_only=True))
    assert (decoded.model_id, decoded.seq_id, decoded.forward_only) == ("s:train:0", 7, True)
    fields = decoded.fields()
    assert fields["loss_fn"] == "ppo" and fields["loss_fn_config"] == pytest.approx({"clip_low_threshold": 0.7})
    assert len(fields["data"]) == 2
    first = fields["data"][0]
    assert first["model_input"] == tokens
    assert first["loss_fn_inputs"]["target_tokens"] == [9, 11, 300, 2, 1]
    assert first["loss_fn_inputs"]["weights"] == [0.0, 1.0, 1.0, -0.5, 2.0]
    assert first["loss_fn_inputs"]["advantages"] == [0.5, 0, 0, 1, 1]


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
    inputs = decode_forward_backward(_sdk_body([datum])).fields()["data"][0]["loss_fn_inputs"]
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
        decode_forward_backward(_sdk_body([image])).fields()
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1)
    msg.loss_fn_config_v2["mode"].text = "fancy"
    with pytest.raises(InvalidRequestError, match="numbers only"):
        decode_forward_backward(msg.SerializeToString()).fields()
    odd = pb.ForwardBackwardRequest(model_id="m", seq_id=1)
    odd.data.add().model_input.add().encoded_text.tokens = b"\x01\x02\x03"
    with pytest.raises(InvalidRequestError, match="int32"):
        decode_forward_backward(odd.SerializeToString()).fields()
    wide = pb.ForwardBackwardRequest(model_id="m", seq_id=1)
    tensor = wide.data.add().loss_fn_inputs["weights"]
    tensor.dtype, tensor.dense = pb.DTYPE_FLOAT32, np.zeros(6, dtype="<f4").tobytes()
    tensor.shape.extend([3, 2])
    with pytest.raises(InvalidRequestError, match=r"one value per token"):
        decode_forward_backward(wide.SerializeToString()).fields()
    with pytest.raises(InvalidRequestError, match="model_id"):
        decode_forward_backward(pb.ForwardBackwardRequest(seq_id=1).SerializeToString())


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_any_bytes_decode_or_fail_with_a_typed_error(body: bytes) -> None:
    with contextlib.suppress(InvalidRequestError):
        decode_forward_backward(body).fields()


def test_our_output_reads_back_with_the_sdk() -> None:
    result = {
        "loss_fn_outputs": [{"logprobs": [-0.5, -1.25, -3.0]}, {"logprobs": []}, {"logprobs": [-2.0]}],
        "metrics": {"loss:sum": 6.75, "importance_ratio:mean": 1.0},
    }
    out = deserialize_forward_backward_output(encode_forward_backward_output(result))
    assert out.metrics == pytest.approx(result["metrics"])
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-0.5, -1.25, -3.0], [], [-2.0]]
    assert all(o["logprobs"].dtype == "float32" for o in out.loss_fn_outputs)
