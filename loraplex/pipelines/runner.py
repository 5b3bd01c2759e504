"""One run of a pipeline's Celery task: take the pipeline (RUNNING, attempt + 1), tokenize its dataset, train an
adapter through the service layer step by step, evaluate and checkpoint on the config's cadence, save and export the
final weights, and record every step in the `pipelines` row.

Resuming: each run trains an adapter of its own, `pipeline-<id>-<attempt>`. A run that finds a checkpoint of an
earlier one (`last_checkpoint`, a save_state: weights and Adam state) creates its adapter from it and continues
after that checkpoint's step; the batches are a function of the seed and the step number (dataset.batch_indices), so
it ends with the weights an uninterrupted run ends with. The earlier run's adapter is deleted through the queue.

Cancel: the run reads the pipeline's state after every step (`record_step`); CANCELLED stops it before the next."""

from __future__ import annotations

import contextlib
import logging
import os

import redis
from sqlalchemy.exc import OperationalError

from loraplex.errors import (
    ConflictError,
    ForbiddenError,
    InvalidRequestError,
    LoraplexError,
    NotFoundError,
    ServiceUnavailableError,
)
from loraplex.pipelines.dataset import TRANSFORMERS_IMPORT, Example, batch_indices, load_tokenizer, prepare
from loraplex.pipelines.lease import RunnerLease
from loraplex.pipelines.schedule import learning_rate
from loraplex.pipelines.trainer import ServiceTrainer
from loraplex.protocol.checkpoint_paths import split_tinker_path
from loraplex.protocol.results import ForwardBackwardResult, OptimStepResult, SaveResult
from loraplex.runtime.fsutil import PRIVATE_DIR_MODE, PRIVATE_FILE_MODE, private_dirs
from loraplex.service import Services, TenantRef, delete_adapter, export_peft, write_session
from loraplex.service.context import blob_store
from loraplex.service.model_files import tokenizer_folder
from loraplex.service.pipeline_config import PipelineConfig, total_steps
from loraplex.service.pipeline_tokenizer import tokenizer_root, tokenizer_source
from loraplex.service.pipelines import export_dir
from loraplex.service.tenant_auth import tenant_ref
from loraplex.service.tenant_rules import refusal
from loraplex.storage.enums import TenantState
from loraplex.storage.models import Pipeline, PipelineState
from loraplex.storage.repositories import PipelineRepository, TenantRepository, pipeline_tenant

log = logging.getLogger("loraplex.pipelines")

# Errors that say a part of the service is briefly away: the task is retried later (and resumes), not failed.
TRANSIENT_ERRORS = (ServiceUnavailableError, redis.ConnectionError, redis.TimeoutError, OperationalError)
EVAL_CHUNK = 32  # eval datums per forward request


class LeaseLostError(RuntimeError):
    """This run's lease lapsed and another run may own the pipeline: stop, record nothing more."""


class TenantPausedError(RuntimeError):
    """An operator suspended or drained the pipeline's tenant: the pipeline waits (its task is handed out again later)
    and goes on from its last checkpoint once the tenant is active, as after a killed worker."""


def tenant_of(services: Services, pipeline_id: str) -> TenantRef:
    """The pipeline's tenant with its state and quotas: its requests meet the rules the gateway applies to the tenant's
    own calls."""
    with services.sessions() as db:
        return tenant_ref(TenantRepository(db).get(pipeline_tenant(db, pipeline_id)))


def fail_pipeline(services: Services, pipeline_id: str, message: str) -> PipelineState:
    """End the pipeline FAILED with `message` (one cancelled or finished meanwhile keeps its state)."""
    tenant = tenant_of(services, pipeline_id)
    with write_session(services) as db:
        return PipelineRepository(db, tenant.id).finish(pipeline_id, PipelineState.FAILED, message)


def run_pipeline(services: Services, pipeline_id: str, lease: RunnerLease) -> PipelineState | None:
    """Run (or resume) the pipeline to its end; returns the state it ended in, None when it had ended before.
    Transient errors and LeaseLostError propagate (the task retries); any other error fails the pipeline with its
    type and message (its traceback goes to the worker's log only). TenantPausedError while the tenant is not active."""
    tenant = tenant_of(services, pipeline_id)
    if tenant.state != TenantState.ACTIVE:
        raise TenantPausedError(refusal(tenant.name, tenant.state, tenant.state_reason).message)
    with write_session(services) as db:
        row = PipelineRepository(db, tenant.id).start_attempt(pipeline_id)
    if row is None:
        return None
    run = _Run(services, tenant, row, lease)
    try:
        return run.train()
    except (*TRANSIENT_ERRORS, LeaseLostError, TenantPausedError):
        raise
    except ForbiddenError as exc:  # refused mid-run: an operator suspended or drained the tenant meanwhile?
        if tenant_of(services, pipeline_id).state != TenantState.ACTIVE:
            raise TenantPausedError(exc.message) from None
        return run.fail(f"{type(exc).__name__}: {exc.message}")
    except LoraplexError as exc:
        return run.fail(f"{type(exc).__name__}: {exc.message}")
    except Exception as exc:  # noqa: BLE001 - a bug must still end the pipeline with a message, not leave it RUNNING
        log.exception("pipeline %s failed", pipeline_id)
        return run.fail(f"{type(exc).__name__}: {exc}")


class _Run:
    def __init__(self, services: Services, tenant: TenantRef, row: Pipeline, lease: RunnerLease) -> None:
        self.services, self.tenant, self.row, self.lease = services, tenant, row, lease
        self.config = PipelineConfig.model_validate(row.config)
        self.trainer: ServiceTrainer | None = None

    def _repo(self, db) -> PipelineRepository:
        return PipelineRepository(db, self.tenant.id)

    def fail(self, message: str) -> PipelineState:
        message = without_server_paths(self.services, message)
        with write_session(self.services) as db:
            state = self._repo(db).finish(self.row.id, PipelineState.FAILED, message)
        self._drop_adapter()
        return state

    def _drop_adapter(self) -> None:
        if self.trainer is not None:
            _delete_quietly(self.services, self.tenant, self.trainer.model_id)

    def _tokenizer(self):
        """The config's tokenizer (service/pipeline_tokenizer.py: a registered model, or a folder under the
        tokenizer root), else the base model's."""
        settings = self.services.settings
        kind, where = tokenizer_source(settings, self.config.tokenizer or settings.base_model)
        if kind == "folder":
            return load_tokenizer(where, shown=self.config.tokenizer)
        if where != settings.base_model:  # a preset: the registry builds (or finds) its folder in the model cache
            with TRANSFORMERS_IMPORT:
                from loraplex.models.registry import load_tokenizer as preset_tokenizer

                return preset_tokenizer(where, settings.resolved_model_cache)
        folder = tokenizer_folder(settings, settings.base_model)
        if folder is None:
            raise InvalidRequestError(f"no tokenizer: the base model {settings.base_model!r} has none; set tokenizer")
        return load_tokenizer(folder, shown=where)

    def _check_tenant_active(self, step: int) -> None:
        """TenantPausedError when an operator suspended or drained the tenant since the run started (one read a
        step: the run's tenant was read at its start)."""
        tenant = tenant_of(self.services, self.row.id)
        if tenant.state != TenantState.ACTIVE:
            why = refusal(tenant.name, tenant.state, tenant.state_reason).message
            raise TenantPausedError(f"pipeline {self.row.id} waits before step {step}: {why}")

    def _start_adapter(self) -> int:
        """This run's adapter, fresh or from the last checkpoint; returns the step it continues after."""
        row, settings = self.row, self.services.settings
        model_id = f"pipeline-{row.id}-{row.attempt}"
        timeout = settings.pipeline_step_timeout_seconds
        metadata = {"pipeline_id": row.id, "attempt": row.attempt}
        if row.last_checkpoint and row.last_checkpoint_step is not None:
            self.trainer = ServiceTrainer.from_checkpoint(
                self.services, self.tenant, model_id, timeout, path=row.last_checkpoint, metadata=metadata
            )
            start = row.last_checkpoint_step
        else:
            lora = self.config.lora
            self.trainer = ServiceTrainer.create(self.services, self.tenant, model_id, timeout, rank=lora.rank,
                                                 alpha=lora.alpha, seed=self.config.seed, metadata=metadata)  # fmt: skip
            start = 0
        with write_session(self.services) as db:
            self._repo(db).set_adapter(row.id, model_id)
            self._repo(db).rewind(row.id, start)
        if row.model_id and row.model_id != model_id:
            _delete_quietly(self.services, self.tenant, row.model_id)  # the interrupted run's adapter
        if start:
            log.info("pipeline %s: attempt %d resumes after step %d from %s", row.id, row.attempt, start,
                     row.last_checkpoint)  # fmt: skip
        return start

    def train(self) -> PipelineState:
        config, row = self.config, self.row
        train, evals = prepare(config, blob_store(self.services).path(row.dataset_key), self._tokenizer())
        total = total_steps(config, len(train))
        if total != row.total_steps:
            raise InvalidRequestError(f"the dataset gives {total} steps; {row.total_steps} were planned")
        start = self._start_adapter()
        trainer = self.trainer
        assert trainer is not None
        for step in range(start + 1, total + 1):
            if self.lease.lost:
                raise LeaseLostError(f"pipeline {row.id}: lease lost before step {step}")
            self._check_tenant_active(step)
            batch = [train[i] for i in batch_indices(len(train), config.batch_size, config.seed, step)]
            fb = trainer.forward_backward([e.datum() for e in batch])
            opt = trainer.optim_step(self._adam(step, total))
            loss_sum = trainer.wait(fb, ForwardBackwardResult).loss_sum
            trainer.wait(opt, OptimStepResult)
            with write_session(self.services) as db:
                state = self._repo(db).record_step(row.id, step, loss_sum / _scored(batch))
            if state != PipelineState.RUNNING:
                log.info("pipeline %s: %s after step %d", row.id, state, step)
                self._drop_adapter()
                return state
            if evals and ((config.eval_every and step % config.eval_every == 0) or step == total):
                loss = self._evaluate(evals)
                with write_session(self.services) as db:
                    self._repo(db).record_eval(row.id, step, loss)
            if config.checkpoint_every and step % config.checkpoint_every == 0 and step < total:
                saved = trainer.wait(trainer.save_state(f"step-{step}", config.checkpoint_ttl_seconds), SaveResult)
                path = saved.tinker_path
                with write_session(self.services) as db:
                    self._repo(db).record_checkpoint(row.id, path, step)
        return self._finish()

    def _adam(self, step: int, total: int) -> dict[str, float]:
        opt = self.config.optimizer
        return {"learning_rate": learning_rate(opt, step, total), "beta1": opt.beta1, "beta2": opt.beta2,
                "eps": opt.eps, "weight_decay": opt.weight_decay, "grad_clip_norm": opt.grad_clip_norm}  # fmt: skip

    def _evaluate(self, evals: list[Example]) -> float:
        """Mean loss per completion token over the eval split (forward only: no gradient, weights unchanged)."""
        assert self.trainer is not None
        refs = [self.trainer.forward([e.datum() for e in evals[i : i + EVAL_CHUNK]])
                for i in range(0, len(evals), EVAL_CHUNK)]  # fmt: skip
        loss_sum = sum(self.trainer.wait(ref, ForwardBackwardResult).loss_sum for ref in refs)
        return loss_sum / _scored(evals)

    def _finish(self) -> PipelineState:
        assert self.trainer is not None
        final = self.trainer.wait(self.trainer.save_weights_for_sampler("final"), SaveResult).tinker_path
        with write_session(self.services) as db:
            self._repo(db).record_final(self.row.id, final)
        if self.config.export:
            folder = export_final(self.services, self.tenant, self.row.id, final)
            with write_session(self.services) as db:
                self._repo(db).record_export(self.row.id, folder)
        with write_session(self.services) as db:
            state = self._repo(db).finish(self.row.id, PipelineState.SUCCEEDED)
        self._drop_adapter()
        return state


def export_final(services: Services, tenant: TenantRef, pipeline_id: str, final_checkpoint: str) -> str:
    """The final sampler weights as a PEFT folder under the pipeline folder (the service's export); its path."""
    model_id, _, _ = split_tinker_path(final_checkpoint)
    out = export_dir(services, tenant.id, pipeline_id)
    private_dirs(out.parent)
    folder = export_peft(services, tenant, model_id, final_checkpoint, out).folder
    # Owner-only, as every tenant file on the server: the tenant downloads it through the API (export_url).
    os.chmod(folder, PRIVATE_DIR_MODE)
    for path in folder.iterdir():
        if path.is_file():
            os.chmod(path, PRIVATE_FILE_MODE)
    return str(folder)


def without_server_paths(services: Services, message: str) -> str:
    """`message` (a pipeline's error, which its tenant reads) with the server's folders (the state home, blob store,
    pipelines and tokenizer folders, model cache) named by role instead of by path."""
    settings = services.settings
    folders = {
        str(settings.resolved_blob_root): "<blob store>",
        str(settings.resolved_pipeline_dir): "<pipeline folder>",
        str(tokenizer_root(settings)): "<tokenizer root>",
        str(settings.resolved_model_cache): "<model cache>",
        str(settings.home): "<server home>",
    }
    for folder, role in sorted(folders.items(), key=lambda item: -len(item[0])):  # the longest (innermost) first
        message = message.replace(folder, role)
    return message


def _scored(examples: list[Example]) -> float:
    return sum(e.scored_tokens for e in examples) or 1.0


def _delete_quietly(services: Services, tenant: TenantRef, model_id: str) -> None:
    """Delete an adapter through the queue; one already deleted (or never created) is fine."""
    with contextlib.suppress(NotFoundError, ConflictError):
        delete_adapter(services, tenant, model_id)
