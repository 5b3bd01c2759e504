"""Pipelines as service calls (the native routes, the CLI through the client, and the web admin use these): submit a
config with its dataset records (one pipeline, or one per sweep point), read and list them, cancel one, and read a
sweep's report files. The Celery task that runs a pipeline (loraplex/pipelines/) trains through the same service
layer as the tenant (service/training.py and friends), so its steps obey every rule a tenant's do."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

from loraplex.errors import InvalidRequestError, NotFoundError, QuotaExceededError, ServiceUnavailableError
from loraplex.queue import pipeline_workers
from loraplex.runtime.fsutil import private_dirs, write_bytes_atomic
from loraplex.service.context import Services, TenantRef, blob_store, write_session
from loraplex.service.paging import check_page
from loraplex.service.pipeline_config import (
    PipelineConfig,
    SubmitPipelineRequest,
    check_records,
    expand_sweep,
    total_steps,
    train_count,
)
from loraplex.service.pipeline_launch import launch_pipeline
from loraplex.service.pipeline_tokenizer import check_tokenizer
from loraplex.service.schemas import PipelineList, PipelineOut, PipelineWorkers, SubmittedPipelines
from loraplex.storage.models import Pipeline, PipelineState
from loraplex.storage.repositories import PipelineRepository

REPORT_FILES = ("report.md", "report.csv", "eval_loss.svg")  # what a finished sweep writes (pipelines/report.py)
TRAIN_FILE, EVAL_FILE = "train.jsonl", "eval.jsonl"


def pipeline_out(row: Pipeline) -> PipelineOut:
    return PipelineOut(
        id=row.id, name=row.name, sweep_id=row.sweep_id, sweep_point=dict(row.sweep_point or {}),
        state=str(row.state), step=row.step, total_steps=row.total_steps, attempt=row.attempt, model_id=row.model_id,
        last_checkpoint=row.last_checkpoint, last_checkpoint_step=row.last_checkpoint_step,
        eval_losses=list(row.eval_losses or []), train_losses=list(row.train_losses or []),
        final_checkpoint=row.final_checkpoint, export_path=export_url(row.id) if row.export_path else None,
        error=row.error, config=dict(row.config),
        created_at=row.created_at, started_at=row.started_at, finished_at=row.finished_at,
    )  # fmt: skip


def export_url(pipeline_id: str) -> str:
    """Where the tenant downloads a pipeline's PEFT export (a tar archive): the answers name this, never the folder
    on the workers' filesystem."""
    return f"/v1/pipelines/{pipeline_id}/export"


def dataset_key(tenant_id: str, dataset_id: str) -> str:
    return f"{tenant_id}/datasets/{dataset_id}"


def sweep_dir(services: Services, tenant_id: str, sweep_id: str) -> Path:
    return services.settings.resolved_pipeline_dir / tenant_id / "sweeps" / sweep_id


def export_dir(services: Services, tenant_id: str, pipeline_id: str) -> Path:
    return services.settings.resolved_pipeline_dir / tenant_id / pipeline_id / "peft"


def _check(services: Services, config: PipelineConfig, request: SubmitPipelineRequest) -> int:
    """The checks a submission must pass before anything is written; returns how many records are trained on."""
    settings = services.settings
    limit = settings.pipeline_max_records
    for split, records in (("train", request.train), ("eval", request.eval or [])):
        if len(records) > limit:
            raise InvalidRequestError(
                f"{split} has {len(records)} records; at most {limit} (LORAPLEX_PIPELINE_MAX_RECORDS)"
            )
        if records:
            check_records(records, split, config.dataset.format)
    n_train = train_count(config, len(request.train), request.eval is not None)
    has_eval = bool(request.eval) or config.dataset.eval_fraction > 0
    if n_train == 0:
        raise InvalidRequestError("dataset.eval_fraction leaves no train records")
    if has_eval and request.eval is None and n_train == len(request.train):
        raise InvalidRequestError("dataset.eval_fraction holds out no record of so few; raise it or give an eval file")
    if config.eval_every and not has_eval:
        raise InvalidRequestError("eval_every needs an eval split: dataset.eval (a file) or dataset.eval_fraction")
    return n_train


def _check_pipeline_quota(services: Services, tenant: TenantRef, repo: PipelineRepository, adding: int) -> None:
    """QuotaExceededError (429, no Retry-After: room frees as pipelines end) when `adding` more pipelines would pass
    the tenant's `max_pipelines_per_tenant` queued or running. Checked again in the transaction that adds them (on
    SQLite that transaction holds the write lock; on PostgreSQL two submissions at the same instant may pass it by
    one submission's points)."""
    quota = services.settings.max_pipelines_per_tenant
    if not quota:
        return
    unfinished = repo.count_unfinished()
    if unfinished + adding > quota:
        raise QuotaExceededError(
            f"tenant {tenant.name} has {unfinished} pipelines queued or running and submits {adding} more; its quota is "
            f"{quota} (LORAPLEX_MAX_PIPELINES_PER_TENANT): wait for some to end, or cancel some"
        )


def submit_pipeline(services: Services, tenant: TenantRef, request: SubmitPipelineRequest) -> SubmittedPipelines:
    """Check the config (each sweep point's too) and the records, store the dataset once in the blob store, create
    one pipeline row per point (QUEUED) and queue a task for each."""
    settings = services.settings
    check_tokenizer(settings, request.config.tokenizer)  # not a grid key: every point has the same
    points = expand_sweep(request.config)
    plans = []
    for point, config in points:
        if config.lora.rank > settings.max_rank:
            raise InvalidRequestError(
                f"lora.rank {config.lora.rank} exceeds this pool's maximum rank {settings.max_rank}"
            )
        plans.append((point, config, total_steps(config, _check(services, config, request))))
    with services.sessions() as db:
        _check_pipeline_quota(services, tenant, PipelineRepository(db, tenant.id), len(plans))
    dataset_id = uuid.uuid4().hex
    key = dataset_key(tenant.id, dataset_id)
    folder = private_dirs(blob_store(services).path(key))
    write_bytes_atomic(folder / TRAIN_FILE, _jsonl(request.train))
    if request.eval is not None:
        write_bytes_atomic(folder / EVAL_FILE, _jsonl(request.eval))
    sweep_id = uuid.uuid4().hex[:32] if request.config.sweep is not None else None
    with write_session(services) as db:
        repo = PipelineRepository(db, tenant.id)
        try:
            _check_pipeline_quota(services, tenant, repo, len(plans))  # again, in the transaction that adds them
        except QuotaExceededError:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        rows = [
            repo.create(
                name=config.name if not point else f"{config.name}-{i}",
                config=config.model_dump(mode="json"),
                dataset_key=key,
                total_steps=steps,
                sweep_id=sweep_id,
                sweep_point=point,
            )  # fmt: skip
            for i, (point, config, steps) in enumerate(plans)
        ]
    for row in rows:
        try:
            launch_pipeline(settings, row.id)
        except Exception as exc:  # noqa: BLE001 - the broker away: the pipelines must not sit QUEUED forever
            with write_session(services) as db:
                repo = PipelineRepository(db, tenant.id)
                for r in rows:
                    repo.finish(r.id, PipelineState.FAILED, f"could not queue its task: {type(exc).__name__}: {exc}")
            raise ServiceUnavailableError(f"the pipelines' broker is unavailable ({exc}); nothing was started") from exc
    return SubmittedPipelines(pipelines=[pipeline_out(r) for r in rows], sweep_id=sweep_id)


def _jsonl(records: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()  # ASCII: a lone surrogate cannot break it


def get_pipeline(services: Services, tenant: TenantRef, pipeline_id: str) -> PipelineOut:
    with services.sessions() as db:
        return pipeline_out(PipelineRepository(db, tenant.id).get(pipeline_id))


def list_pipelines(
    services: Services, tenant: TenantRef, sweep_id: str | None = None, limit: int = 100, offset: int = 0
) -> PipelineList:
    check_page(limit, offset)
    with services.sessions() as db:
        repo = PipelineRepository(db, tenant.id)
        rows = repo.list(sweep_id, limit, offset)
        return PipelineList(pipelines=[pipeline_out(r) for r in rows], total_count=repo.count(sweep_id))


def pipeline_workers_alive(services: Services) -> PipelineWorkers:
    """The live pipelines workers (queue/pipeline_workers.py): a tenant's `finetune --wait` says when there is none."""
    return PipelineWorkers(alive=pipeline_workers.alive_count(services.redis),
                           heartbeat_seconds=services.settings.pipeline_worker_heartbeat_seconds)  # fmt: skip


def cancel_pipeline(services: Services, tenant: TenantRef, pipeline_id: str) -> PipelineOut:
    """Cancel a queued or running pipeline: its state becomes CANCELLED at once, and its task stops before its next
    step (its adapter is deleted, its checkpoints stay). A finished one is a 409; cancelling twice is answered
    as the first time."""
    with write_session(services) as db:
        return pipeline_out(PipelineRepository(db, tenant.id).cancel(pipeline_id))


def export_folder(services: Services, tenant: TenantRef, pipeline_id: str) -> Path:
    """The PEFT folder a pipeline of this tenant exported (404 for another tenant's pipeline, or one with no export
    yet: it is written when the pipeline succeeds, if its config's `export` is on)."""
    with services.sessions() as db:
        row = PipelineRepository(db, tenant.id).get(pipeline_id)
        folder = Path(row.export_path) if row.export_path else None
    if folder is None or not folder.is_dir():
        raise NotFoundError(f"pipeline {pipeline_id!r} has no export (yet): it is written when the pipeline succeeds")
    return folder


def sweep_report_file(services: Services, tenant: TenantRef, sweep_id: str, name: str) -> Path:
    """One file of a sweep's report (report.md, report.csv, eval_loss.svg), written when its last point ends. 404
    for another tenant's sweep or one still running."""
    if name not in REPORT_FILES:
        raise NotFoundError(f"no report file {name!r}; the report has {', '.join(REPORT_FILES)}")
    with services.sessions() as db:
        points = PipelineRepository(db, tenant.id).list(sweep_id=sweep_id, limit=1)
    if not points:
        raise NotFoundError(f"sweep {sweep_id!r} not found")
    path = sweep_dir(services, tenant.id, sweep_id) / name
    if not path.is_file():
        raise NotFoundError(f"sweep {sweep_id!r} has no report yet: it is written when its last point ends")
    return path
