"""The admin's views over the database (sqladmin ModelViews: search, filters, sorting) and their actions; the tenant
and key views and the operator controls are admin/tenant_views.py, what they share admin/view_base.py.

Every view is read-only as a form: rows change only through actions, and actions go through the same code the API
uses, so the gateway's rules hold (deleting an adapter queues its delete like a tenant's call; a checkpoint's TTL is
set by `service.set_checkpoint_ttl`; an expired checkpoint is deleted by `service.delete_checkpoints`, files too).
Each action that changes something writes an audit entry (service/audit.py). Lists name a row's tenant (linked to
its page), cut long ids (the whole id on hover and on the details page), and write times to the second and sizes
in KiB/MiB/GiB (admin/formatting.py), so they fit a 1366 px screen."""

from __future__ import annotations

from typing import Any

from sqladmin import BaseView, action, expose
from sqladmin.filters import AllUniqueStringValuesFilter
from sqladmin.flash import Flash, FlashLevel
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from loraplex.admin.formatting import format_count, format_seconds, format_size, short_id
from loraplex.admin.tenant_views import ApiKeyAdmin, AuditAdmin, TenantAdmin
from loraplex.admin.view_base import (
    GetServices,
    ReadOnlyView,
    ServicesRef,
    back_to,
    details_link,
    for_each,
    pks_of,
    short_cell,
    tenant_cell,
)
from loraplex.errors import LoraplexError
from loraplex.service import adapters as adapter_service
from loraplex.service import checkpoints as checkpoint_service
from loraplex.service import pipelines as pipeline_service
from loraplex.service.context import TenantRef
from loraplex.service.tenant_overview import adapter_checkpoints
from loraplex.storage.models import Adapter, Checkpoint, Pipeline, Pool, Residency, Usage

__all__ = ["MODEL_VIEWS", "CheckpointTtl", "GetServices", "ServicesRef"]


def adapter_cell(model: Any, _attr: str, request: Request | None = None) -> Any:
    """A row's adapter (its model_id), cut, linked to the adapter's page."""
    if model.model_id is None:
        return ""
    return details_link(request, "adapter", model.model_id, short_id(model.model_id), model.model_id)


class AdapterAdmin(ReadOnlyView, model=Adapter):
    icon = "fa-solid fa-layer-group"
    column_list = [Adapter.model_id, "tenant", Adapter.status, Adapter.rank, Adapter.applied_seq_id,
                   Adapter.base_model, Adapter.created_at, Adapter.last_used_at]  # fmt: skip
    column_details_list = [Adapter.model_id, "tenant", Adapter.status, Adapter.base_model, Adapter.pool, Adapter.rank,
                           Adapter.alpha, Adapter.target_modules, Adapter.seed, Adapter.applied_seq_id,
                           Adapter.session_id, Adapter.user_metadata, Adapter.created_at, Adapter.last_used_at]  # fmt: skip
    column_labels = {Adapter.applied_seq_id: "applied seq", Adapter.last_used_at: "last used"}
    column_searchable_list = [Adapter.model_id, "tenant.name", Adapter.tenant_id]
    column_sortable_list = [Adapter.created_at, Adapter.last_used_at, Adapter.rank, Adapter.applied_seq_id]
    column_default_sort = [(Adapter.created_at, True)]
    column_filters = [AllUniqueStringValuesFilter(Adapter.status), AllUniqueStringValuesFilter(Adapter.base_model)]
    column_formatters = {Adapter.model_id: short_cell("model_id"), "tenant": tenant_cell}
    column_formatters_detail = {"tenant": tenant_cell}
    details_template = "loraplex/adapter_details.html"

    async def details_context(self, request: Request) -> dict[str, Any]:
        checkpoints = await run_in_threadpool(adapter_checkpoints, self.services(), request.path_params["pk"])
        return {"checkpoints": checkpoints, "format_size": format_size}

    @action("delete_adapter", "Delete", "Delete the selected adapters? Their pool frees them (through the queue).")
    async def delete_adapter(self, request: Request) -> Response:
        def delete(model_id: str) -> None:
            adapter_service.delete_adapter(self.services(), self._owner(Adapter, model_id, "adapter"), model_id)

        return await self._each(request, "delete adapter", delete, "adapter")


class CheckpointAdmin(ReadOnlyView, model=Checkpoint):
    icon = "fa-solid fa-floppy-disk"
    column_list = [Checkpoint.name, Checkpoint.kind, Checkpoint.model_id, "tenant", Checkpoint.step,
                   Checkpoint.size_bytes, Checkpoint.created_at, Checkpoint.expires_at]  # fmt: skip
    column_details_list = [Checkpoint.name, Checkpoint.kind, Checkpoint.model_id, "tenant", Checkpoint.step,
                           Checkpoint.size_bytes, Checkpoint.sha256, Checkpoint.blob_uri, Checkpoint.created_at,
                           Checkpoint.expires_at, Checkpoint.id]  # fmt: skip
    column_labels = {Checkpoint.model_id: "adapter", Checkpoint.size_bytes: "size"}
    column_searchable_list = [Checkpoint.model_id, Checkpoint.name, "tenant.name", Checkpoint.tenant_id]
    column_sortable_list = [Checkpoint.created_at, Checkpoint.expires_at, Checkpoint.size_bytes, Checkpoint.step]
    column_default_sort = [(Checkpoint.created_at, True)]
    column_filters = [AllUniqueStringValuesFilter(Checkpoint.kind)]
    column_formatters = {Checkpoint.model_id: adapter_cell, "tenant": tenant_cell,
                         Checkpoint.size_bytes: lambda m, a: format_size(m.size_bytes)}  # fmt: skip
    column_formatters_detail = {Checkpoint.model_id: adapter_cell, "tenant": tenant_cell,
                                Checkpoint.size_bytes: lambda m, a: f"{format_size(m.size_bytes)} ({m.size_bytes:,} bytes)"}  # fmt: skip

    @classmethod
    def _path(cls, checkpoint_id: str) -> tuple[TenantRef, str]:
        with cls.services().sessions() as db:
            row = db.get(Checkpoint, checkpoint_id)
            if row is None:
                raise LoraplexError(f"checkpoint {checkpoint_id!r} not found")
            tenant_id, path = row.tenant_id, checkpoint_service.checkpoint_out(row).tinker_path
        return cls._tenant(tenant_id), path

    @action("expire", "Expire now", "Delete the selected checkpoints and their files now?")
    async def expire(self, request: Request) -> Response:
        def expire(checkpoint_id: str) -> None:
            tenant, path = self._path(checkpoint_id)
            checkpoint_service.delete_checkpoints(self.services(), tenant, [path])

        return await self._each(request, "expire checkpoint", expire, "checkpoint")

    @action("set_ttl", "Set TTL", add_in_list=True)
    async def set_ttl(self, request: Request) -> Response:
        """A form for the TTL (it posts to CheckpointTtl below, which applies it)."""
        return await self.templates.TemplateResponse(
            request, "loraplex/checkpoint_ttl.html", {"pks": ",".join(pks_of(request)), "count": len(pks_of(request))}
        )


class CheckpointTtl(BaseView):
    """Applies the TTL form (POST): `service.set_checkpoint_ttl` per checkpoint; empty = never expires."""

    name = "Checkpoint TTL"
    identity = "checkpoint-ttl"

    def is_visible(self, request: Request) -> bool:
        return False  # a form target, not a page of the menu

    @expose("/checkpoint-ttl", methods=["POST"], identity="checkpoint-ttl")
    async def apply(self, request: Request) -> Response:
        form = await request.form()
        raw = str(form.get("ttl_seconds") or "").strip()
        try:
            ttl: int | None = int(raw) if raw else None
        except ValueError:
            Flash.flash(request, f"TTL must be a whole number of seconds, got {raw[:40]!r}", FlashLevel.error)
            return back_to(request, "checkpoint")
        pks = [pk for pk in str(form.get("pks") or "").split(",") if pk]

        def set_ttl(checkpoint_id: str) -> None:
            tenant, path = CheckpointAdmin._path(checkpoint_id)
            checkpoint_service.set_checkpoint_ttl(CheckpointAdmin.services(), tenant, path, ttl)

        detail = "never expires" if ttl is None else f"expires in {ttl} s"
        services = CheckpointAdmin.services()
        return await for_each(request, services, pks, "set TTL", set_ttl, "checkpoint", "checkpoint", detail)


class ResidencyAdmin(ReadOnlyView, model=Residency):
    name_plural = "Residency"
    icon = "fa-solid fa-microchip"
    column_list = [Residency.model_id, Residency.pool, Residency.rank, Residency.tier, Residency.slot,
                   Residency.location, Residency.updated_at]  # fmt: skip
    column_searchable_list = [Residency.model_id]
    column_sortable_list = [Residency.updated_at, Residency.slot, Residency.pool]
    column_filters = [AllUniqueStringValuesFilter(Residency.pool), AllUniqueStringValuesFilter(Residency.tier)]
    column_formatters = {Residency.model_id: adapter_cell, Residency.location: lambda m, a: short_id(m.location, 40)}


class PoolAdmin(ReadOnlyView, model=Pool):
    icon = "fa-solid fa-server"
    column_list = [Pool.name, Pool.state, Pool.draining, Pool.base_model, Pool.world_size, Pool.slots,
                   Pool.heartbeat_at, Pool.started_at, Pool.leader_token]  # fmt: skip
    column_searchable_list = [Pool.name, Pool.base_model]
    column_sortable_list = [Pool.name, Pool.heartbeat_at]


class UsageAdmin(ReadOnlyView, model=Usage):
    name_plural = "Usage"
    icon = "fa-solid fa-gauge"
    column_list = [Usage.created_at, "tenant", Usage.model_id, Usage.kind, Usage.tokens, Usage.seconds]
    column_labels = {Usage.model_id: "adapter"}
    column_searchable_list = ["tenant.name", Usage.tenant_id, Usage.model_id]
    column_sortable_list = [Usage.created_at, Usage.tokens, Usage.seconds]
    column_default_sort = [(Usage.created_at, True)]
    column_filters = [AllUniqueStringValuesFilter(Usage.kind)]
    column_formatters = {"tenant": tenant_cell, Usage.model_id: adapter_cell,
                         Usage.tokens: lambda m, a: format_count(m.tokens),
                         Usage.seconds: lambda m, a: format_seconds(m.seconds)}  # fmt: skip
    column_formatters_detail = {"tenant": tenant_cell, Usage.model_id: adapter_cell}


class PipelineAdmin(ReadOnlyView, model=Pipeline):
    icon = "fa-solid fa-diagram-project"
    column_list = [Pipeline.name, "tenant", Pipeline.state, Pipeline.step, Pipeline.total_steps, Pipeline.attempt,
                   Pipeline.created_at, Pipeline.finished_at, Pipeline.id]  # fmt: skip
    column_searchable_list = [Pipeline.name, "tenant.name", Pipeline.tenant_id, Pipeline.sweep_id, Pipeline.id]
    column_sortable_list = [Pipeline.created_at, Pipeline.finished_at, Pipeline.step, Pipeline.name]
    column_default_sort = [(Pipeline.created_at, True)]
    column_filters = [AllUniqueStringValuesFilter(Pipeline.state)]
    column_formatters = {"tenant": tenant_cell, Pipeline.id: short_cell("id")}
    column_formatters_detail = {"tenant": tenant_cell, Pipeline.model_id: adapter_cell}

    @action("cancel_pipeline", "Cancel", "Cancel the selected pipelines? They stop after their current step.")
    async def cancel_pipeline(self, request: Request) -> Response:
        def cancel(pipeline_id: str) -> None:
            tenant = self._owner(Pipeline, pipeline_id, "pipeline")
            pipeline_service.cancel_pipeline(self.services(), tenant, pipeline_id)

        return await self._each(request, "cancel pipeline", cancel, "pipeline")


MODEL_VIEWS: tuple[type[ReadOnlyView] | type[AuditAdmin], ...] = (
    TenantAdmin, ApiKeyAdmin, AdapterAdmin, CheckpointAdmin, ResidencyAdmin, PoolAdmin, UsageAdmin, PipelineAdmin,
    AuditAdmin,
)  # fmt: skip
