"""`loraplex finetune` and `loraplex pipelines ...`: the tenant's side of offline fine-tuning, through the client
(LORAPLEX_BASE_URL and LORAPLEX_API_KEY, or --url / --api-key). Status shows each pipeline's progress bar."""

from __future__ import annotations

import argparse
import time
from typing import Any

from loraplex.client.pipelines import FINISHED_STATES

STATE_STYLE = {"queued": "yellow", "running": "cyan", "succeeded": "green", "failed": "red", "cancelled": "magenta"}


def _client(args: argparse.Namespace):
    from loraplex.client import ServiceClient

    return ServiceClient(args.url, args.api_key)


def _last(values: list[list[float]]) -> str:
    return f"{values[-1][1]:.4f}" if values else "-"


def _bar(pipeline: dict[str, Any]):
    from rich.progress_bar import ProgressBar

    total = max(1, pipeline["total_steps"])
    return ProgressBar(total=total, completed=min(pipeline["step"], total), width=30)


def status_table(pipelines: list[dict[str, Any]]):
    from rich.table import Table

    table = Table(show_lines=False)
    for column in ("id", "name", "state", "progress", "step", "eval loss", "train loss", "attempt"):
        table.add_column(column)
    for p in pipelines:
        style = STATE_STYLE.get(p["state"], "")
        table.add_row(p["id"][:8], p["name"], f"[{style}]{p['state']}[/{style}]", _bar(p),
                      f"{p['step']}/{p['total_steps']}", _last(p["eval_losses"]), _last(p["train_losses"]),
                      str(p["attempt"]))  # fmt: skip
    return table


def detail(pipeline: dict[str, Any]):
    from rich.console import Group
    from rich.text import Text

    lines = [status_table([pipeline])]
    for label, key in (
        ("adapter", "model_id"),
        ("last checkpoint", "last_checkpoint"),
        ("final checkpoint", "final_checkpoint"),
        ("export", "export_path"),
        ("sweep", "sweep_id"),
    ):
        if pipeline.get(key):
            lines.append(Text(f"{label}: {pipeline[key]}"))  # fmt: skip
    if pipeline.get("export_path"):
        lines.append(Text(f"download: loraplex pipelines export {pipeline['id']} --out DIR"))
    if pipeline.get("error"):
        lines.append(Text(f"error: {pipeline['error']}", style="red"))
    return Group(*lines)


def cmd_finetune(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    with _client(args) as client:
        submitted = client.pipelines.submit(args.config)
        pipelines = submitted["pipelines"]
        if submitted.get("sweep_id"):
            console.print(f"sweep {submitted['sweep_id']}: {len(pipelines)} pipelines")
        for p in pipelines:
            console.print(f"pipeline {p['id']} ({p['name']}) queued: {p['total_steps']} steps")
        if args.wait:
            return _watch(client, [p["id"] for p in pipelines], console)
    return 0


def _watch(client, ids: list[str], console, poll_s: float = 1.0) -> int:
    from rich.live import Live

    with Live(console=console, refresh_per_second=4) as live:
        while True:
            current = [client.pipelines.get(i) for i in ids]
            live.update(status_table(current) if len(current) > 1 else detail(current[0]))
            if all(p["state"] in FINISHED_STATES for p in current):
                break
            time.sleep(poll_s)
    return 0 if all(p["state"] == "succeeded" for p in current) else 1


def cmd_pipelines_status(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    with _client(args) as client:
        if args.pipeline_id and args.watch:
            return _watch(client, [args.pipeline_id], console)
        if args.pipeline_id:
            console.print(detail(client.pipelines.get(args.pipeline_id)))
        else:
            listed = client.pipelines.list(sweep_id=args.sweep)["pipelines"]
            console.print(status_table(listed) if listed else "no pipelines")
    return 0


def cmd_pipelines_cancel(args: argparse.Namespace) -> int:
    with _client(args) as client:
        pipeline = client.pipelines.cancel(args.pipeline_id)
    print(f"pipeline {pipeline['id']} {pipeline['state']} (at step {pipeline['step']}/{pipeline['total_steps']})")
    return 0


def cmd_pipelines_export(args: argparse.Namespace) -> int:
    with _client(args) as client:
        print(client.pipelines.download_export(args.pipeline_id, args.out))
    return 0


def cmd_pipelines_report(args: argparse.Namespace) -> int:
    with _client(args) as client:
        for path in client.pipelines.download_sweep_report(args.sweep_id, args.out):
            print(path)
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    def connection(p: argparse.ArgumentParser) -> None:
        p.add_argument("--url", help="the gateway (default LORAPLEX_BASE_URL, else http://127.0.0.1:8700)")
        p.add_argument("--api-key", help="the tenant's API key (default LORAPLEX_API_KEY)")

    p = sub.add_parser("finetune", help="submit an offline fine-tuning pipeline (or a sweep) from a YAML config")
    p.add_argument("config", help="the YAML config; its dataset paths are relative to it")
    p.add_argument("--wait", action="store_true", help="show progress until it ends (exit 1 unless it succeeded)")
    connection(p)
    p.set_defaults(func=cmd_finetune)

    pipelines = sub.add_parser("pipelines", help="the tenant's pipelines").add_subparsers(
        dest="pipelines_command", required=True
    )
    p = pipelines.add_parser("status", help="progress bars of the tenant's pipelines, or one pipeline in detail")
    p.add_argument("pipeline_id", nargs="?")
    p.add_argument("--sweep", help="only this sweep's points")
    p.add_argument("--watch", action="store_true", help="with an id: follow it until it ends")
    connection(p)
    p.set_defaults(func=cmd_pipelines_status)
    p = pipelines.add_parser("cancel", help="cancel a queued or running pipeline (it stops before its next step)")
    p.add_argument("pipeline_id")
    connection(p)
    p.set_defaults(func=cmd_pipelines_cancel)
    p = pipelines.add_parser("export", help="download a succeeded pipeline's PEFT export into a folder")
    p.add_argument("pipeline_id")
    p.add_argument("--out", required=True)
    connection(p)
    p.set_defaults(func=cmd_pipelines_export)
    p = pipelines.add_parser("report", help="download a finished sweep's report (report.md, report.csv, eval_loss.svg)")
    p.add_argument("sweep_id")
    p.add_argument("--out", required=True)
    connection(p)
    p.set_defaults(func=cmd_pipelines_report)
