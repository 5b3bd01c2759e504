"""Typed settings, one place. Every field reads `LORAPLEX_<NAME>` from the environment."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

# Spellings of the `dtype` setting besides bf16 / fp16 / fp32 (torch's names).
DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LORAPLEX_", extra="ignore")

    # Where state lives when nothing else is said: SQLite file, blobs, model cache, logs.
    home: Path = Field(default_factory=lambda: Path.home() / ".loraplex")
    # SQLAlchemy URL; empty means SQLite under `home`.
    database_url: str = ""
    # Redis URL; empty means `serve --embedded` starts its own redis-server child.
    redis_url: str = ""
    # Checkpoint files; empty means `home/blobs`.
    blob_root: Path | None = None
    # Cache of built model presets (tiny weights + tokenizer), shared by every process.
    model_cache: Path | None = None

    base_model: str = "tiny"
    pool: str = "default"
    # Resident adapter slots per worker rank.
    slots: int = 8
    # Largest LoRA rank a pool accepts; every bank is padded to it.
    max_rank: int = 16
    # Comma-separated in the environment (NoDecode: not parsed as JSON first).
    target_modules: Annotated[tuple[str, ...], NoDecode] = DEFAULT_TARGET_MODULES
    # Tokens per microbatch before gradient accumulation kicks in.
    microbatch_tokens: int = 4096
    # Activation recomputation per decoder layer (workers/engine/recompute.py): "auto" recomputes the layers of a
    # microbatch of more than `checkpoint_above_tokens` tokens in its backward (only a datum longer than
    # microbatch_tokens makes one that large), "always", or "never".
    activation_checkpointing: Literal["auto", "always", "never"] = "auto"
    checkpoint_above_tokens: int = Field(default=16384, ge=1)
    # CUDA only (no effect on the CPU): the decoder body of one-rank training microbatches replayed as CUDA graphs
    # (workers/engine/body_graphs.py), and the base model's norms, rotary embedding and MLP activation as Triton kernels
    # (workers/kernels/fused_elementwise.py), and the LM head's log-softmax too (workers/kernels/triton_lm_head.py). false: HF's eager
    # code and the chunked torch log-softmax.
    cuda_graphs: bool = True
    fused_kernels: bool = True
    # The LoRA layers that read one input (q/k/v, gate/up) as one node sharing their A product (workers/lora/
    # siblings.py); false: each layer alone. Unset: the engine's default (on).
    shared_lora_inputs: bool | None = None
    # Tokens of all tenants the dispatcher packs into one forward_backward step; the engine splits the step into
    # microbatches of `microbatch_tokens` (with gradient accumulation), so several saturated tenants share one plan
    # and one batched optimizer step instead of running one by one.
    plan_tokens: int = 16384
    # How long (ms) an underfilled plan may wait for the tenants whose results it just handed out, so tenants training
    # in a closed loop keep sharing one step (dispatch/coalescing.py). 0: plan at the first arrival.
    coalesce_ms: float = Field(default=50.0, ge=0)
    # true: an underfilled plan that already fills whole microbatches (`microbatch_tokens`) runs those at once instead
    # of waiting for tenants whose requests could only start another microbatch; the rest waits for them, and their
    # round trips overlap the running plan (dispatch/coalescing.py). Off until measured on the GPU (on the CPU the
    # clients and the pool share two cores, so nothing overlaps there: RESULTS.md, 2026-12-05, CPU).
    coalesce_early_full_microbatches: bool = False
    # A plan's rounds answered each as it ends (dispatch/policy.plan_rounds): a tenant whose step ran in an early round
    # sends its next one while the later rounds run. Unset: on when the engine runs on CUDA (its host thread waits on
    # the device meanwhile), off on the CPU, where the clients, the gateway and Redis would take the engine's cores:
    # 32 closed-loop tenants on two cores ran 25% slower answered by round (RESULTS.md, 2026-12-07, CPU).
    answer_rounds: bool | None = None
    # Cost-model coalescing (dispatch/step_split.py): the dispatcher runs a round's forward_backward requests as the
    # split into engine steps (one mixed step, per adapter, or full adapters apart) its step cost model predicts
    # cheapest, calibrated online from the pool's measured step times. false: always one mixed step.
    cost_model: bool = True
    # How long the dispatcher trusts a tenant's fair-share weight (tenants.weight) before reading it again.
    tenant_weight_cache_seconds: float = Field(default=30.0, ge=0)
    # Host memory (MiB) for adapters evicted from the slots (their whole training state, pinned on CUDA); past it the
    # least recently used ones are spilled to disk, under `spill_dir` (empty: home/spill), one folder per pool and rank.
    host_budget_mb: float = Field(default=2048, ge=0)
    spill_dir: Path | None = None
    device: str = "cpu"
    # torch's threads per rank of a CPU pool. 0: the machine's cores less one, shared by the ranks (at least 1), so the
    # gateway, Redis and clients on the same machine keep a core: torch's OpenMP threads wait for each other at every
    # op, and with every core taken one descheduled thread held a 23-token step for 1.4 s (tests/security).
    pool_cpu_threads: int = Field(default=0, ge=0)
    # The base model's weights and activations on every rank: auto = bf16 on CUDA, fp32 on CPU. The LoRA banks keep
    # fp32 master weights (and Adam state) whatever this is; they are cast to it per microbatch.
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    # Ranks in the worker pool (one process per GPU on CUDA; gloo processes on CPU). 1: no process group at all. Under
    # torchrun its WORLD_SIZE wins.
    world_size: int = Field(default=1, ge=1)
    # How a pool of several ranks holds the base model: "fsdp" shards its weights per decoder layer (FSDP2; for a base
    # too big for one device), "replicate" keeps a whole copy on every rank (plain data parallelism over rows: no
    # collectives in the forward, CUDA graphs as on one rank). The LoRA banks are replicated either way. RESULTS.md
    # measures which wins at which size.
    pool_layout: Literal["fsdp", "replicate"] = "fsdp"
    # Native sampling on an "fsdp" pool of several ranks decodes on a whole copy of the base model per rank (one more
    # base in the compute dtype: ~8 GB for a 4B model in bf16; workers/sampling/replica.py), built at the pool's start
    # only if it takes at most this fraction of the device's free memory then; else sampling requests fail saying so.
    # 0: never build one. "replicate" pools need none.
    sampler_replica_fraction: float = Field(default=0.5, ge=0, le=1)
    # One leader per pool: the pool process holds a lease in Redis for this many seconds, renewed every third of it
    # (queue/lease.py). A pool process killed without releasing it is replaced this long after its last renewal.
    leader_lease_seconds: float = Field(default=10.0, gt=0)
    # Failover (pool/failover.py): a pool whose lease has lapsed, nobody having taken it over, and whose last
    # registration is older than this has its adapters handed to live sibling pools of its base model by one of them
    # (once that one has also seen it dead for a lease TTL). Above the time a pool takes to restart, which keeps them.
    pool_failover_seconds: float = Field(default=30.0, gt=0)
    # A second pool process for a pool whose lease another holds: True waits (a standby that takes over when the
    # lease lapses), False exits at once with a message naming the holder.
    leader_wait: bool = True

    # Prometheus metrics (docs/architecture/metrics.md). The pool process serves its own at
    # http://<pool_metrics_host>:<pool_metrics_port>/metrics (port 0: no server) and writes them to Redis every
    # `pool_metrics_publish_seconds`, so every gateway serves them too, at GET /metrics/pools (its own request metrics
    # are at GET /metrics). With `metrics_token` set, each of these answers only `Authorization: Bearer <token>` (else
    # 401); empty: open, as Prometheus scrapes usually are (the series hold counts and tenant ids, no tenant data).
    pool_metrics_port: int = Field(default=0, ge=0, le=65535)
    pool_metrics_host: str = "127.0.0.1"
    pool_metrics_publish_seconds: float = Field(default=2.0, gt=0)
    metrics_token: str = ""
    # /metrics/pools names every tenant's request kinds, tokens and queue depths: with no `metrics_token` it answers
    # 403 unless this is true (an operator's explicit choice to serve it open, e.g. on a private network). The
    # gateway's own /metrics holds route templates and status codes only (no tenant), so it stays open without a token.
    metrics_open: bool = False
    # A plan whose execution took at least this many seconds is logged (INFO, the pool's log) with where the time
    # went: swaps, each step kind, CUDA-graph captures made in it, its tokens and adapters, the garbage collector's
    # seconds since the plan before. 0: never.
    slow_plan_log_seconds: float = Field(default=1.0, ge=0)
    # Durable adapter state (loraplex/durable/): each adapter's whole training state (weights, unconsumed gradients,
    # Adam moments, step count, hyperparameters, the applied seq_id) is written as a versioned snapshot under the blob
    # store (<blob_root>/<tenant>/<model>/snapshots/) by a writer thread from a host copy, every
    # `snapshot_every_steps` optimizer steps or after `snapshot_every_seconds` (checked after each plan, and once a
    # second while idle; 0 turns that trigger off), and on a clean stop; the newest `snapshot_keep` are kept. The requests answered since stay in the
    # adapter's request log in Redis (queue/replay_log.py). A restarted pool adopts the newest valid snapshot and
    # replays the log. False: no snapshots and no log (a restarted pool loses its adapters' state).
    durable_snapshots: bool = True
    snapshot_every_steps: int = Field(default=20, ge=0)
    snapshot_every_seconds: float = Field(default=60.0, ge=0)
    snapshot_keep: int = Field(default=2, ge=2)
    # The embedded redis-server's append-only file fsync policy (redis_child.py says why): "always" (the default: each
    # change written and fsynced before the answer, so neither a killed redis-server nor a machine crash loses
    # anything answered), "no" (written before the answer, flushed by the kernel: a killed redis-server loses nothing,
    # a machine crash up to ~30 s) or "everysec" (even a killed redis-server may lose answered writes while a slow
    # fsync runs).
    redis_appendfsync: Literal["always", "no", "everysec"] = "always"
    # The embedded stack and `loraplex worker` restart a pool process (and the stack its gateway and redis-server)
    # that dies, after `restart_backoff_seconds` (doubling while it keeps dying within a minute, up to 30 s). False: a
    # dead child ends the stack, and `loraplex worker` runs the pool in its own process.
    supervise: bool = True
    restart_backoff_seconds: float = Field(default=0.5, ge=0)

    api_host: str = "127.0.0.1"
    api_port: int = 8700
    # Gateway processes under `serve --embedded` (uvicorn --workers; the gateway is stateless). 0: one per 4 CPU cores,
    # at least 1, at most 4, so a burst of tenants' requests is parsed and queued in parallel.
    api_workers: int = Field(default=0, ge=0)
    # How long a gateway process trusts an API key it checked (so a training call does not query SQL for it each
    # time): a revoked key stops working within this many seconds. 0: check every request.
    auth_cache_seconds: float = Field(default=2.0, ge=0)
    # Longest a `GET /v1/futures/{id}` long-poll waits before answering "pending".
    long_poll_seconds: float = 20.0
    # Longest a Tinker `retrieve_future` waits before answering try_again (the SDK's poll times out at 45 s and
    # re-polls at once, so the wait is what keeps it from spinning).
    tinker_long_poll_seconds: float = Field(default=30.0, ge=0, le=40)
    # Longest `/v1/completions` and `/v1/chat/completions` (api/openai/) wait for their samples before answering
    # 408 (the request stays queued; its result is at GET /v1/futures/{id}). Each waiting call holds a worker thread.
    openai_wait_seconds: float = Field(default=120.0, gt=0, le=3600)
    # Worker threads per gateway process for its sync routes; each waiting long-poll holds one (and a Redis connection).
    gateway_threads: int = Field(default=512, ge=8)
    # Long-polls (futures, Tinker retrieve_future, the OpenAI routes' wait) one tenant may hold at once on one gateway
    # process (service/long_polls.py: 429 + Retry-After past it), so one tenant's outstanding futures cannot hold the
    # threads and Redis connections every other tenant needs.
    max_long_polls_per_tenant: int = Field(default=64, ge=1)
    # Long-polls of all tenants on one gateway process; at most half of `gateway_threads`, so short calls always
    # find a thread. They wait on a Redis connection pool of their own, this size, apart from the short calls' pool.
    max_long_polls: int = Field(default=256, ge=1)
    # Ask Tinker SDK clients (client/config's proto_compress_fwdbwd) to zstd-compress forward_backward bodies.
    tinker_compress_fwdbwd: bool = False
    # A Tinker session whose last heartbeat (the SDK beats every 10 s) is older than this is finished by the gateway's
    # session reaper (every `session_reap_seconds`, one gateway at a time), which frees its adapters the way
    # `sessions/{id}/finish` does (service/sessions.py). 0: sessions never expire.
    session_expiry_seconds: float = Field(default=600.0, ge=0)
    session_reap_seconds: float = Field(default=60.0, gt=0)
    # How often the pool process writes its heartbeat (and state) to the `pools` table. A gateway counts a pool as
    # down (healthz 503, futures `paused_capacity`) once its last heartbeat is older than `pool_stale_seconds`
    # (3 heartbeats), so pool and gateways should share this setting.
    pool_heartbeat_seconds: float = Field(default=5.0, gt=0)
    # Largest forward_backward body (datums per request) the gateway accepts.
    max_datums_per_request: int = 1024
    # Sampling limits per request (service/sampling.py): samples, new tokens each.
    max_samples_per_request: int = Field(default=64, ge=1)
    max_sample_tokens: int = Field(default=4096, ge=1)
    # The work of one sample request, num_samples x (prompt tokens + max_tokens), checked before it is queued (413):
    # one request must not hold the sampler for long. 65,536 takes an RL group of 16 x (1,024 + 3,072) (a usual
    # group, 16 x (512 + 1,024), is 24,576); larger jobs are several requests, which the pool interleaves.
    max_sample_tokens_per_request: int = Field(default=65_536, ge=1)
    # Stop sequences per sample request on every sampling route (native, Tinker, OpenAI; a token id counts as one),
    # and characters per stop string: the sampler matches each against every new token of every row.
    max_stop_sequences: int = Field(default=16, ge=0)
    max_stop_chars: int = Field(default=256, ge=1)
    # The OpenAI routes' text, bounded in UTF-8 bytes before it is tokenized (413; tokenizing is ~1 s per MB on the
    # gateway). Unset: 16 bytes per token of max_tokens_per_datum per prompt, of max_sample_tokens_per_request in all
    # (text past that holds more tokens than a request may sample anyway, unless its tokens are unusually long).
    max_prompt_bytes: int | None = Field(default=None, ge=1)
    max_prompt_bytes_per_request: int | None = Field(default=None, ge=1)
    # Messages in one chat completion (each is rendered through the chat template before tokenizing).
    max_chat_messages: int = Field(default=1024, ge=1)
    # The tokenizer Tinker's get_info names (the SDK's get_tokenizer() loads it with AutoTokenizer.from_pretrained):
    # a Hugging Face id such as Qwen/Qwen3-4B, or a folder the clients share. Empty: the base model's name (a
    # folder's Hugging Face id from its config.json, else the folder's name), never a path on this server.
    tokenizer_id: str = ""
    # The pool's sampler: "native" (workers/sampling/sampler.py over the training engine; on several ranks each decodes its share), "vllm" (a
    # vLLM server the pool process starts and supervises, samplers/; needs the .[vllm] extra and a base model vLLM can
    # serve, e.g. the `tiny-vllm` preset on CPU) or "none" (sampling requests fail with a message saying so).
    sampler: Literal["native", "vllm", "none"] = "native"
    # Rows the native sampler decodes at once, and the memory of its KV cache (workers/sampling/kv_budget.py): "auto"
    # sizes them at pool start from the memory training leaves: the cache takes `sampler_kv_memory_fraction` of the
    # device's free memory once the engine is built (on the CPU `sampler_kv_bytes`, 64 MiB if unset), in blocks of 16
    # positions, and the rows are as many as those blocks cover at `sampler_row_tokens` (prompt + new tokens) each, at
    # most 1,024 on a GPU and 32 on the CPU. 256 and not a longer row: the samples of one prompt share its blocks and a
    # sample waits for blocks as it waits for rows, so rows beyond what the blocks hold cost only idle table columns,
    # while too few rows split an RL batch into waves (224 rows of 512 tokens took 16 x 16 samples of 128 + 256 tokens
    # in two, on an H100). An integer forces the rows. The policy keeps at most this many sampled sequences in flight
    # (times the pool's ranks; dispatch/policy.py). `sampler_kv_bytes` set on a GPU replaces the fraction.
    sampler_max_rows: int | Literal["auto"] = "auto"
    sampler_kv_memory_fraction: float = Field(default=0.25, gt=0, lt=1)
    sampler_kv_bytes: int | None = Field(default=None, ge=0)
    sampler_row_tokens: int = Field(default=256, ge=1)
    # Longest slice of native sampling one plan runs (a long generation goes on over the next plans,
    # workers/sampling/step.py). A slice runs after its plan's training is answered, for at most as long as that
    # training took, and ends after the current decode step once requests other than samples arrive; so this bounds
    # only how often an otherwise idle pool re-plans (new samples start, finished ones are answered): ~1 ms of
    # per-plan overhead against 100 ms of decoding.
    sample_slice_ms: float = Field(default=100.0, gt=0)
    # Sample runs in flight at once on a pool (each holds its decode cache and weights); newer requests wait unstarted.
    sample_runs_in_flight: int = Field(default=4, ge=1)
    # A request entry left unacknowledged this long by a consumer that is gone is taken over by the dispatcher (its own
    # entries, held across plans or being finished, are kept fresh and never taken back).
    stale_claim_ms: int = Field(default=30_000, ge=1)
    # Sampler copies (the frozen weights a save_weights_for_sampler keeps in the pool's adapter store) a pool keeps per
    # adapter; older ones reload from their files. The name (LORAPLEX_SAMPLER_SNAPSHOTS_PER_ADAPTER) keeps its older
    # word because operators set it: renaming it would silently drop their value.
    sampler_snapshots_per_adapter: int = Field(default=4, ge=1)
    vllm_max_loras: int = Field(default=8, ge=2)  # adapters the vLLM server holds at once (one is the zero adapter)
    # How long the checkpoint of an unnamed save_weights_for_sampler (save_weights_and_get_sampling_client) is kept.
    unnamed_sampler_ttl_seconds: int = Field(default=24 * 3600, gt=0)
    # The web admin (/admin, loraplex/admin/). Its session cookies are signed with `admin_secret`; empty: a random
    # secret kept in home/admin-secret (made once, mode 0600), which gateways sharing that home share.
    admin_secret: str = ""
    admin_session_seconds: int = Field(default=8 * 3600, gt=0)
    # Wrong passwords in a row; each `admin_max_failed_logins`-th locks the account for `admin_lockout_seconds` against
    # browsers without its trusted-device cookie (one that logged in to it before): a guesser cannot lock its admin out.
    admin_max_failed_logins: int = Field(default=5, ge=1)
    admin_lockout_seconds: int = Field(default=15 * 60, gt=0)
    admin_trusted_device_days: int = Field(default=30, ge=1)  # how long that cookie vouches for a browser
    # Login attempts (admin/login_limits.py: 429 + Retry-After past them) per client address and per typed username in
    # `admin_login_window_seconds`, and scrypt checks at once per gateway process: they bound the CPU a flood of
    # guesses takes from the tenants' requests (each check is ~30 ms of one core).
    admin_login_attempts_per_client: int = Field(default=10, ge=1)
    admin_login_attempts_per_account: int = Field(default=10, ge=1)
    admin_login_window_seconds: float = Field(default=60.0, gt=0)
    admin_login_checks_at_once: int = Field(default=1, ge=1)
    # A login refused by those limits is answered after this delay (no thread held), so a client retrying at once
    # cannot make the gateway spin on refusals.
    admin_login_refusal_delay_seconds: float = Field(default=1.0, ge=0, le=30)
    # The session cookie's Secure flag: None (default) sets it on requests that came over HTTPS (the scheme, or
    # X-Forwarded-Proto from a proxy uvicorn trusts: its --forwarded-allow-ips); True always; False never.
    admin_cookie_secure: bool | None = None
    max_tokens_per_datum: int = 32768
    # loss_fn_inputs per datum (the losses read at most four: target_tokens, weights, logprobs, advantages; the
    # cookbook adds a mask): each is as long as its datum, so a request decodes at most (1 + this) x its tokens.
    max_loss_inputs_per_datum: int = Field(default=8, ge=1)
    # Admission control (api/admission.py, queue/producer.py). A body over `max_body_bytes` is a 413 as soon as that
    # many bytes were read (before any parsing); a request over `max_tokens_per_request` input tokens a 413 too (the
    # pool runs an accepted large request in plans of at most `plan_tokens`, so it never holds others back long).
    max_body_bytes: int = Field(default=32 * 2**20, ge=1024)
    # A request without a valid API key (the public routes: healthz, metrics, the admin's forms) may send at most
    # this many body bytes (413 past it); a route that needs a key answers 401 before reading any (api/door.py).
    max_anonymous_body_bytes: int = Field(default=64 * 2**10, ge=1024)
    # The whole body must arrive within this many seconds of the request (408 past it), so a client that trickles
    # or stops sending its body cannot hold a connection and its request's memory forever.
    body_read_timeout_seconds: float = Field(default=30.0, gt=0)
    max_tokens_per_request: int = Field(default=262_144, ge=1)
    # Per-tenant quotas on each pool (429; the queue ones with Retry-After). 0: no limit.
    max_queued_requests_per_tenant: int = Field(default=4096, ge=0)
    max_queued_tokens_per_tenant: int = Field(default=4 * 2**20, ge=0)
    max_adapters_per_tenant: int = Field(default=256, ge=0)
    # Checkpoints each tenant keeps (every adapter's, deleted adapters' too) and the bytes they hold, its saves still
    # queued counted in (service/checkpoint_quota.py), so one tenant cannot fill the blob store: a save past either
    # is a 429 naming it, without Retry-After (deleting checkpoints, or their expiry, frees room). 0: no limit.
    max_checkpoints_per_tenant: int = Field(default=1000, ge=0)
    max_checkpoint_bytes_per_tenant: int = Field(default=100 * 2**30, ge=0)
    # Requests per second each tenant may send to one gateway process (service/rate_limit.py: 429 + Retry-After); 0: off.
    tenant_requests_per_second: float = Field(default=200.0, ge=0)
    tenant_request_burst: int = Field(default=400, ge=1)

    # Offline fine-tuning pipelines (loraplex/pipelines/, Celery). The broker: empty means `redis_url`.
    celery_broker_url: str = ""
    # The Celery queue the pipeline, report and export tasks go to (workers consume it: `-Q`, default this).
    celery_queue: str = "loraplex-pipelines"
    # Seconds the Redis broker waits for a task's ack before it hands the task to another worker (acks_late: a worker
    # killed mid-pipeline leaves its task unacked). A running pipeline holds a lease (below), so a task handed out
    # again while its first run lives waits for the lease instead of training twice.
    celery_visibility_timeout_seconds: float = Field(default=3600.0, gt=0)
    # How often a Celery worker looks for unacked tasks past the visibility timeout (kombu's restore sweep).
    celery_restore_interval_seconds: float = Field(default=10.0, gt=0)
    # A running pipeline's lease in Redis, renewed every third of it: a pipeline whose worker died is taken over by
    # another worker this long after the last renewal.
    pipeline_lease_seconds: float = Field(default=30.0, gt=0)
    # Longest a pipeline waits for one training step's result before it fails (the pool down that long).
    pipeline_step_timeout_seconds: float = Field(default=900.0, gt=0)
    # Records per dataset split a pipeline accepts (the client uploads them with the config).
    pipeline_max_records: int = Field(default=200_000, ge=1)
    # Pipelines one tenant may have queued or running (a sweep's points count one each): a submission past it is a 429
    # naming it, without Retry-After (room frees as they end, or by cancelling). 0: no limit.
    max_pipelines_per_tenant: int = Field(default=128, ge=0)
    # Pipelines of one tenant training at once over all Celery workers (pipelines/tenant_slots.py); its others wait
    # queued, looked at again every `pipeline_slot_wait_seconds` without holding a worker slot, so one tenant's sweep
    # cannot take every worker slot while another tenant's pipeline waits. 0: no cap.
    max_running_pipelines_per_tenant: int = Field(default=2, ge=0)
    pipeline_slot_wait_seconds: float = Field(default=5.0, gt=0)
    # The folder a pipeline config's `tokenizer` may name a folder under (the operator fills it); empty means
    # `home/tokenizers`. Otherwise `tokenizer` must be a registered model name: nothing else on the workers is reachable.
    pipeline_tokenizer_root: Path | None = None
    # Where pipelines write their PEFT exports and sweep reports; empty means `home/pipelines`.
    pipeline_dir: Path | None = None
    # Celery beat: expired checkpoints deleted (storage/retention.py), finished pipelines' missing exports written.
    retention_interval_seconds: float = Field(default=300.0, gt=0)
    export_interval_seconds: float = Field(default=300.0, gt=0)
    # `serve --embedded` starts and supervises one pipelines worker (Celery, with the beat schedule; its log is
    # home/logs/pipelines.log); false: none (start one with `loraplex pipelines worker`).
    embedded_pipeline_worker: bool = True
    # Pipelines one worker trains at once (its threads): the embedded one's and `loraplex pipelines worker`'s default.
    pipeline_worker_concurrency: int = Field(default=4, ge=1)
    # How often a pipelines worker says it is alive (queue/pipeline_workers.py); it counts as dead three beats later.
    pipeline_worker_heartbeat_seconds: float = Field(default=5.0, gt=0)
    # Tests only: while this file exists the pool writes no sampler save's files (they wait), so a test can kill the
    # pool between a save's answer and its files, a fault nothing outside the pool can cause. Unset in production.
    test_hold_writes_file: Path | None = None

    @field_validator("target_modules", mode="before")
    @classmethod
    def _split_modules(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(v.strip() for v in value.split(",") if v.strip())
        return value

    @field_validator("sampler_max_rows", mode="before")
    @classmethod
    def _rows_auto_or_positive(cls, value: object) -> object:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value.strip())
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"LORAPLEX_SAMPLER_MAX_ROWS must be 'auto' or an integer >= 1, got {value!r}")
        return value

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_alias(cls, value: object) -> object:
        if isinstance(value, str):
            value = value.strip().lower()
            return DTYPE_ALIASES.get(value, value)
        return value

    @property
    def resolved_dtype(self) -> str:
        """bf16, fp16 or fp32: `dtype` with auto decided by the device."""
        if self.dtype != "auto":
            return self.dtype
        return "bf16" if self.device.startswith("cuda") else "fp32"

    @property
    def resolved_answer_rounds(self) -> bool:
        """`answer_rounds` with unset decided by the device."""
        return self.device.startswith("cuda") if self.answer_rounds is None else self.answer_rounds

    @property
    def resolved_api_workers(self) -> int:

        return self.api_workers or max(1, min(4, (os.cpu_count() or 1) // 4))

    @property
    def resolved_pool_cpu_threads(self) -> int:
        return self.pool_cpu_threads or max(1, ((os.cpu_count() or 1) - 1) // self.world_size)

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home / 'loraplex.db'}"

    @property
    def resolved_blob_root(self) -> Path:
        return self.blob_root or self.home / "blobs"

    @property
    def resolved_model_cache(self) -> Path:
        return self.model_cache or self.home / "models"

    @property
    def resolved_celery_broker_url(self) -> str:
        return self.celery_broker_url or self.redis_url

    @property
    def resolved_pipeline_dir(self) -> Path:
        return self.pipeline_dir or self.home / "pipelines"

    @property
    def resolved_spill_root(self) -> Path:
        """This pool's spill folder; rank k spills to `<it>/rank<k>`."""
        return (self.spill_dir or self.home / "spill") / self.pool

    @property
    def pool_stale_seconds(self) -> float:
        """A pool whose last heartbeat is older than this is down: three missed heartbeats."""
        return 3 * self.pool_heartbeat_seconds

    @property
    def host_budget_bytes(self) -> int:
        return int(self.host_budget_mb * 2**20)

    @property
    def resolved_max_prompt_bytes(self) -> int:
        return self.max_prompt_bytes or 16 * self.max_tokens_per_datum

    @property
    def resolved_max_prompt_bytes_per_request(self) -> int:
        return self.max_prompt_bytes_per_request or 16 * self.max_sample_tokens_per_request


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
