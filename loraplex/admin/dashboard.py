"""The live dashboard page (/admin/dashboard): the numbers of admin/dashboard_data.py drawn as server-side SVG
(admin/charts.py); the page reloads itself every few seconds, so it stays live without any script."""

from __future__ import annotations

from typing import ClassVar

from sqladmin import BaseView, expose
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from loraplex.admin import charts
from loraplex.admin.dashboard_data import BUCKET_S, WINDOW_S, read_dashboard
from loraplex.admin.views import ServicesRef

REFRESH_SECONDS = 5


class Dashboard(BaseView):
    name = "Dashboard"
    icon = "fa-solid fa-chart-line"
    wiring: ClassVar[ServicesRef]  # set by admin/app.py

    @expose("/dashboard", methods=["GET"], identity="dashboard")
    async def page(self, request: Request) -> Response:
        data = await run_in_threadpool(read_dashboard, self.wiring.get())
        panels = [
            {"key": "queue", "title": "Queued requests per tenant", "svg": charts.bars(data.queue)},
            {"key": "tokens", "title": "Training tokens/s per tenant",
             "svg": charts.lines(data.tokens_per_s, x_span=WINDOW_S, y_unit="tokens/s"),
             "note": f"forward and forward_backward tokens of the usage records, {BUCKET_S} s buckets"},
            {"key": "slots", "title": "GPU slots in use per pool",
             "svg": charts.bars([(p, used) for p, used, _ in data.slots], of=[total for _, _, total in data.slots])},
            {"key": "tiers", "title": "Adapters per tier (GPU slot, host memory, disk)", "svg": charts.bars(data.tiers),
             "note": "swaps move adapters between these tiers"},
            {"key": "plans", "title": "Plans of this gateway's pool (since its Redis started)",
             "svg": charts.bars(data.plans), "note": "adapters per step > 1: tenants' steps share batches"},
            {"key": "layouts", "title": "Plan choices: forward_backward steps by layout", "svg": charts.bars(data.layouts),
             "note": "mixed: several adapters in one batch (the cost model's choice); since each pool started"},
            {"key": "swaps", "title": "Swaps between tiers", "svg": charts.bars(data.swaps),
             "note": "adapter moves since each pool started"},
            {"key": "pipelines", "title": "Pipelines: steps done of total",
             "svg": charts.bars([(n, s) for n, s, _ in data.pipelines], of=[t for _, _, t in data.pipelines]),
             "note": "queued and running ones, and those that ended in the last 15 minutes"},
        ]  # fmt: skip
        return await self.templates.TemplateResponse(
            request,
            "loraplex/dashboard.html",
            {"panels": panels, "now": data.now.strftime("%Y-%m-%d %H:%M:%S"), "refresh_seconds": REFRESH_SECONDS},
        )
