"""The Celery tasks (thin: the work is in runner.py, report.py and the service layer): run a pipeline, write a
sweep's report, and the beat's two, delete expired checkpoints and write missed exports. Their names are fixed in
service/pipeline_launch.py, which the gateway sends them by."""

from __future__ import annotations

import logging
import threading

from celery import Task

from loraplex.pipelines.app import celery_app
from loraplex.pipelines.lease import RunnerLease
from loraplex.pipelines.report import sweep_finished, write_sweep_report
from loraplex.pipelines.runner import (
    TRANSIENT_ERRORS,
    LeaseLostError,
    TenantPausedError,
    export_final,
    fail_pipeline,
    run_pipeline,
    tenant_of,
)
from loraplex.pipelines.tenant_slots import TenantSlots
from loraplex.service import Services, TenantRef, write_session
from loraplex.service.build import build_services
from loraplex.service.pipeline_launch import (
    EXPORT_SWEEP_TASK,
    RETENTION_TASK,
    RUN_PIPELINE_TASK,
    SWEEP_REPORT_TASK,
    send_task,
)
from loraplex.settings import get_settings
from loraplex.storage.blobs import BlobStore
from loraplex.storage.repositories import PipelineRepository, TenantRepository, pipelines_missing_export
from loraplex.storage.retention import delete_expired

log = logging.getLogger("loraplex.pipelines")
TRANSIENT_RETRY_S = 5.0
TRANSIENT_RETRIES = 60  # 5 minutes of Redis or the database away, then the pipeline fails

_services: Services | None = None
_services_lock = threading.Lock()


def shared_services() -> Services:
    """One set of services (Redis, the database, the queue producer) per worker process, shared by its threads."""
    global _services
    with _services_lock:
        if _services is None:
            _services = build_services(get_settings())
        return _services


@celery_app.task(name=RUN_PIPELINE_TASK, bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=None)
def run_pipeline_task(self: Task, pipeline_id: str, transient_retries: int = 0) -> str:
    services = shared_services()
    settings = services.settings
    lease = RunnerLease(services.redis, pipeline_id, settings.pipeline_lease_seconds)
    if not lease.acquire():
        # Handed out again while another run of it lives: look again once that run's lease could have lapsed.
        raise self.retry(countdown=settings.pipeline_lease_seconds,
                         kwargs={"transient_retries": transient_retries})  # fmt: skip
    try:
        tenant = tenant_of(services, pipeline_id)
        slots = TenantSlots(services.redis, tenant.id, settings.max_running_pipelines_per_tenant,
                            settings.pipeline_lease_seconds)  # fmt: skip
        if lease.hold_slot(slots):
            state = run_pipeline(services, pipeline_id, lease)
        elif _finished(services, tenant.id, pipeline_id):  # cancelled while it waited
            state = None
        else:
            # The tenant runs its cap of pipelines already: this worker slot goes to the queue's next task (another
            # tenant's, say), and this one is looked at again later (the lease is released below).
            raise self.retry(countdown=settings.pipeline_slot_wait_seconds,
                             kwargs={"transient_retries": transient_retries})  # fmt: skip
    except TRANSIENT_ERRORS as exc:
        message = f"{type(exc).__name__}: {exc}"
        if transient_retries >= TRANSIENT_RETRIES:
            state = fail_pipeline(services, pipeline_id, f"gave up after {transient_retries} retries: {message}")
        else:
            log.warning("pipeline %s: %s; retrying in %g s", pipeline_id, message, TRANSIENT_RETRY_S)
            raise self.retry(countdown=TRANSIENT_RETRY_S, kwargs={"transient_retries": transient_retries + 1}) from None
    except TenantPausedError as exc:  # looked at again later; its checkpoint carries it on once the tenant is active
        log.info("pipeline %s waits: %s", pipeline_id, exc)
        raise self.retry(countdown=settings.pipeline_slot_wait_seconds,
                         kwargs={"transient_retries": transient_retries}) from None  # fmt: skip
    except LeaseLostError as exc:
        log.warning("%s; another run continues it", exc)
        return "lease lost"
    finally:
        lease.release()
    _report_if_sweep_done(services, pipeline_id)
    return str(state) if state is not None else "already finished"


def _finished(services: Services, tenant_id: str, pipeline_id: str) -> bool:
    with services.sessions() as db:
        return PipelineRepository(db, tenant_id).get(pipeline_id).state.finished


def _report_if_sweep_done(services: Services, pipeline_id: str) -> None:
    tenant = tenant_of(services, pipeline_id)
    with services.sessions() as db:
        sweep_id = PipelineRepository(db, tenant.id).get(pipeline_id).sweep_id
    if sweep_id is not None and sweep_finished(services, tenant, sweep_id):
        send_task(services.settings, SWEEP_REPORT_TASK, [tenant.id, sweep_id])


@celery_app.task(name=SWEEP_REPORT_TASK, acks_late=True, reject_on_worker_lost=True)
def write_sweep_report_task(tenant_id: str, sweep_id: str) -> str:
    services = shared_services()
    with services.sessions() as db:
        tenant = TenantRepository(db).get(tenant_id)
    return str(write_sweep_report(services, TenantRef(tenant.id, tenant.name), sweep_id))


@celery_app.task(name=RETENTION_TASK, acks_late=True)
def delete_expired_checkpoints_task() -> int:
    """Beat: every tenant's expired checkpoints lose their rows, then their files (storage/retention.py)."""
    services = shared_services()
    return delete_expired(services.sessions, BlobStore(services.settings.resolved_blob_root))


@celery_app.task(name=EXPORT_SWEEP_TASK, acks_late=True)
def export_finished_pipelines_task() -> int:
    """Beat: succeeded pipelines whose export was not written (their run died between the final save and the
    export, or the export failed) get it now. Returns how many were exported."""
    services = shared_services()
    with services.sessions() as db:
        missing = [
            (p.id, p.tenant_id, p.final_checkpoint) for p in pipelines_missing_export(db) if p.config.get("export")
        ]
    done = 0
    for pipeline_id, tenant_id, final in missing:
        with services.sessions() as db:
            tenant = TenantRepository(db).get(tenant_id)
        ref = TenantRef(tenant.id, tenant.name)
        try:
            folder = export_final(services, ref, pipeline_id, str(final))
        except Exception as exc:  # noqa: BLE001 - one bad checkpoint must not stop the others' exports
            log.warning("export of pipeline %s: %s: %s", pipeline_id, type(exc).__name__, exc)
            continue
        with write_session(services) as db:
            PipelineRepository(db, tenant.id).record_export(pipeline_id, folder)
        done += 1
    return done
