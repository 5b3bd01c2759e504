"""The live dashboard (/admin/dashboard): what is wrong, where and since when (alerts and the health of every pool,
gateway, Redis and the database), then errors, latency percentiles, tenants, adapters and pipelines over a chosen
time range (admin/dashboard_data.py reads, admin/dashboard_panels.py draws). The page polls /admin/dashboard/data
every POLL_SECONDS and swaps the panels in without a reload (the legend's toggles and the range stay); without
script it is still a complete page of the time of its load."""

from __future__ import annotations

from typing import Any, ClassVar

from sqladmin import BaseView, expose
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from loraplex.admin import dashboard_panels
from loraplex.admin.charts import clock
from loraplex.admin.dashboard_data import read_dashboard
from loraplex.admin.dashboard_shaping import DEFAULT_RANGE, RANGES
from loraplex.admin.views import ServicesRef

POLL_SECONDS = 2


def _range(request: Request) -> str:
    chosen = request.query_params.get("range", DEFAULT_RANGE)
    return chosen if chosen in RANGES else DEFAULT_RANGE


def _content(view: Dashboard, chosen: str) -> dict[str, Any]:
    data = read_dashboard(view.wiring.get(), RANGES[chosen])
    return {
        "now": clock(data.now) + " UTC",
        "bucket_s": data.shaped.bucket_s,
        "alerts": dashboard_panels.alerts_html(data),
        "health": dashboard_panels.health_html(data),
        "panels": dashboard_panels.panels(data),
    }


class Dashboard(BaseView):
    name = "Dashboard"
    icon = "fa-solid fa-chart-line"
    wiring: ClassVar[ServicesRef]  # set by admin/app.py

    @expose("/dashboard", methods=["GET"], identity="dashboard")
    async def page(self, request: Request) -> Response:
        chosen = _range(request)
        content = await run_in_threadpool(_content, self, chosen)
        return await self.templates.TemplateResponse(
            request,
            "loraplex/dashboard.html",
            {**content, "ranges": list(RANGES), "chosen": chosen, "poll_seconds": POLL_SECONDS},
        )

    @expose("/dashboard/data", methods=["GET"], identity="dashboard-data")
    async def data(self, request: Request) -> Response:
        content = await run_in_threadpool(_content, self, _range(request))
        return JSONResponse(content, headers={"Cache-Control": "no-store"})
