"""The admin's tenant pages and the operator controls on them (service/tenant_controls.py does the work and writes
the audit entry): suspend, drain, resume, weight and quotas, issue an API key (named, shown once) and revoke one; the
API keys list; the audit log. A tenant's page shows what belongs to it (service/tenant_overview.py): its keys, its
adapters, its usage totals, its checkpoints' holdings and what it has queued."""

from __future__ import annotations

from typing import Any

from markupsafe import Markup
from sqladmin import ModelView, action, expose
from sqladmin.filters import AllUniqueStringValuesFilter
from sqladmin.flash import Flash, FlashLevel
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from loraplex.admin.actor import acting_admin
from loraplex.admin.formatting import badge, format_count, short_id
from loraplex.admin.view_base import (
    TYPE_FORMATTERS,
    ReadOnlyView,
    ServicesRef,
    back_to,
    details_link,
    no_store,
    pks_of,
    tenant_cell,
)
from loraplex.errors import LoraplexError
from loraplex.service import tenant_controls, tenant_rules
from loraplex.service.audit import recent_admin_actions
from loraplex.service.context import TenantQuotas
from loraplex.service.tenant_overview import tenant_overview
from loraplex.storage.enums import TenantState
from loraplex.storage.models import AdminAuditEntry, ApiKey, Tenant
from loraplex.storage.repositories import TenantRepository

STATE_TONES = {TenantState.ACTIVE: "green", TenantState.SUSPENDED: "red", TenantState.DRAINING: "orange"}
QUOTA_FIELDS = (  # (column, label, the setting it overrides)
    ("max_queued_requests", "Max queued requests", "max_queued_requests_per_tenant"),
    ("max_queued_tokens", "Max queued tokens", "max_queued_tokens_per_tenant"),
    ("max_adapters", "Max adapters", "max_adapters_per_tenant"),
)


def state_cell(model: Any, _attr: str) -> Markup:
    state = TenantState(model.state)
    return badge(state.value, STATE_TONES[state], model.state_reason)


def quota_cell(column: str, setting: str) -> Any:
    """A tenant's own quota, or the setting's as its default; 0 reads "no limit"."""

    def cell(model: Any, _attr: str) -> str:
        own = getattr(model, column)
        default = getattr(TenantAdmin.services().settings, setting)
        shown = "no limit" if (own if own is not None else default) == 0 else format_count(own if own is not None else default)
        return f"default ({shown})" if own is None else shown

    return cell


class TenantAdmin(ReadOnlyView, model=Tenant):
    name_plural = "Tenants"
    icon = "fa-solid fa-users"
    column_list = [Tenant.name, Tenant.state, Tenant.weight, Tenant.created_at, Tenant.id]
    column_details_list = [Tenant.name, Tenant.id, Tenant.state, Tenant.state_reason, Tenant.state_changed_at,
                           Tenant.weight, Tenant.max_queued_requests, Tenant.max_queued_tokens, Tenant.max_adapters,
                           Tenant.created_at]  # fmt: skip
    column_labels = {Tenant.state_reason: "reason", Tenant.state_changed_at: "state since"}
    column_searchable_list = [Tenant.name, Tenant.id]
    column_sortable_list = [Tenant.name, Tenant.weight, Tenant.created_at, Tenant.state]
    column_default_sort = [(Tenant.name, False)]
    column_filters = [AllUniqueStringValuesFilter(Tenant.state)]
    column_formatters = {Tenant.state: state_cell, Tenant.id: lambda m, a: short_id(m.id)}
    column_formatters_detail = {"state": state_cell, **{c: quota_cell(c, setting) for c, _, setting in QUOTA_FIELDS}}
    details_template = "loraplex/tenant_details.html"

    async def details_context(self, request: Request) -> dict[str, Any]:
        tenant_id = request.path_params["pk"]
        services = self.services()
        overview = await run_in_threadpool(tenant_overview, services, tenant_id)
        audit = await run_in_threadpool(recent_admin_actions, services, 20, tenant_id)
        return {"overview": overview, "audit": audit}

    # -- the controls: a form for each (its POST lands on an `expose` below), resume by confirmation ----------------

    def _one(self, request: Request) -> str | None:
        pks = pks_of(request)
        if len(pks) != 1:
            Flash.flash(request, "select one tenant", FlashLevel.warning)
            return None
        return pks[0]

    async def _form(self, request: Request, tenant_id: str, form: dict[str, Any]) -> Response:
        tenant = await run_in_threadpool(self._read, tenant_id)
        context = {"tenant": tenant, "form": form, "tenant_id": tenant_id}
        return await self.templates.TemplateResponse(request, "loraplex/tenant_control.html", context)

    def _read(self, tenant_id: str) -> Tenant:
        with self.services().sessions() as db:
            tenant = TenantRepository(db).get(tenant_id)
            db.expunge(tenant)
            return tenant

    def _reason_form(self, request: Request, verb: str, explain: str) -> dict[str, Any]:
        return {"action": str(request.url_for("admin:view-tenant-apply_state")), "verb": verb, "explain": explain,
                "fields": [("reason", "Reason (the tenant's clients are told it)", "", "text")]}  # fmt: skip

    @action("issue_key", "Issue an API key", add_in_list=False)
    async def issue_key(self, request: Request) -> Response:
        tenant_id = self._one(request)
        if tenant_id is None:
            return back_to(request, self.identity)
        form = {"action": str(request.url_for("admin:view-tenant-apply_key")), "verb": "issue",
                "explain": "The key is shown once, on the next page.",
                "fields": [("name", "Key name (optional; e.g. the client or person using it)", "", "text")]}  # fmt: skip
        return await self._form(request, tenant_id, form)

    @action("suspend", "Suspend")
    async def suspend(self, request: Request) -> Response:
        tenant_id = self._one(request)
        if tenant_id is None:
            return back_to(request, self.identity)
        explain = ("Every call with the tenant's keys gets 403 naming the reason. Its queued requests stay queued and "
                   "run; their results wait for its clients (24 h). Resume restores service.")  # fmt: skip
        return await self._form(request, tenant_id, self._reason_form(request, "suspend", explain))

    @action("drain", "Drain")
    async def drain(self, request: Request) -> Response:
        tenant_id = self._one(request)
        if tenant_id is None:
            return back_to(request, self.identity)
        explain = ("New work (training, sampling, saves, new adapters) gets 403 naming the reason; the requests already "
                   "queued run and their futures stay readable, so the queue empties. Nothing is cancelled. Resume "
                   "takes new work again.")  # fmt: skip
        return await self._form(request, tenant_id, self._reason_form(request, "drain", explain))

    @action("edit_limits", "Edit weight and quotas", add_in_list=False)
    async def edit_limits(self, request: Request) -> Response:
        tenant_id = self._one(request)
        if tenant_id is None:
            return back_to(request, self.identity)
        tenant = await run_in_threadpool(self._read, tenant_id)
        settings = self.services().settings
        fields = [("weight", "Fair-share weight (a tenant of weight 2 gets twice the training tokens of weight 1)",
                   f"{tenant.weight:g}", "text")]  # fmt: skip
        for column, label, setting in QUOTA_FIELDS:
            own = getattr(tenant, column)
            hint = f"{label} (empty: the default, {getattr(settings, setting):,}; 0: no limit)"
            fields.append((column, hint, "" if own is None else str(own), "text"))
        form = {"action": str(request.url_for("admin:view-tenant-apply_limits")), "verb": "save",
                "explain": "Applied on every gateway within the auth cache's time (2 s by default).", "fields": fields}  # fmt: skip
        return await self._form(request, tenant_id, form)

    @action("resume", "Resume", "Serve this tenant again (new work accepted)?")
    async def resume(self, request: Request) -> Response:
        return await self._control(request, pks_of(request)[:1], "resume", lambda actor, pk: tenant_controls.resume_tenant(
            self.services(), actor, pk))  # fmt: skip

    async def _control(self, request: Request, pks: list[str], what: str, act: Any) -> Response:
        actor = await acting_admin(request, self.services())
        for pk in pks:
            try:
                await run_in_threadpool(act, actor, pk)
                Flash.flash(request, f"{what}: done", FlashLevel.success)
            except LoraplexError as exc:
                Flash.flash(request, exc.message, FlashLevel.error, what)
        return back_to(request, self.identity, pks[0] if len(pks) == 1 else None)

    @expose("/control/state", methods=["POST"])
    async def apply_state(self, request: Request) -> Response:
        form = await request.form()
        tenant_id, verb, reason = str(form.get("tenant_id") or ""), str(form.get("verb") or ""), str(form.get("reason") or "")
        change = {"suspend": tenant_controls.suspend_tenant, "drain": tenant_controls.drain_tenant}.get(verb)
        if change is None:
            Flash.flash(request, f"unknown control {verb[:20]!r}", FlashLevel.error)
            return back_to(request, self.identity)
        return await self._control(request, [tenant_id], verb, lambda actor, pk: change(self.services(), actor, pk, reason))

    @expose("/control/limits", methods=["POST"])
    async def apply_limits(self, request: Request) -> Response:
        form = await request.form()
        tenant_id = str(form.get("tenant_id") or "")

        def apply(actor: str, pk: str) -> None:
            weight = tenant_rules.parse_weight(str(form.get("weight") or ""))
            quotas = TenantQuotas(*(tenant_rules.parse_quota(column, str(form.get(column) or ""))
                                    for column, _, _ in QUOTA_FIELDS))  # fmt: skip
            tenant_controls.set_tenant_limits(self.services(), actor, pk, tenant_controls.TenantLimits(weight, quotas))

        return await self._control(request, [tenant_id], "weight and quotas", apply)

    @expose("/control/key", methods=["POST"])
    async def apply_key(self, request: Request) -> Response:
        form = await request.form()
        tenant_id, name = str(form.get("tenant_id") or ""), str(form.get("name") or "")
        actor = await acting_admin(request, self.services())
        try:
            key = await run_in_threadpool(tenant_controls.issue_key, self.services(), actor, tenant_id, name)
            tenant = await run_in_threadpool(self._read, tenant_id)
        except LoraplexError as exc:
            Flash.flash(request, exc.message, FlashLevel.error)
            return back_to(request, self.identity, tenant_id or None)
        context = {"key": key, "tenant": tenant, "name": name.strip(),
                   "tenant_url": str(request.url_for("admin:details", identity="tenant", pk=tenant_id)),
                   "keys_url": str(request.url_for("admin:list", identity="api-key"))}  # fmt: skip
        return no_store(await self.templates.TemplateResponse(request, "loraplex/new_key.html", context))


class ApiKeyAdmin(ReadOnlyView, model=ApiKey):
    name = "API key"
    name_plural = "API keys"
    icon = "fa-solid fa-key"
    column_list = [ApiKey.name, ApiKey.prefix, "tenant", ApiKey.created_at, ApiKey.last_used_at, ApiKey.revoked_at]
    column_details_list = [ApiKey.name, ApiKey.prefix, "tenant", ApiKey.id, ApiKey.created_at, ApiKey.last_used_at,
                           ApiKey.revoked_at]  # fmt: skip
    column_labels = {ApiKey.last_used_at: "last used (to the minute)"}
    column_searchable_list = [ApiKey.prefix, ApiKey.name, "tenant.name", ApiKey.tenant_id]
    column_sortable_list = [ApiKey.created_at, ApiKey.revoked_at, ApiKey.last_used_at, ApiKey.name]
    column_default_sort = [(ApiKey.created_at, True)]
    column_formatters = {"tenant": tenant_cell}
    column_formatters_detail = {"tenant": tenant_cell}

    @action("revoke", "Revoke", "Revoke the selected keys? Clients using them get 401 from now on.")
    async def revoke(self, request: Request) -> Response:
        services = self.services()
        actor = await acting_admin(request, services)
        return await self._each(request, "revoke", lambda key_id: tenant_controls.revoke_key(services, actor, key_id))


class AuditAdmin(ModelView, model=AdminAuditEntry):
    """Every admin action, newest first; nothing here changes (the log is append-only)."""

    name = "Audit entry"
    name_plural = "Audit log"
    icon = "fa-solid fa-clipboard-list"
    can_create = can_edit = can_delete = can_export = False
    page_size = 50
    column_type_formatters = column_type_formatters_detail = TYPE_FORMATTERS
    column_list = [AdminAuditEntry.created_at, AdminAuditEntry.actor, AdminAuditEntry.action,
                   AdminAuditEntry.target_kind, AdminAuditEntry.target_name, AdminAuditEntry.detail]  # fmt: skip
    column_labels = {AdminAuditEntry.created_at: "when", AdminAuditEntry.actor: "who",
                     AdminAuditEntry.target_kind: "on", AdminAuditEntry.target_name: "target"}  # fmt: skip
    column_searchable_list = [AdminAuditEntry.actor, AdminAuditEntry.action, AdminAuditEntry.target_name,
                              AdminAuditEntry.target_id]  # fmt: skip
    column_sortable_list = [AdminAuditEntry.created_at, AdminAuditEntry.actor, AdminAuditEntry.action]
    column_default_sort = [(AdminAuditEntry.created_at, True)]
    column_filters = [AllUniqueStringValuesFilter(AdminAuditEntry.action),
                      AllUniqueStringValuesFilter(AdminAuditEntry.actor)]  # fmt: skip
    column_formatters = {AdminAuditEntry.target_name: lambda m, a: _clip(m.target_name, 24),
                         AdminAuditEntry.detail: lambda m, a: _clip(m.detail)}  # fmt: skip
    wiring: ServicesRef


def _clip(text: str | None, keep: int = 32) -> Markup:
    if not text or len(text) <= keep:
        return Markup("{}").format(text or "")
    return Markup('<span title="{}">{}…</span>').format(text, text[:keep])


__all__ = ["ApiKeyAdmin", "AuditAdmin", "TenantAdmin", "details_link"]
