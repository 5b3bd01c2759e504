"""The application layer: the service's rules as plain calls, under every front end. Each call takes the shared
`Services`, the authenticated tenant and a typed request, and answers a typed result or raises a loraplex.errors type;
the HTTP routes (api/: native, Tinker, OpenAI-compatible), the operators' console (admin/), the Celery pipelines
(pipelines/) and the `loraplex` CLI only translate their own form to these calls and back. No HTTP framework, no torch
(tests/unit/test_layers.py follows every import, lazy ones included). Writes go through storage/'s repositories;
requests go to the pools through queue/.

    adapters     create (defaults, base-model and rank checks, from_checkpoint), list, get, delete; the served models
    fleet        which base models the live pools serve (pure, from the registry); fleet_view reads it per process
    moves        an operator's move of an adapter to another pool of its base model (checked, then asked of its pool)
    training     forward_backward / forward / optim_step on their payloads, checked once (limits, datums, loss, Adam)
    checkpoints  save_state / save_weights_for_sampler / load_state payloads (name, 409, folders), list, delete;
                 across adapters by tinker path: list_all (paged), get, bulk delete, ttl, weights_info
    runs         training runs (Tinker's TrainingRun view of an adapter): get, list (paged)
    peft_export  a checkpoint as a PEFT folder (read and written with numpy: the one export, also the CLI's,
                 the pipelines' and the vLLM sampler's)
    submit       enqueue -> the future's reference; who owns a request
    sessions     client sessions: create, heartbeat, finish (frees the session's adapters), expiry
    sampling     samplers (a sampler checkpoint or the base model) and sampling requests
    pipelines    offline fine-tuning pipelines and sweeps: submit, get, list, cancel, a sweep's report files
    schemas      the typed requests and answers (pydantic), the Adam and loss fields read from protocol/
    build        build_services: the Services of a process (database sessions, Redis pools, caches)
    and beside them the gateway's shared state that is not HTTP: auth_cache, rate_limit, long_polls, pool_health,
    pool_metrics_reader, rejections (a refused step keeps its seq_id chain), checkpoint_quota, model_files
"""

from loraplex.service.adapters import (
    create_adapter,
    delete_adapter,
    get_adapter,
    list_adapters,
    served_model,
    served_models,
)
from loraplex.service.checkpoints import (
    delete_checkpoint,
    delete_checkpoints,
    get_checkpoint,
    list_all_checkpoints,
    list_checkpoints,
    load_state,
    save_state,
    save_weights_for_sampler,
    set_checkpoint_ttl,
    weights_info,
)
from loraplex.service.context import Services, TenantRef, write_session
from loraplex.service.peft_export import PeftExport, export_peft
from loraplex.service.pipelines import cancel_pipeline, get_pipeline, list_pipelines, submit_pipeline
from loraplex.service.runs import get_run, list_runs
from loraplex.service.sampling import create_sampler, get_sampler, sample, sampleable
from loraplex.service.sessions import (
    check_active,
    create_session,
    finish_session,
    heartbeat,
    reap_idle_sessions,
)
from loraplex.service.submit import owner_of
from loraplex.service.training import forward, forward_backward, optim_step

__all__ = [
    "PeftExport",
    "Services",
    "TenantRef",
    "create_adapter",
    "delete_adapter",
    "delete_checkpoint",
    "delete_checkpoints",
    "export_peft",
    "forward",
    "forward_backward",
    "get_adapter",
    "get_checkpoint",
    "get_run",
    "list_adapters",
    "list_all_checkpoints",
    "list_checkpoints",
    "list_runs",
    "load_state",
    "optim_step",
    "owner_of",
    "save_state",
    "save_weights_for_sampler",
    "set_checkpoint_ttl",
    "weights_info",
    "write_session",
    # pipelines
    "cancel_pipeline",
    "get_pipeline",
    "list_pipelines",
    "submit_pipeline",
    # sampling
    "create_sampler",
    "get_sampler",
    "sample",
    "served_model",
    "served_models",
    "sampleable",
    # sessions
    "check_active",
    "create_session",
    "finish_session",
    "heartbeat",
    "reap_idle_sessions",
]
