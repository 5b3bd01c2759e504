"""The Tinker SDK's protobuf wire, server side: a `ForwardBackwardRequest` body in, a `ForwardBackwardOutput` out.

The message classes are the SDK's own (`tinker.proto.tinker_public_pb2`, a dependency); this module builds the
contract's payloads from them (ForwardBackwardPayload straight from the message, no dict or request model between;
OptimStepPayload from the JSON body's AdamW fields) and encodes our results as the SDK's messages. The service checks
the payload with exactly the rules of `POST /v1/adapters/{id}/forward_backward` (service/training.py); only the sizes
a body declares are checked here first, before a sparse tensor is expanded. Pure: no services, no torch (numpy reads
the little-endian buffers). Everything malformed is an InvalidRequestError naming the field, never an exception of
protobuf or numpy.

Wire facts (tinker-wire.md): tokens are int32 bytes inside `encoded_text` chunks; a tensor is `dense` bytes or
`sparse_csr` (values, int64 crow/col indices) with a dtype (float32, int64, int32, bfloat16) and a shape; the
response's per-datum arrays are one `BatchedTensor` per field (the arrays concatenated, n+1 int64 byte offsets)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import zstandard
from google.protobuf.message import DecodeError

from loraplex.api.tinker.proto import pb

if TYPE_CHECKING:  # the SDK's typed stubs, for mypy only (importing `tinker` at run time pulls in torch)
    from tinker.proto import tinker_public_pb2 as pbt
from loraplex.errors import InvalidRequestError, RequestTooLargeError
from loraplex.protocol import DatumPayload, ForwardBackwardPayload, OptimStepPayload, RequestKind
from loraplex.protocol.adam import ADAM_DEFAULTS
from loraplex.service.training import check_sizes
from loraplex.settings import Settings

PROTOBUF_MEDIA_TYPE = "application/x-protobuf"

_NUMPY_BY_DTYPE: dict[int, np.dtype[Any]] = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_INT32: np.dtype("<i4"),
    pb.DTYPE_BFLOAT16: np.dtype("<u2"),
}


@dataclass
class DecodedForwardBackward:
    """A parsed request: which adapter and seq_id it is for, and (`payload()`) its ForwardBackwardPayload, built from
    the message. Split so that a bad datum is a rejection queued in its seq_id's place."""

    model_id: str
    seq_id: int
    forward_only: bool
    message: pbt.ForwardBackwardRequest

    @property
    def kind(self) -> RequestKind:
        return RequestKind.FORWARD if self.forward_only else RequestKind.FORWARD_BACKWARD

    def check_sizes(self, settings: Settings) -> None:
        """The request's sizes as it declares them, before anything is expanded: the service's size limits
        (service/training.check_sizes) on its datums' token and loss input counts, then each tensor's declared
        shape (its element count must be its datum's token count). A sparse tensor of 89 bytes may declare millions
        of zeros; `payload()` builds them only after this passed."""
        msg = self.message
        tokens = [_token_count(datum) for datum in msg.data]
        check_sizes(settings, tokens, [len(datum.loss_fn_inputs) for datum in msg.data])
        for i, (datum, n) in enumerate(zip(msg.data, tokens, strict=True)):
            for name, tensor in datum.loss_fn_inputs.items():
                declared = _declared_elements(tensor)
                where = f"data[{i}].loss_fn_inputs.{name}"
                if declared > settings.max_tokens_per_datum:
                    raise RequestTooLargeError(
                        f"{where} declares {declared} values (shape {list(tensor.shape)}); at most "
                        f"{settings.max_tokens_per_datum}, one per token (LORAPLEX_MAX_TOKENS_PER_DATUM)"
                    )
                if declared != n:
                    raise InvalidRequestError(f"{where} declares {declared} values, model_input has {n} tokens")

    def payload(self) -> ForwardBackwardPayload:
        """The ForwardBackwardPayload, straight from the message (the service checks it: tokens, lengths, loss)."""
        msg = self.message
        return ForwardBackwardPayload(
            data=tuple(_datum(i, d) for i, d in enumerate(msg.data)),
            loss_fn=msg.loss_fn or "cross_entropy",
            loss_fn_config=_loss_config(msg),
        )


def optim_step_payload(adam_params: Mapping[str, float] | None) -> OptimStepPayload:
    """The optim_step body's (JSON, validated by its model) AdamW hyperparameters as the payload, defaults filled in."""
    return OptimStepPayload(adam_params={**ADAM_DEFAULTS, **(adam_params or {})})


def decompress(body: bytes, content_encoding: str | None, limit: int) -> bytes:
    """The body as sent (`Content-Encoding: zstd` when the server's client/config asks for compressed bodies),
    never more than `limit` bytes once decompressed (a small body must not expand past the body limit)."""
    encoding = (content_encoding or "").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding != "zstd":
        raise InvalidRequestError(f"Content-Encoding {content_encoding!r} is not supported (zstd or none)")
    try:
        with zstandard.ZstdDecompressor().stream_reader(body) as reader:
            out = reader.read(limit + 1)
    except zstandard.ZstdError as exc:
        raise InvalidRequestError(f"the zstd body does not decompress: {exc}") from None
    if len(out) > limit:
        raise RequestTooLargeError(f"the decompressed body is over {limit} bytes (LORAPLEX_MAX_BODY_BYTES)")
    return out


def decode_forward_backward(body: bytes) -> DecodedForwardBackward:
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except (DecodeError, ValueError) as exc:
        raise InvalidRequestError(f"the body is not a ForwardBackwardRequest protobuf: {exc}") from None
    if not msg.model_id:
        raise InvalidRequestError("model_id is required")
    if msg.seq_id < 0:
        raise InvalidRequestError(f"seq_id must be >= 0, got {msg.seq_id}")
    return DecodedForwardBackward(msg.model_id, msg.seq_id, msg.forward_only, msg)


def _loss_config(msg: pbt.ForwardBackwardRequest) -> dict[str, float]:
    """`loss_fn_config_v2` when set (the SDK writes both), else the legacy float map. Our losses take numbers only."""
    if msg.loss_fn_config_v2:
        config: dict[str, float] = {}
        for key, value in msg.loss_fn_config_v2.items():
            if value.WhichOneof("value") == "text":
                raise InvalidRequestError(f"loss_fn_config.{key}: a text value; the losses here take numbers only")
            config[key] = value.number
        return config
    return dict(msg.loss_fn_config)


def _token_count(datum: pbt.Datum) -> int:
    """A datum's tokens as its encoded_text chunks hold them (int32 each), before they are read."""
    return sum(len(c.encoded_text.tokens) // 4 for c in datum.model_input if c.HasField("encoded_text"))


def _datum(i: int, datum: pbt.Datum) -> DatumPayload:
    chunks: list[np.ndarray] = []
    for j, chunk in enumerate(datum.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise InvalidRequestError(
                f"data[{i}].model_input[{j}] is a {kind or 'empty'} chunk: this pool takes text tokens only"
            )
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise InvalidRequestError(f"data[{i}].model_input[{j}].tokens is not whole int32 values")
        chunks.append(np.frombuffer(raw, dtype="<i4"))
    tokens: list[int] = np.concatenate(chunks).tolist() if chunks else []
    inputs = {name: _tensor(f"data[{i}].loss_fn_inputs.{name}", t) for name, t in datum.loss_fn_inputs.items()}
    return DatumPayload(model_input=tokens, loss_fn_inputs=inputs)


def _declared_elements(tensor: pbt.Tensor) -> int:
    """How many values a tensor says it holds: its shape's product, else (no shape) its dense bytes' count."""
    if tensor.shape:
        return math.prod(max(int(s), 0) for s in tensor.shape)
    np_dtype = _NUMPY_BY_DTYPE.get(tensor.dtype)
    if tensor.WhichOneof("encoding") != "dense" or np_dtype is None:
        return 0
    return len(tensor.dense) // np_dtype.itemsize


def _tensor(where: str, tensor: pbt.Tensor) -> list[float] | list[int]:
    """A tensor as one flat list per token: [N], [N, 1] or [1, N]; dense or sparse CSR."""
    np_dtype = _NUMPY_BY_DTYPE.get(tensor.dtype)
    if np_dtype is None:
        raise InvalidRequestError(f"{where}: unknown dtype {tensor.dtype}")
    shape = [int(s) for s in tensor.shape]
    if any(s < 0 for s in shape):
        raise InvalidRequestError(f"{where}: negative shape {shape}")
    layout = tensor.WhichOneof("encoding")
    if layout == "sparse_csr":
        values = _dense_from_csr(where, tensor.sparse_csr, np_dtype, shape)
    else:
        raw = tensor.dense if layout == "dense" else b""
        if len(raw) % np_dtype.itemsize:
            raise InvalidRequestError(f"{where}: {len(raw)} bytes are not whole {np_dtype.name} values")
        values = np.frombuffer(raw, dtype=np_dtype)
        if shape and math.prod(shape) != values.size:
            raise InvalidRequestError(f"{where}: shape {shape} does not hold {values.size} values")
    if sum(1 for s in shape if s != 1) > 1:
        raise InvalidRequestError(f"{where}: shape {shape}; one value per token ([N], [N, 1] or [1, N]) is supported")
    if tensor.dtype == pb.DTYPE_BFLOAT16:  # the upper half of a float32
        values = (values.astype(np.uint32) << 16).view(np.float32)
    if values.dtype.kind == "f":
        return values.astype(np.float64).tolist()
    return values.astype(np.int64).tolist()


def _dense_from_csr(where: str, csr: pbt.SparseCsr, np_dtype: np.dtype[Any], shape: list[int]) -> np.ndarray:
    if len(shape) not in (1, 2):
        raise InvalidRequestError(f"{where}: a sparse tensor needs its shape [rows] or [rows, cols], got {shape}")
    rows, cols = shape[0], (shape[1] if len(shape) == 2 else 1)
    if rows * cols > 1 << 24:
        raise InvalidRequestError(f"{where}: shape {shape} is too large")
    if len(csr.values) % np_dtype.itemsize or len(csr.crow_indices) % 8 or len(csr.col_indices) % 8:
        raise InvalidRequestError(f"{where}: sparse buffers are not whole values")
    values = np.frombuffer(csr.values, dtype=np_dtype)
    crow = np.frombuffer(csr.crow_indices, dtype="<i8")
    col = np.frombuffer(csr.col_indices, dtype="<i8")
    if (
        crow.size != rows + 1
        or col.size != values.size
        or (crow.size and (crow[0] != 0 or crow[-1] != values.size or np.any(np.diff(crow) < 0)))
        or (col.size and (col.min() < 0 or col.max() >= cols))
    ):
        raise InvalidRequestError(f"{where}: inconsistent sparse CSR indices for shape {shape}")
    dense = np.zeros(rows * cols, dtype=np_dtype)
    row_of = np.repeat(np.arange(rows), np.diff(crow))
    dense[row_of * cols + col] = values
    return dense


def encode_forward_backward_output(result: dict[str, Any]) -> bytes:
    """Our forward/forward_backward result ({loss_fn_outputs: [{logprobs: [...], ...}], metrics}) as the SDK's
    ForwardBackwardOutput: one ArrayRecord, a float32 BatchedTensor per output field."""
    outputs: list[dict[str, Any]] = result.get("loss_fn_outputs") or []
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(outputs))
    names = sorted({name for output in outputs for name in output})
    for name in names:
        arrays = [np.asarray(output.get(name, []), dtype="<f4").reshape(-1) for output in outputs]
        offsets = np.zeros(len(arrays) + 1, dtype="<i8")
        offsets[1:] = np.cumsum([a.nbytes for a in arrays])
        tensor = record.fields[name]
        tensor.data = b"".join(a.tobytes() for a in arrays)
        tensor.offsets = offsets.tobytes()
        tensor.dtype = pb.DTYPE_FLOAT32
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=result.get("metrics") or {})
    out.loss_fn_outputs.append(record)
    return out.SerializeToString()


STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


def _topk(rows: list[list[Any]] | None, k: int) -> Any:
    """Per position, up to k (token_id, logprob) pairs, as the SDK's TopkLogprobs (positions x k, padded)."""
    n = len(rows or [])
    ids = np.zeros((n, k), dtype="<i4")
    lps = np.full((n, k), -np.inf, dtype="<f4")
    for i, row in enumerate(rows or []):
        for j, (token, logprob) in enumerate((row or [])[:k]):
            ids[i, j], lps[i, j] = token, logprob
    return pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=lps.tobytes(), k=k, length=n)


def encode_sample_response(result: dict[str, Any]) -> bytes:
    """Our sample result ({sequences: [{tokens, logprobs, stop_reason, topk_logprobs?}], prompt_logprobs?,
    topk_prompt_logprobs?}) as the SDK's SampleResponse; an unscored prompt position (the first) is NaN."""
    out = pb.SampleResponse()
    for seq in result.get("sequences") or []:
        msg = out.sequences.add()
        msg.stop_reason = STOP_REASONS.get(seq.get("stop_reason", "length"), pb.STOP_REASON_LENGTH)
        msg.tokens = np.asarray(seq.get("tokens", []), dtype="<i4").tobytes()
        if seq.get("logprobs") is not None:
            msg.logprobs = np.asarray(seq["logprobs"], dtype="<f4").tobytes()
        topk = seq.get("topk_logprobs")
        if topk:
            msg.topk_sampled_logprobs.CopyFrom(_topk(topk, max(len(r or []) for r in topk)))
    prompt = result.get("prompt_logprobs")
    if prompt is not None:
        out.prompt_logprobs = np.asarray([np.nan if v is None else v for v in prompt], dtype="<f4").tobytes()
    topk_prompt = result.get("topk_prompt_logprobs")
    if topk_prompt:
        out.topk_prompt_logprobs.CopyFrom(_topk(topk_prompt, max(len(r or []) for r in topk_prompt)))
    out.prompt_cache_hit_tokens = 0
    return out.SerializeToString()
