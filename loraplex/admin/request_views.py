"""Per-adapter and per-session pages (/admin/dashboard/adapter/<id>, /admin/dashboard/session/<id>): the same numbers a
tenant reads at /v1/adapters/<id>/stats and /v1/sessions/<id>/stats (service/request_traces.py), for any tenant:
training utilization, tokens/s, queue wait against compute per request, what is in flight, the loss per step; and the
requests' trace as Chrome/Perfetto trace-event JSON to download (`.../trace.json`)."""

from __future__ import annotations

from html import escape
from typing import Any, ClassVar

from sqladmin import BaseView, expose
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from loraplex.admin import charts
from loraplex.admin.charts import seconds_label
from loraplex.admin.views import ServicesRef
from loraplex.errors import NotFoundError
from loraplex.service import request_traces
from loraplex.service.request_traces import TraceScope

REQUESTS_CHARTED = 120


def _figures(stats: Any) -> list[tuple[str, str]]:
    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v * 100:.0f}%"

    def sec(v: float | None) -> str:
        return "-" if v is None else seconds_label(v)

    return [
        ("training utilization", pct(stats.utilization)),
        ("tokens/s", "-" if stats.tokens_per_s is None else f"{stats.tokens_per_s:,.0f}"),
        ("requests traced", f"{stats.requests:,} ({stats.failed} failed)"),
        ("queue wait p50 / p99", f"{sec(stats.queue_wait_p50_s)} / {sec(stats.queue_wait_p99_s)}"),
        ("compute p50 / p99", f"{sec(stats.compute_p50_s)} / {sec(stats.compute_p99_s)}"),
        ("in flight now", f"{stats.in_flight_requests} requests, {stats.in_flight_samples} samples"),
        ("engine time / wall time", f"{stats.engine_s:.2f} s / {stats.wall_s:.2f} s"),
    ]


class RequestViews(BaseView):
    name = "Requests"
    identity = "requests"
    wiring: ClassVar[ServicesRef]  # set by admin/app.py

    def is_visible(self, request: Request) -> bool:
        return False  # reached from the dashboard's adapter links

    async def _page(self, request: Request, scope_of: Any, key: str) -> Response:
        services = self.wiring.get()
        try:
            scope: TraceScope = await run_in_threadpool(scope_of, services, None, key)
        except NotFoundError as exc:
            return Response(escape(str(exc)), status_code=404)
        stats = await run_in_threadpool(request_traces.stats, services, scope)
        rows = stats.rows[-REQUESTS_CHARTED:]
        columns = [(f"{r.kind} #{r.seq_id}", [("queue wait", r.queue_wait_s), ("compute", r.compute_s)]) for r in rows]
        loss = {"loss:sum": [(float(r.seq_id), r.loss) for r in rows if r.loss is not None]}
        first = min((p[0] for p in loss["loss:sum"]), default=0.0)
        last = max((p[0] for p in loss["loss:sum"]), default=1.0)
        loss_chart = charts.time_lines(loss, start=first, end=max(last, first + 2), y_unit="loss:sum",
                                       x_label=lambda x: f"seq {x:.0f}") if loss["loss:sum"] else ""  # fmt: skip
        return await self.templates.TemplateResponse(request, "loraplex/requests.html", {
            "label": scope.label, "tenant": scope.tenant_name, "figures": _figures(stats),
            "columns": charts.stacked_columns(columns, y_unit="seconds per request"), "loss": loss_chart,
            "trace": f"{request.url.path}/trace.json", "shown": len(rows), "session_id": scope.session_id,
        })  # fmt: skip

    async def _trace(self, scope_of: Any, key: str, name: str) -> Response:
        services = self.wiring.get()
        try:
            scope = await run_in_threadpool(scope_of, services, None, key)
        except NotFoundError as exc:
            return Response(escape(str(exc)), status_code=404)
        body = await run_in_threadpool(request_traces.trace_export, services, scope)
        return JSONResponse(body, headers={"Content-Disposition": f'attachment; filename="{name}.trace.json"'})

    @expose("/dashboard/adapter/{model_id}", methods=["GET"], identity="adapter-requests")
    async def adapter(self, request: Request) -> Response:
        return await self._page(request, request_traces.adapter_scope, request.path_params["model_id"])

    @expose("/dashboard/adapter/{model_id}/trace.json", methods=["GET"], identity="adapter-trace")
    async def adapter_trace(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        return await self._trace(request_traces.adapter_scope, model_id, f"adapter-{model_id}")

    @expose("/dashboard/session/{session_id}", methods=["GET"], identity="session-requests")
    async def session(self, request: Request) -> Response:
        return await self._page(request, request_traces.session_scope, request.path_params["session_id"])

    @expose("/dashboard/session/{session_id}/trace.json", methods=["GET"], identity="session-trace")
    async def session_trace(self, request: Request) -> Response:
        session_id = request.path_params["session_id"]
        return await self._trace(request_traces.session_scope, session_id, f"session-{session_id}")
