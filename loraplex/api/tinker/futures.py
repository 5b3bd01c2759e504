"""Tinker futures: the id the SDK polls, and what `retrieve_future` answers for each kind of request.

A Tinker future id is `<tag>.<request_id>`: the tag says which Tinker response type the stored result becomes, so
`retrieve_future` needs no per-request state beyond what the native futures have (the owner key and the result).
A tag a caller made up changes nothing but how its own result is shaped; ownership is checked on the request id.
Pure: no services."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from loraplex.api.tinker.codec import encode_forward_backward_output, encode_sample_response
from loraplex.errors import NotFoundError
from loraplex.service.schemas import FutureRef


class Tag(StrEnum):
    CREATE = "create"  # create_model
    CREATE_FROM = "restore"  # load_weights that creates the adapter from a checkpoint
    FORWARD = "fwd"  # forward_backward / forward: a protobuf ForwardBackwardOutput
    OPTIM = "optim"
    SAVE = "save"  # save_weights
    SAVE_SAMPLER = "sampler"  # save_weights_for_sampler (named)
    LOAD = "load"  # the deprecated load_state into an existing adapter
    SAMPLE = "sample"  # asample: a protobuf SampleResponse
    SAMPLING_SESSION = "ssave"  # the unnamed save_weights_for_sampler: answers the sampler's id (the id's extra part)


def future_out(tag: Tag, ref: FutureRef, extra: str | None = None) -> dict[str, Any]:
    """The UntypedAPIFuture a submit route answers; `extra` rides along in the id (`<tag>.<request_id>.<extra>`)."""
    suffix = f".{extra}" if extra is not None else ""
    return {"request_id": f"{tag.value}.{ref.request_id}{suffix}", "model_id": ref.model_id}


def sample_future_out(ref: FutureRef, num_samples: int) -> dict[str, Any]:
    """asample's future: with one sequence id per requested sample, in the response's order (the SDK requires them)."""
    return {
        "request_id": f"{Tag.SAMPLE.value}.{ref.request_id}",
        "sample_sequence_ids": [f"{ref.request_id}-{i}" for i in range(num_samples)],
    }


def parse_future_id(future_id: str) -> tuple[Tag, str, str | None]:
    """(tag, request_id, extra)."""
    tag, _, rest = future_id.partition(".")
    request_id, _, extra = rest.partition(".")
    try:
        return Tag(tag), request_id, extra or None
    except ValueError:
        raise NotFoundError(f"no request {future_id!r}") from None


def json_result(tag: Tag, model_id: str | None, result: dict[str, Any], extra: str | None = None) -> dict[str, Any]:
    """A stored result as the SDK's response model for its tag (every tag but the PROTO_TAGS)."""
    if tag is Tag.SAMPLING_SESSION:
        return {"path": result.get("path"), "sampling_session_id": extra, "type": "save_weights_for_sampler"}
    if tag is Tag.CREATE:
        return {"model_id": result.get("model_id", model_id), "type": "create_model"}
    if tag is Tag.CREATE_FROM:
        return {"model_id": result.get("model_id", model_id), "type": "load_weights"}
    if tag is Tag.OPTIM:
        return {"metrics": result.get("metrics") or {}}
    if tag is Tag.SAVE:
        return {"path": result["path"], "type": "save_weights"}
    if tag is Tag.SAVE_SAMPLER:
        return {"path": result["path"], "type": "save_weights_for_sampler"}
    if tag is Tag.LOAD:
        return {"path": result.get("path"), "model_id": model_id, "type": "load_weights"}
    raise AssertionError(f"{tag} has a protobuf result")  # PROTO_TAGS


PROTO_TAGS = frozenset({Tag.FORWARD, Tag.SAMPLE})


def proto_result(tag: Tag, result: dict[str, Any]) -> bytes:
    if tag is Tag.SAMPLE:
        return encode_sample_response(result)
    return encode_forward_backward_output(result)
