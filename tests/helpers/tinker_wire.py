"""Request bodies exactly as the Tinker SDK sends them (its own types and protobuf encoder), for gateway tests."""

from __future__ import annotations

from typing import Any

from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto


def text_datum(tokens: list[int], **inputs: Any) -> types.Datum:
    """A next-token datum: model_input tokens[:-1], target_tokens tokens[1:], plus any other loss_fn_inputs."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:], **inputs}
    )


def forward_backward_body(
    model_id: str,
    seq_id: int,
    data: list[types.Datum] | None = None,
    loss_fn: str = "cross_entropy",
    loss_fn_config: dict[str, Any] | None = None,
    forward_only: bool = False,
) -> bytes:
    """The SDK's protobuf ForwardBackwardRequest body (one 3-token datum by default)."""
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=data if data is not None else [text_datum([1, 2, 3, 4])], loss_fn=loss_fn, loss_fn_config=loss_fn_config
        ),
        model_id=model_id,
        seq_id=seq_id,
    )
    msg = forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    return msg.SerializeToString()
