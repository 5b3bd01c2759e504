"""Tinker futures: the id the SDK polls, and what `retrieve_future` answers for each kind of request.

A Tinker future id is `<tag>.<request_id>`: the tag says which Tinker response type the stored result becomes, so
`retrieve_future` needs no per-request state beyond what the native futures have (the owner key and the result).
A tag a caller made up changes nothing but how its own result is shaped; ownership is checked on the request id.
Pure: no services."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from loraplex.api.schemas import FutureRef
from loraplex.api.tinker.codec import encode_forward_backward_output
from loraplex.errors import NotFoundError


class Tag(StrEnum):
    CREATE = "create"  # create_model
    CREATE_FROM = "restore"  # load_weights that creates the adapter from a checkpoint
    FORWARD = "fwd"  # forward_backward / forward: a protobuf ForwardBackwardOutput
    OPTIM = "optim"
    SAVE = "save"  # save_weights
    SAVE_SAMPLER = "sampler"  # save_weights_for_sampler (named)
    LOAD = "load"  # the deprecated load_state into an existing adapter


def future_out(tag: Tag, ref: FutureRef) -> dict[str, Any]:
    """The UntypedAPIFuture a submit route answers."""
    return {"request_id": f"{tag.value}.{ref.request_id}", "model_id": ref.model_id}


def parse_future_id(future_id: str) -> tuple[Tag, str]:
    tag, _, request_id = future_id.partition(".")
    try:
        return Tag(tag), request_id
    except ValueError:
        raise NotFoundError(f"no request {future_id!r}") from None


def json_result(tag: Tag, model_id: str | None, result: dict[str, Any]) -> dict[str, Any]:
    """A stored result as the SDK's response model for its tag (every tag but FORWARD)."""
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
    raise AssertionError(f"{tag} has a protobuf result")


def proto_result(result: dict[str, Any]) -> bytes:
    return encode_forward_backward_output(result)
