"""Handing a pipeline to the Celery workers: a task message sent by name on the broker, so the gateway needs no
import of loraplex.pipelines (which sits above it). The names are the tasks' own (loraplex/pipelines/tasks.py reads
them from here)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from celery import Celery

from loraplex.settings import Settings

RUN_PIPELINE_TASK = "loraplex.pipelines.run_pipeline"
SWEEP_REPORT_TASK = "loraplex.pipelines.write_sweep_report"
RETENTION_TASK = "loraplex.pipelines.delete_expired_checkpoints"
EXPORT_SWEEP_TASK = "loraplex.pipelines.export_finished_pipelines"


def broker_transport_options(settings: Settings) -> dict[str, Any]:
    """The Redis transport's options: how long an unacked task waits before it is handed out again, and how often
    the workers look (kombu's sweep runs every interval x throttle seconds: throttle 1)."""
    return {
        "visibility_timeout": settings.celery_visibility_timeout_seconds,
        "unacked_restore_interval": settings.celery_restore_interval_seconds,
        "unacked_restore_throttle": 1,
    }


@lru_cache(maxsize=4)
def _producer(broker_url: str, transport_options: tuple[tuple[str, Any], ...]) -> Celery:
    app = Celery("loraplex-producer", broker=broker_url, set_as_current=False)
    app.conf.broker_transport_options = dict(transport_options)
    return app


def send_task(settings: Settings, name: str, args: list[Any]) -> None:
    """Queue task `name` with `args` on the pipelines' queue (raises the broker's error when it is down)."""
    if not settings.resolved_celery_broker_url:
        raise RuntimeError("neither LORAPLEX_CELERY_BROKER_URL nor LORAPLEX_REDIS_URL is set")
    options = tuple(sorted(broker_transport_options(settings).items()))
    _producer(settings.resolved_celery_broker_url, options).send_task(
        name, args=args, queue=settings.celery_queue, retry=False
    )


def launch_pipeline(settings: Settings, pipeline_id: str) -> None:
    send_task(settings, RUN_PIPELINE_TASK, [pipeline_id])
