"""What every admin view shares: how a view reaches the gateway's Services, read-only model views that write times,
sizes and ids readably (admin/formatting.py) and name a row's tenant, and running an action over the selected rows
with one flash line per outcome and an audit entry per change (service/audit.py)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any, ClassVar

from markupsafe import Markup
from sqladmin import ModelView
from sqladmin.flash import Flash, FlashLevel
from sqladmin.formatters import BASE_FORMATTERS
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from loraplex.admin.actor import acting_admin
from loraplex.admin.formatting import format_time, link, short_id
from loraplex.errors import LoraplexError
from loraplex.service.audit import record_admin_action
from loraplex.service.context import Services, TenantRef
from loraplex.storage.repositories import TenantRepository

GetServices = Callable[[], Services]
TYPE_FORMATTERS = {**BASE_FORMATTERS, datetime: format_time}


class ServicesRef:
    """How a view reaches the gateway's Services (built in the app's lifespan, after the views are mounted)."""

    def __init__(self, get: GetServices) -> None:
        self.get = get


def pks_of(request: Request) -> list[str]:
    return [pk for pk in request.query_params.get("pks", "").split(",") if pk]


def back_to(request: Request, identity: str, pk: str | None = None) -> RedirectResponse:
    """To a view's list, or to one row's details page."""
    if pk is not None:
        return RedirectResponse(request.url_for("admin:details", identity=identity, pk=pk), status_code=302)
    return RedirectResponse(request.url_for("admin:list", identity=identity), status_code=302)


def no_store(response: Response) -> Response:
    response.headers["Cache-Control"] = "no-store, no-cache, must-revalidate, max-age=0"
    response.headers["Pragma"] = "no-cache"
    return response


def details_link(request: Request | None, identity: str, pk: str, text: str | Markup, title: str | None = None) -> Markup:
    href = str(request.url_for("admin:details", identity=identity, pk=pk)) if request is not None else "#"
    return link(href, text, title)


def tenant_cell(model: Any, _attr: str) -> Markup:
    """The row's tenant by name (the `tenant` relationship, loaded with the list; sqladmin links it to its page)."""
    return Markup('<span title="{}">{}</span>').format(model.tenant_id, model.tenant.name)


def short_cell(attr: str) -> Callable[[Any, str], Markup]:
    return lambda model, _attr: short_id(getattr(model, attr))


class ReadOnlyView(ModelView):
    """Rows are looked at here; they change through actions only."""

    can_create = False
    can_edit = False
    can_delete = False
    can_export = False
    page_size = 25
    column_type_formatters = TYPE_FORMATTERS
    column_type_formatters_detail = TYPE_FORMATTERS
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

    async def _each(
        self, request: Request, what: str, act: Callable[[str], Any], audit_kind: str | None = None
    ) -> RedirectResponse:
        return await for_each(request, self.services(), pks_of(request), what, act, self.identity, audit_kind)


async def for_each(
    request: Request,
    services: Services,
    pks: list[str],
    what: str,
    act: Callable[[str], Any],
    back: str,
    audit_kind: str | None = None,
    detail: str | None = None,
) -> RedirectResponse:
    """Run `act(pk)` for each selected row in a worker thread; one flash line per outcome; an audit entry (action
    `what` on a `audit_kind` row) per success when `audit_kind` is given; back to the list."""
    actor = await acting_admin(request, services)
    done, failed = 0, []
    for pk in pks:
        try:
            await run_in_threadpool(act, pk)
            done += 1
        except LoraplexError as exc:
            failed.append(f"{pk}: {exc.message}")
            continue
        if audit_kind is not None:
            await run_in_threadpool(record_admin_action, services, actor, what, audit_kind, pk, pk, detail)
    if done:
        Flash.flash(request, f"{what}: {done} done", FlashLevel.success)
    for line in failed:
        Flash.flash(request, line, FlashLevel.error, what)
    return back_to(request, back)
