"""`loraplex finetune` and `loraplex pipelines ...`: the tenant's side of offline fine-tuning, through the client
(LORAPLEX_BASE_URL and LORAPLEX_API_KEY, or --url / --api-key). Status shows each pipeline's progress bar and
whether a pipelines worker is alive; a pipeline is named by its id or any unique start of it (status prints 8
characters). And the operator's `loraplex pipelines worker`, which runs one."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from loraplex.client.pipelines import FINISHED_STATES
from loraplex.errors import InvalidRequestError, NotFoundError

FULL_ID_LENGTH = 36  # a UUID
SHOWN_ID_LENGTH = 8
NO_WORKER_HINT = ("start one with `loraplex pipelines worker` (same LORAPLEX_HOME as `serve --embedded`, or "
                  "LORAPLEX_REDIS_URL), or run `loraplex serve --embedded`, which starts one")  # fmt: skip
STATE_STYLE = {"queued": "yellow", "running": "cyan", "succeeded": "green", "failed": "red", "cancelled": "magenta"}


def _client(args: argparse.Namespace):
    import os

    from loraplex.client import ServiceClient

    return ServiceClient(args.url or os.environ.get("LORAPLEX_BASE_URL") or _served_url(), args.api_key)


def _served_url() -> str:
    """The gateway `loraplex serve` starts under the same settings (LORAPLEX_API_HOST / LORAPLEX_API_PORT): a shell
    that set a port for `serve` reaches it without also setting LORAPLEX_BASE_URL."""
    from loraplex.settings import get_settings

    settings = get_settings()
    host = "127.0.0.1" if settings.api_host in ("0.0.0.0", "::") else settings.api_host  # noqa: S104
    return f"http://{host}:{settings.api_port}"


def _last(values: list[list[float]]) -> str:
    return f"{values[-1][1]:.4f}" if values else "-"


def _bar(pipeline: dict[str, Any]):
    from rich.progress_bar import ProgressBar

    total = max(1, pipeline["total_steps"])
    return ProgressBar(total=total, completed=min(pipeline["step"], total), width=30)


def status_table(pipelines: list[dict[str, Any]]):
    from rich.table import Table

    table = Table(show_lines=False)
    table.add_column("id", no_wrap=True, min_width=SHOWN_ID_LENGTH)  # whole on a narrow terminal: `status ID` takes it
    for column in ("name", "state", "progress", "step", "eval loss", "train loss", "attempt"):
        table.add_column(column)
    for p in pipelines:
        style = STATE_STYLE.get(p["state"], "")
        table.add_row(p["id"][:SHOWN_ID_LENGTH], p["name"], f"[{style}]{p['state']}[/{style}]", _bar(p),
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


def matching_ids(given: str, ids: list[str]) -> str:
    """The one id of `ids` that starts with `given`; NotFoundError for none, InvalidRequestError for several."""
    found = [i for i in ids if i.startswith(given)]
    if not found:
        raise NotFoundError(f"no pipeline of yours has an id starting with {given!r} (`loraplex pipelines status` "
                            "lists them)")  # fmt: skip
    if len(found) > 1:
        shown = ", ".join(found[:5]) + (", ..." if len(found) > 5 else "")
        raise InvalidRequestError(f"{given!r} starts {len(found)} pipelines' ids ({shown}): give more of it")
    return found[0]


def resolve_id(client, given: str) -> str:
    """A pipeline id from an id or a unique start of one (what `status` prints), among the tenant's pipelines."""
    if len(given) >= FULL_ID_LENGTH:
        return given
    ids: list[str] = []
    while True:
        page = client.pipelines.list(limit=1000, offset=len(ids))
        ids += [p["id"] for p in page["pipelines"]]
        if not page["pipelines"] or len(ids) >= page["total_count"]:
            return matching_ids(given, ids)


def workers_line(alive: int) -> str:
    if alive:
        return f"pipelines workers alive: {alive}"
    return f"[red]no pipelines worker is alive[/red]: queued pipelines wait; {NO_WORKER_HINT}"


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
            return _watch(client, [p["id"] for p in pipelines], console, args.worker_wait)
    return 0


def _watch(client, ids: list[str], console, worker_wait_s: float, poll_s: float = 1.0) -> int:
    """Progress until every pipeline ended (0 when all succeeded, else 1); 3 when no pipelines worker was alive for
    `worker_wait_s` while some had not ended (they stay queued: nothing would run them)."""
    from rich.live import Live

    no_worker_since: float | None = None
    with Live(console=console, refresh_per_second=4) as live:
        while True:
            current = [client.pipelines.get(i) for i in ids]
            live.update(status_table(current) if len(current) > 1 else detail(current[0]))
            if all(p["state"] in FINISHED_STATES for p in current):
                break
            if client.pipelines.workers()["alive"]:
                no_worker_since = None
            elif no_worker_since is None:
                no_worker_since = time.monotonic()
            elif time.monotonic() - no_worker_since >= worker_wait_s:
                break
            time.sleep(poll_s)
    if not all(p["state"] in FINISHED_STATES for p in current):
        print(f"loraplex: no pipelines worker has been alive for {worker_wait_s:g} s, so nothing runs these "
              f"pipelines (they stay queued; `loraplex pipelines status ID --watch` follows one): {NO_WORKER_HINT}",
              file=sys.stderr)  # fmt: skip
        return 3
    return 0 if all(p["state"] == "succeeded" for p in current) else 1


def cmd_pipelines_status(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    with _client(args) as client:
        pipeline_id = resolve_id(client, args.pipeline_id) if args.pipeline_id else None
        if pipeline_id and args.watch:
            return _watch(client, [pipeline_id], console, args.worker_wait)
        if pipeline_id:
            console.print(detail(client.pipelines.get(pipeline_id)))
        else:
            listed = client.pipelines.list(sweep_id=args.sweep)["pipelines"]
            console.print(status_table(listed) if listed else "no pipelines")
        console.print(workers_line(client.pipelines.workers()["alive"]))
    return 0


def cmd_pipelines_cancel(args: argparse.Namespace) -> int:
    with _client(args) as client:
        pipeline = client.pipelines.cancel(resolve_id(client, args.pipeline_id))
    print(f"pipeline {pipeline['id']} {pipeline['state']} (at step {pipeline['step']}/{pipeline['total_steps']})")
    return 0


def cmd_pipelines_worker(args: argparse.Namespace) -> int:
    """Run a pipelines worker in this process (exec: Ctrl-C and SIGTERM reach Celery, which finishes politely)."""
    from loraplex.launch.pipeline_worker import celery_worker_argv
    from loraplex.pipelines.broker import worker_settings

    settings = worker_settings()  # no Redis found: NoBrokerError, one line naming the settings (cli.main)
    settings.home.mkdir(parents=True, exist_ok=True)
    schedule = settings.home / "pipelines-beat-schedule" if args.beat else None
    argv = celery_worker_argv(args.name or f"pipelines-{os.getpid()}",
                              args.concurrency or settings.pipeline_worker_concurrency, schedule)  # fmt: skip
    sys.stdout.flush()
    os.execv(argv[0], argv)  # the environment (with the Redis found) goes along
    return 0  # not reached


def cmd_pipelines_export(args: argparse.Namespace) -> int:
    with _client(args) as client:
        print(client.pipelines.download_export(resolve_id(client, args.pipeline_id), args.out))
    return 0


def cmd_pipelines_report(args: argparse.Namespace) -> int:
    with _client(args) as client:
        for path in client.pipelines.download_sweep_report(args.sweep_id, args.out):
            print(path)
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    def connection(p: argparse.ArgumentParser) -> None:
        p.add_argument("--url", help="the gateway (default LORAPLEX_BASE_URL, else LORAPLEX_API_HOST:LORAPLEX_API_PORT, "
                       "where `loraplex serve` listens: http://127.0.0.1:8700)")  # fmt: skip
        p.add_argument("--api-key", help="the tenant's API key (default LORAPLEX_API_KEY)")

    def worker_wait(p: argparse.ArgumentParser) -> None:
        p.add_argument("--worker-wait", type=float, default=30.0, metavar="S",
                       help="give up waiting (exit 3) once no pipelines worker has been alive for S seconds "
                            "(default 30); the pipelines stay queued")  # fmt: skip

    p = sub.add_parser("finetune", help="submit an offline fine-tuning pipeline (or a sweep) from a YAML config")
    p.add_argument("config", help="the YAML config; its dataset paths are relative to it")
    p.add_argument("--wait", action="store_true", help="show progress until it ends (exit 1 unless it succeeded)")
    worker_wait(p)
    connection(p)
    p.set_defaults(func=cmd_finetune)

    pipelines = sub.add_parser(
        "pipelines", help="the tenant's pipelines; and `worker`, which runs them"
    ).add_subparsers(dest="pipelines_command", required=True)
    p = pipelines.add_parser("status", help="progress bars of the tenant's pipelines, or one pipeline in detail, and "
                             "whether a pipelines worker is alive")  # fmt: skip
    p.add_argument(
        "pipeline_id", nargs="?", help="a pipeline's id, or a unique start of it (status prints 8 characters)"
    )
    p.add_argument("--sweep", help="only this sweep's points")
    p.add_argument("--watch", action="store_true", help="with an id: follow it until it ends")
    worker_wait(p)
    connection(p)
    p.set_defaults(func=cmd_pipelines_status)
    p = pipelines.add_parser("cancel", help="cancel a queued or running pipeline (it stops before its next step)")
    p.add_argument("pipeline_id", help="its id, or a unique start of it")
    connection(p)
    p.set_defaults(func=cmd_pipelines_cancel)
    p = pipelines.add_parser("export", help="download a succeeded pipeline's PEFT export into a folder")
    p.add_argument("pipeline_id", help="its id, or a unique start of it")
    p.add_argument("--out", required=True)
    connection(p)
    p.set_defaults(func=cmd_pipelines_export)
    p = pipelines.add_parser("report", help="download a finished sweep's report (report.md, report.csv, eval_loss.svg)")
    p.add_argument("sweep_id")
    p.add_argument("--out", required=True)
    connection(p)
    p.set_defaults(func=cmd_pipelines_report)
    p = pipelines.add_parser(
        "worker",
        help="run a pipelines worker here (a Celery worker; `serve --embedded` runs one already)",
        description="Run a pipelines worker (Celery, threads) in the foreground. Its Redis: LORAPLEX_REDIS_URL (and "
        "LORAPLEX_CELERY_BROKER_URL if the broker is another), else the one `serve --embedded` runs for the same "
        "LORAPLEX_HOME. It needs the pool's LORAPLEX_DATABASE_URL, LORAPLEX_BLOB_ROOT and LORAPLEX_MODEL_CACHE "
        "(the defaults under LORAPLEX_HOME match the embedded stack's).",
    )
    p.add_argument("--concurrency", type=int, help="pipelines trained at once (default LORAPLEX_PIPELINE_WORKER_"
                   "CONCURRENCY, 4)")  # fmt: skip
    p.add_argument("--beat", action="store_true",
                   help="also run the schedule (checkpoint retention, missed exports): on one worker only, and not "
                        "beside `serve --embedded`, whose worker runs it")  # fmt: skip
    p.add_argument("--name", help="the Celery node name (default pipelines-PID)")
    p.set_defaults(func=cmd_pipelines_worker)
