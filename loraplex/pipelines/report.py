"""A sweep's report, written when its last point ends: a comparison table (report.md, report.csv: one row per grid
point with its final and best eval loss and final train loss) and eval_loss.svg (eval loss per step, one line per
point), in the sweep's folder (service/pipelines.sweep_dir), from the points' rows in the database."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from loraplex.pipelines.svg_plot import line_plot
from loraplex.runtime.fsutil import private_dirs, write_bytes_atomic
from loraplex.service import Services, TenantRef
from loraplex.service.pipelines import sweep_dir
from loraplex.storage.models import Pipeline
from loraplex.storage.repositories import PipelineRepository

COLUMNS = ("final_eval_loss", "best_eval_loss", "best_step", "final_train_loss", "steps", "state", "pipeline_id")


def point_label(point: dict[str, Any]) -> str:
    return ", ".join(f"{k.rpartition('.')[2]}={v:g}" if isinstance(v, float) else f"{k.rpartition('.')[2]}={v}"
                     for k, v in point.items())  # fmt: skip


def comparison_rows(points: list[Pipeline]) -> tuple[list[str], list[dict[str, Any]]]:
    """(the grid keys, one row per point in grid order)."""
    keys = list(points[0].sweep_point) if points else []
    rows = []
    for p in sorted(points, key=lambda p: p.name):
        evals, trains = p.eval_losses or [], p.train_losses or []
        best = min(evals, key=lambda e: e[1]) if evals else None
        rows.append({**p.sweep_point, "final_eval_loss": evals[-1][1] if evals else None,
                     "best_eval_loss": best[1] if best else None, "best_step": int(best[0]) if best else None,
                     "final_train_loss": trains[-1][1] if trains else None, "steps": f"{p.step}/{p.total_steps}",
                     "state": str(p.state), "pipeline_id": p.id})  # fmt: skip
    return keys, rows


def _cell(value: Any) -> str:
    if value is None:
        return ""
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def markdown(keys: list[str], rows: list[dict[str, Any]], title: str) -> str:
    header = [*keys, *COLUMNS]
    lines = [f"# {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(row.get(h)) for h in header) + " |" for row in rows]
    done = [r for r in rows if r["final_eval_loss"] is not None]
    if done:
        best = min(done, key=lambda r: r["final_eval_loss"])
        lines += [
            "",
            f"Best final eval loss: {best['final_eval_loss']:.6g} at {point_label({k: best[k] for k in keys})}.",
        ]
    return "\n".join(lines) + "\n"


def csv_text(keys: list[str], rows: list[dict[str, Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow([*keys, *COLUMNS])
    writer.writerows([[_cell(row.get(h)) for h in (*keys, *COLUMNS)] for row in rows])
    return buffer.getvalue()


def write_sweep_report(services: Services, tenant: TenantRef, sweep_id: str) -> Path:
    with services.sessions() as db:
        points = PipelineRepository(db, tenant.id).list(sweep_id=sweep_id, limit=1000)
    keys, rows = comparison_rows(points)
    series = {point_label(p.sweep_point): [(e[0], e[1]) for e in p.eval_losses or []]
              for p in sorted(points, key=lambda p: p.name)}  # fmt: skip
    name = points[0].name.rpartition("-")[0] if points else sweep_id
    folder = sweep_dir(services, tenant.id, sweep_id)
    private_dirs(folder)  # owner-only, its files too (fsutil's default): the tenant reads them through the API
    write_bytes_atomic(folder / "report.md", markdown(keys, rows, f"Sweep {name} ({sweep_id})").encode())
    write_bytes_atomic(folder / "report.csv", csv_text(keys, rows).encode())
    svg = line_plot(series, f"Eval loss per step: sweep {name}", "step", "eval loss (per completion token)")
    write_bytes_atomic(folder / "eval_loss.svg", svg.encode())
    return folder


def sweep_finished(services: Services, tenant: TenantRef, sweep_id: str) -> bool:
    with services.sessions() as db:
        points = PipelineRepository(db, tenant.id).list(sweep_id=sweep_id, limit=1000)
    return bool(points) and all(p.state.finished for p in points)
