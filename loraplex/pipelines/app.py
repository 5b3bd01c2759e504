"""The Celery app of the pipelines: `celery -A loraplex.pipelines.app:celery_app worker` runs the tasks
(pipelines/tasks.py), `... beat` their schedule (checkpoint retention, missed exports); `loraplex pipelines worker`
and `serve --embedded` run the same. The broker is Redis (LORAPLEX_CELERY_BROKER_URL, else LORAPLEX_REDIS_URL, else
the embedded stack's of this LORAPLEX_HOME: broker.py); with none the import exits naming the settings, never Celery's
AMQP default. No result backend: progress lives in the `pipelines` table. Each worker beats while it lives
(heartbeat.py), so the gateway can tell whether any is alive.

acks_late + reject_on_worker_lost: a task is acked when it ends, so a worker that dies mid-pipeline leaves it unacked
and the broker hands it to another worker (at once when a prefork child dies; after the visibility timeout when the
whole worker is killed), which resumes the pipeline from its last checkpoint (pipelines/runner.py)."""

from __future__ import annotations

from celery import Celery

from loraplex.pipelines import heartbeat as heartbeat  # its signal handlers: each worker says it is alive
from loraplex.pipelines.broker import NoBrokerError, worker_settings
from loraplex.service.pipeline_launch import (
    EXPORT_SWEEP_TASK,
    RETENTION_TASK,
    broker_transport_options,
)


def make_celery_app() -> Celery:
    try:
        settings = worker_settings()
    except NoBrokerError as exc:
        # Celery's CLI prints an import error with its traceback; SystemExit's message is printed alone.
        raise SystemExit(f"loraplex: {exc}") from None
    app = Celery("loraplex", broker=settings.resolved_celery_broker_url, include=["loraplex.pipelines.tasks"])
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,  # a worker takes no more tasks than it has free slots
        task_ignore_result=True,
        task_default_queue=settings.celery_queue,
        broker_transport_options=broker_transport_options(settings),
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        beat_schedule={
            "delete-expired-checkpoints": {
                "task": RETENTION_TASK,
                "schedule": settings.retention_interval_seconds,
                "options": {"queue": settings.celery_queue},
            },
            "export-finished-pipelines": {
                "task": EXPORT_SWEEP_TASK,
                "schedule": settings.export_interval_seconds,
                "options": {"queue": settings.celery_queue},
            },
        },  # fmt: skip
    )
    return app


celery_app = make_celery_app()
