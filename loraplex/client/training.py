"""One adapter's training calls. Each call takes the next `seq_id`, so the server applies them in call order even
when they are sent concurrently; a retried call with the same seq_id is answered once."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from loraplex.client.futures import APIFuture
from loraplex.client.transport import Transport
from loraplex.client.types import AdamParams, Datum, datum_json


class TrainingClient:
    def __init__(self, transport: Transport, model_id: str, next_seq_id: int = 1) -> None:
        self._transport = transport
        self.model_id = model_id
        self._next_seq = next_seq_id
        self._lock = threading.Lock()

    def _take_seq(self) -> int:
        with self._lock:
            seq, self._next_seq = self._next_seq, self._next_seq + 1
            return seq

    def _fb_body(self, data: Sequence[Datum | dict[str, Any]], loss_fn: str, config: dict[str, float] | None) -> dict:
        return {
            "seq_id": self._take_seq(),
            "data": [datum_json(d) for d in data],
            "loss_fn": loss_fn,
            "loss_fn_config": config or {},
        }

    def _submit(self, path: str, body: dict[str, Any]) -> APIFuture:
        ref = self._transport.request("POST", f"/v1/adapters/{self.model_id}/{path}", json=body)
        return APIFuture(self._transport, ref["request_id"], ref["model_id"])

    async def _submit_async(self, path: str, body: dict[str, Any]) -> APIFuture:
        ref = await self._transport.request_async("POST", f"/v1/adapters/{self.model_id}/{path}", json=body)
        return APIFuture(self._transport, ref["request_id"], ref["model_id"])

    def forward_backward(
        self, data: Sequence[Datum | dict[str, Any]], loss_fn: str = "cross_entropy", loss_fn_config: dict | None = None
    ) -> APIFuture:
        """Accumulate gradients; the result holds per-datum `logprobs` and `metrics["loss:sum"]`."""
        return self._submit("forward_backward", self._fb_body(data, loss_fn, loss_fn_config))

    def forward(
        self, data: Sequence[Datum | dict[str, Any]], loss_fn: str = "cross_entropy", loss_fn_config: dict | None = None
    ) -> APIFuture:
        """Outputs and loss only; no gradient."""
        return self._submit("forward", self._fb_body(data, loss_fn, loss_fn_config))

    def optim_step(self, adam_params: AdamParams | dict[str, float] | None = None) -> APIFuture:
        """Apply the accumulated gradients with AdamW and clear them."""
        params = adam_params.to_json() if isinstance(adam_params, AdamParams) else dict(adam_params or {})
        return self._submit("optim_step", {"seq_id": self._take_seq(), "adam_params": params})

    async def forward_backward_async(
        self, data: Sequence[Datum | dict[str, Any]], loss_fn: str = "cross_entropy", loss_fn_config: dict | None = None
    ) -> APIFuture:
        return await self._submit_async("forward_backward", self._fb_body(data, loss_fn, loss_fn_config))

    async def forward_async(
        self, data: Sequence[Datum | dict[str, Any]], loss_fn: str = "cross_entropy", loss_fn_config: dict | None = None
    ) -> APIFuture:
        return await self._submit_async("forward", self._fb_body(data, loss_fn, loss_fn_config))

    async def optim_step_async(self, adam_params: AdamParams | dict[str, float] | None = None) -> APIFuture:
        params = adam_params.to_json() if isinstance(adam_params, AdamParams) else dict(adam_params or {})
        return await self._submit_async("optim_step", {"seq_id": self._take_seq(), "adam_params": params})

    def info(self) -> dict[str, Any]:
        return self._transport.request("GET", f"/v1/adapters/{self.model_id}")

    def delete(self) -> dict[str, Any]:
        ref = self._transport.request("DELETE", f"/v1/adapters/{self.model_id}")
        return APIFuture(self._transport, ref["request_id"], ref["model_id"]).result()
