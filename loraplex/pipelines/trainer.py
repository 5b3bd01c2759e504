"""One pipeline adapter trained through the service layer, as a tenant's client would through the gateway: the same
calls (service/: create, forward_backward, forward, optim_step, save, delete) with the same checks and quotas, so
its steps are queued with every other tenant's and coalesce with them. It numbers its steps itself (seq_id from 1,
the idempotency key: a call sent twice is answered once) and waits for each result on the result store."""

from __future__ import annotations

from typing import Any

from loraplex import service
from loraplex.errors import FutureTimeoutError
from loraplex.protocol.results import CreateResult, R
from loraplex.service import Services, TenantRef
from loraplex.service.schemas import (
    CreateAdapterRequest,
    ForwardBackwardRequest,
    FutureRef,
    OptimStepRequest,
    SaveCheckpointRequest,
)


class ServiceTrainer:
    def __init__(self, services: Services, tenant: TenantRef, model_id: str, timeout_s: float) -> None:
        self.services, self.tenant, self.model_id = services, tenant, model_id
        self.timeout_s = timeout_s
        self._next_seq = 1

    @classmethod
    def create(
        cls, services: Services, tenant: TenantRef, model_id: str, timeout_s: float, *,
        rank: int, alpha: float | None, seed: int, metadata: dict[str, Any],
    ) -> ServiceTrainer:  # fmt: skip
        """A new adapter named `model_id` from its seed (sent again under the same id, it answers the first one)."""
        fields: dict[str, Any] = {"rank": rank, "seed": seed, "user_metadata": metadata}
        if alpha is not None:
            fields["alpha"] = alpha
        request = CreateAdapterRequest.model_validate(fields)
        trainer = cls(services, tenant, model_id, timeout_s)
        trainer.wait(service.create_adapter(services, tenant, request, model_id=model_id), CreateResult)
        return trainer

    @classmethod
    def from_checkpoint(
        cls, services: Services, tenant: TenantRef, model_id: str, timeout_s: float, *, path: str,
        metadata: dict[str, Any],
    ) -> ServiceTrainer:  # fmt: skip
        """A new adapter named `model_id` with the weights and Adam state of the tenant's checkpoint `path`."""
        request = CreateAdapterRequest.model_validate(
            {"from_checkpoint": path, "with_optimizer": True, "user_metadata": metadata}
        )
        trainer = cls(services, tenant, model_id, timeout_s)
        trainer.wait(service.create_adapter(services, tenant, request, model_id=model_id), CreateResult)
        return trainer

    def _seq(self) -> int:
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        return seq

    def forward_backward(self, data: list[dict[str, Any]]) -> FutureRef:
        request = ForwardBackwardRequest.model_validate({"seq_id": self._seq(), "data": data})
        return service.forward_backward(self.services, self.tenant, self.model_id, request.seq_id, request.payload())

    def forward(self, data: list[dict[str, Any]]) -> FutureRef:
        request = ForwardBackwardRequest.model_validate({"seq_id": self._seq(), "data": data})
        return service.forward(self.services, self.tenant, self.model_id, request.seq_id, request.payload())

    def optim_step(self, adam_params: dict[str, float]) -> FutureRef:
        request = OptimStepRequest.model_validate({"seq_id": self._seq(), "adam_params": adam_params})
        return service.optim_step(self.services, self.tenant, self.model_id, request.seq_id, request.payload())

    def save_state(self, name: str, ttl_seconds: int | None) -> FutureRef:
        body = {"seq_id": self._seq(), "name": name, "ttl_seconds": ttl_seconds, "overwrite": True}
        request = SaveCheckpointRequest.model_validate(body)
        return service.save_state(self.services, self.tenant, self.model_id, request)

    def save_weights_for_sampler(self, name: str) -> FutureRef:
        request = SaveCheckpointRequest.model_validate({"seq_id": self._seq(), "name": name, "overwrite": True})
        return service.save_weights_for_sampler(self.services, self.tenant, self.model_id, request)

    def wait(self, ref: FutureRef, expect: type[R]) -> R:
        """The request's result, of the type `expect` (protocol/results.py), or its error raised as the typed error it
        was (FutureTimeoutError past the step timeout: the pool is down or far behind)."""
        outcome = self.services.results.wait(ref.request_id, self.timeout_s)
        if outcome is None:
            raise FutureTimeoutError(
                f"request {ref.request_id} of adapter {self.model_id} not answered within {self.timeout_s:g} s "
                "(LORAPLEX_PIPELINE_STEP_TIMEOUT_SECONDS)", ref.request_id,
            )  # fmt: skip
        if not outcome.ok:
            raise outcome.exception()
        assert outcome.result is not None
        return outcome.result.expect(expect)

    def delete(self) -> None:
        """Delete the adapter through the queue (its checkpoints stay); not waited for."""
        service.delete_adapter(self.services, self.tenant, self.model_id)
