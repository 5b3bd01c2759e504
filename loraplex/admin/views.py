"""The admin's views over the database (sqladmin ModelViews: search, filters, sorting) and its actions.

Every view is read-only as a form: rows change only through actions, and actions go through the same code the API
uses, so the gateway's rules hold (deleting an adapter queues its delete like a tenant's call; a checkpoint's TTL is
set by `service.set_checkpoint_ttl`; an expired checkpoint is deleted by `service.delete_checkpoints`, files too).
Issuing an API key shows the key once on a page that is not cached; only its hash is stored."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from sqladmin import BaseView, ModelView, action, expose
from sqladmin.filters import AllUniqueStringValuesFilter
from sqladmin.flash import Flash, FlashLevel
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from loraplex.errors import LoraplexError
from loraplex.service import adapters as adapter_service
from loraplex.service import checkpoints as checkpoint_service
from loraplex.service import pipelines as pipeline_service
from loraplex.service.context import Services, TenantRef
from loraplex.storage.models import Adapter, ApiKey, Checkpoint, Pipeline, Pool, Residency, Tenant, Usage
from loraplex.storage.repositories import TenantRepository, unit_of_work

GetServices = Callable[[], Services]


class ServicesRef:
    """How a view reaches the gateway's Services (built in the app's lifespan, after the views are mounted)."""

    def __init__(self, get: GetServices) -> None:
        self.get = get


def _pks(request: Request) -> list[str]:
    return [pk for pk in request.query_params.get("pks", "").split(",") if pk]


def _back(request: Request, identity: str) -> RedirectResponse:
    return RedirectResponse(request.url_for("admin:list", identity=identity), status_code=302)


def _no_store(response: Response) -> Response:
    response.headers["Cache-Control"] = "no-store, no-cache, must-revalidate, max-age=0"
    response.headers["Pragma"] = "no-cache"
    return response


class _ReadOnly(ModelView):
    """Rows are looked at here; they change through actions only."""

    can_create = False
    can_edit = False
    can_delete = False
    can_export = False
    page_size = 25
    wiring: ClassVar[ServicesRef]  # set by admin/app.py

    @classmethod
    def services(cls) -> Services:
        return cls.wiring.get()

    @classmethod
    def _tenant(cls, tenant_id: str) -> TenantRef:
        with cls.services().sessions() as db:
            tenant = TenantRepository(db).get(tenant_id)
            return TenantRef(tenant.id, tenant.name)

    @classmethod
    def _owner(cls, model: Any, pk: str, what: str) -> TenantRef:
        """The tenant owning row `pk` of `model` (a model with a tenant_id), LoraplexError if there is no such row."""
        with cls.services().sessions() as db:
            row = db.get(model, pk)
            if row is None:
                raise LoraplexError(f"{what} {pk!r} not found")
            tenant_id = row.tenant_id
        return cls._tenant(tenant_id)

    async def _each(self, request: Request, what: str, act: Callable[[str], Any]) -> RedirectResponse:
        return await _for_each(request, _pks(request), what, act, self.identity)


async def _for_each(
    request: Request, pks: list[str], what: str, act: Callable[[str], Any], back: str
) -> RedirectResponse:
    """Run `act(pk)` for each selected row in a worker thread; one flash line per outcome; back to the list."""
    done, failed = 0, []
    for pk in pks:
        try:
            await run_in_threadpool(act, pk)
            done += 1
        except LoraplexError as exc:
            failed.append(f"{pk}: {exc.message}")
    if done:
        Flash.flash(request, f"{what}: {done} done", FlashLevel.success)
    for line in failed:
        Flash.flash(request, line, FlashLevel.error, what)
    return _back(request, back)


class TenantAdmin(_ReadOnly, model=Tenant):
    name_plural = "Tenants"
    icon = "fa-solid fa-users"
    column_list = [Tenant.name, Tenant.id, Tenant.weight, Tenant.created_at]
    column_searchable_list = [Tenant.name, Tenant.id]
    column_sortable_list = [Tenant.name, Tenant.weight, Tenant.created_at]
    column_default_sort = [(Tenant.name, False)]

    @action("issue_key", "Issue an API key", "A new key for the selected tenant, shown once.", add_in_list=False)
    async def issue_key(self, request: Request) -> Response:
        pks = _pks(request)
        if len(pks) != 1:
            Flash.flash(request, "select one tenant to issue a key for", FlashLevel.warning)
            return _back(request, self.identity)

        def issue() -> str:
            with unit_of_work(self.services().sessions) as db:
                return TenantRepository(db).issue_key(pks[0])

        try:
            key = await run_in_threadpool(issue)
        except LoraplexError as exc:
            Flash.flash(request, exc.message, FlashLevel.error)
            return _back(request, self.identity)
        page = await self.templates.TemplateResponse(
            request,
            "loraplex/new_key.html",
            {"key": key, "tenant_id": pks[0], "back": str(_back(request, "api-key").headers["location"])},
        )
        return _no_store(page)


class ApiKeyAdmin(_ReadOnly, model=ApiKey):
    name = "API key"
    name_plural = "API keys"
    icon = "fa-solid fa-key"
    column_list = [ApiKey.prefix, ApiKey.tenant_id, ApiKey.created_at, ApiKey.revoked_at, ApiKey.id]
    column_searchable_list = [ApiKey.prefix, ApiKey.tenant_id]
    column_sortable_list = [ApiKey.created_at, ApiKey.revoked_at]
    column_default_sort = [(ApiKey.created_at, True)]
    column_details_exclude_list = [ApiKey.key_hash]

    @action("revoke", "Revoke", "Revoke the selected keys? Clients using them get 401 from now on.")
    async def revoke(self, request: Request) -> Response:
        def revoke(key_id: str) -> None:
            with unit_of_work(self.services().sessions) as db:
                key = db.get(ApiKey, key_id)
                if key is None:
                    raise LoraplexError(f"API key {key_id!r} not found")
                TenantRepository(db).revoke_key(key.tenant_id, key_id)

        return await self._each(request, "revoke", revoke)


class AdapterAdmin(_ReadOnly, model=Adapter):
    icon = "fa-solid fa-layer-group"
    column_list = [Adapter.model_id, Adapter.tenant_id, Adapter.status, Adapter.rank, Adapter.alpha,
                   Adapter.applied_seq_id, Adapter.base_model, Adapter.created_at, Adapter.last_used_at]  # fmt: skip
    column_searchable_list = [Adapter.model_id, Adapter.tenant_id]
    column_sortable_list = [Adapter.created_at, Adapter.last_used_at, Adapter.rank, Adapter.applied_seq_id]
    column_default_sort = [(Adapter.created_at, True)]
    column_filters = [AllUniqueStringValuesFilter(Adapter.status), AllUniqueStringValuesFilter(Adapter.base_model)]

    @action("delete_adapter", "Delete", "Delete the selected adapters? Their pool frees them (through the queue).")
    async def delete_adapter(self, request: Request) -> Response:
        def delete(model_id: str) -> None:
            adapter_service.delete_adapter(self.services(), self._owner(Adapter, model_id, "adapter"), model_id)

        return await self._each(request, "delete", delete)


class CheckpointAdmin(_ReadOnly, model=Checkpoint):
    icon = "fa-solid fa-floppy-disk"
    column_list = [Checkpoint.model_id, Checkpoint.kind, Checkpoint.name, Checkpoint.step, Checkpoint.size_bytes,
                   Checkpoint.created_at, Checkpoint.expires_at, Checkpoint.tenant_id]  # fmt: skip
    column_searchable_list = [Checkpoint.model_id, Checkpoint.name, Checkpoint.tenant_id]
    column_sortable_list = [Checkpoint.created_at, Checkpoint.expires_at, Checkpoint.size_bytes, Checkpoint.step]
    column_default_sort = [(Checkpoint.created_at, True)]
    column_filters = [AllUniqueStringValuesFilter(Checkpoint.kind)]

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

        return await self._each(request, "expire", expire)

    @action("set_ttl", "Set TTL", add_in_list=True)
    async def set_ttl(self, request: Request) -> Response:
        """A form for the TTL (it posts to CheckpointTtl below, which applies it)."""
        return await self.templates.TemplateResponse(
            request, "loraplex/checkpoint_ttl.html", {"pks": ",".join(_pks(request)), "count": len(_pks(request))}
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
            return _back(request, "checkpoint")
        pks = [pk for pk in str(form.get("pks") or "").split(",") if pk]

        def set_ttl(checkpoint_id: str) -> None:
            tenant, path = CheckpointAdmin._path(checkpoint_id)
            checkpoint_service.set_checkpoint_ttl(CheckpointAdmin.services(), tenant, path, ttl)

        return await _for_each(request, pks, "TTL", set_ttl, "checkpoint")


class ResidencyAdmin(_ReadOnly, model=Residency):
    name_plural = "Residency"
    icon = "fa-solid fa-microchip"
    column_list = [Residency.model_id, Residency.pool, Residency.rank, Residency.tier, Residency.slot,
                   Residency.location, Residency.updated_at]  # fmt: skip
    column_searchable_list = [Residency.model_id]
    column_sortable_list = [Residency.updated_at, Residency.slot, Residency.pool]
    column_filters = [AllUniqueStringValuesFilter(Residency.pool), AllUniqueStringValuesFilter(Residency.tier)]


class PoolAdmin(_ReadOnly, model=Pool):
    icon = "fa-solid fa-server"
    column_list = [Pool.name, Pool.state, Pool.base_model, Pool.world_size, Pool.slots, Pool.heartbeat_at,
                   Pool.started_at, Pool.leader_token]  # fmt: skip
    column_searchable_list = [Pool.name, Pool.base_model]
    column_sortable_list = [Pool.name, Pool.heartbeat_at]


class UsageAdmin(_ReadOnly, model=Usage):
    name_plural = "Usage"
    icon = "fa-solid fa-gauge"
    column_list = [Usage.created_at, Usage.tenant_id, Usage.model_id, Usage.kind, Usage.tokens, Usage.seconds]
    column_searchable_list = [Usage.tenant_id, Usage.model_id]
    column_sortable_list = [Usage.created_at, Usage.tokens, Usage.seconds]
    column_default_sort = [(Usage.created_at, True)]
    column_filters = [AllUniqueStringValuesFilter(Usage.kind)]


class PipelineAdmin(_ReadOnly, model=Pipeline):
    icon = "fa-solid fa-diagram-project"
    column_list = [Pipeline.name, Pipeline.tenant_id, Pipeline.state, Pipeline.step, Pipeline.total_steps,
                   Pipeline.attempt, Pipeline.sweep_id, Pipeline.created_at, Pipeline.finished_at, Pipeline.id]  # fmt: skip
    column_searchable_list = [Pipeline.name, Pipeline.tenant_id, Pipeline.sweep_id, Pipeline.id]
    column_sortable_list = [Pipeline.created_at, Pipeline.finished_at, Pipeline.step, Pipeline.name]
    column_default_sort = [(Pipeline.created_at, True)]
    column_filters = [AllUniqueStringValuesFilter(Pipeline.state)]

    @action("cancel_pipeline", "Cancel", "Cancel the selected pipelines? They stop after their current step.")
    async def cancel_pipeline(self, request: Request) -> Response:
        def cancel(pipeline_id: str) -> None:
            tenant = self._owner(Pipeline, pipeline_id, "pipeline")
            pipeline_service.cancel_pipeline(self.services(), tenant, pipeline_id)

        return await self._each(request, "cancel", cancel)


MODEL_VIEWS: tuple[type[_ReadOnly], ...] = (
    TenantAdmin, ApiKeyAdmin, AdapterAdmin, CheckpointAdmin, ResidencyAdmin, PoolAdmin, UsageAdmin, PipelineAdmin,
)  # fmt: skip
