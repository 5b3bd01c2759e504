"""The worker pool process (`python -m loraplex.pool.process`), the pool's composition root: it wires the engine
(`workers/`, torch only) to the dispatcher (`dispatch/`), Redis (`queue/`) and SQL (`storage/`), and runs the
dispatcher as pool leader on rank 0. Service dependencies (redis, SQL) are imported in the leader only, so the rank
processes stay importable on a machine without them.

World size N > 1 (setting `world_size`, or torchrun's WORLD_SIZE): this process is rank 0 and spawns ranks 1..N-1
(under torchrun every rank runs this module and the non-zero ranks only follow). Each plan goes from rank 0 to every
rank (workers/ranks/rank_loop.py); base weights are FSDP2-sharded and rows split across ranks (workers/ranks/distributed.py).
World size 1 makes no process group at all.

One leader per pool (loraplex/pool/leadership.py): before anything is loaded, rank 0 takes the pool's lease in Redis, waiting
while another pool process holds it; every plan's writes carry its fencing token, and a lost lease stops the pool
(exit status 1). The ready file (`HOME/pool-<name>.ready`, its pid) is written by the lease holder only, once the
model is loaded, and removed only by the process whose pid it holds.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from loraplex.runtime.gcutil import GcClock, freeze_startup_objects
from loraplex.runtime.stop_signals import stop_on_signals
from loraplex.settings import Settings, get_settings

if TYPE_CHECKING:
    from pathlib import Path

    import torch
    from torch.multiprocessing import ProcessContext

    from loraplex.queue.lease import PoolLease
    from loraplex.workers.ranks.distributed import RankGroup
    from loraplex.workers.ranks.rank_loop import EngineSpec
    from loraplex.workers.state.adapter_store import AdapterStoreSpec

log = logging.getLogger("loraplex.pool")
T = TypeVar("T")

RANK_CHECK_SECONDS = 1.0


@dataclass(frozen=True)
class BaseModelLoader:
    """Loads the pool's base model on a rank's device; picklable, so spawned ranks load it themselves."""

    name: str
    cache_dir: str
    dtype: str = "fp32"  # settings.resolved_dtype: every rank loads the base model in it

    def prepare(self) -> None:
        """Build a folder preset (tiny) into the cache now, before any process group exists: transformers'
        save_pretrained writes nothing on a non-zero rank of an initialised group."""
        from loraplex.models import SHAPE_PRESETS, resolve

        if self.name not in SHAPE_PRESETS:
            resolve(self.name, self.cache_dir)

    def __call__(self, device: torch.device) -> torch.nn.Module:
        from loraplex.models import load_base_model, torch_dtype

        model, _tokenizer = load_base_model(self.name, self.cache_dir, dtype=torch_dtype(self.dtype), device=device)
        return model


def hold_writes(settings: Settings) -> Callable[[], None] | None:
    """Tests only (`test_hold_writes_file`): the background writer waits while that file exists."""
    path = settings.test_hold_writes_file
    if path is None:
        return None

    def hold() -> None:
        while path.exists():
            time.sleep(0.05)

    return hold


def native_sampling(
    settings: Settings,
    engine: Any,
    store: Any,
    group: Any,
    others_waiting: threading.Event | None = None,
    written: Callable[[str], None] | None = None,
) -> Any:
    """The SAMPLE step over this engine (workers/sampling/step.py), or None (no sampler: its requests fail saying so):
    settings.sampler "none", or "vllm" on a multi-rank pool; for a model it does not support (an MoE), a step whose
    requests fail with the reason (logged too). With several ranks every rank builds its own (rank 0 and the
    followers alike) and decodes its share of each run's jobs (workers/ranks/sampling.py)."""
    if settings.sampler == "vllm" and group is None:
        return vllm_sampling(settings, written)
    if settings.sampler != "native":
        return None
    from loraplex.errors import LoraplexError, NotSupportedError
    from loraplex.models import load_tokenizer
    from loraplex.workers.sampling.sampler import Sampler
    from loraplex.workers.sampling.step import SampleStep

    try:
        tokenizer = load_tokenizer(settings.base_model, settings.resolved_model_cache)
        engine = sampling_engine(settings, engine, group)  # several ranks: a whole base model to decode on
        budget = sampler_budget(settings, engine)
        # The paged cache's blocks: what the memory left after training's share holds. Not on the CPU: a decoder
        # with a block budget is 4,096 positions wide or more, and the CPU's attention gathers every column (tiny
        # model, 8 x 8 x 64 new tokens: 450 new tok/s budgeted, 10,401 not; benchmarks/bench_rl.py).
        kv_blocks = budget.blocks if engine.device.type == "cuda" else None
        sampler = Sampler(engine, tokenizer, max_rows=budget.rows, kv_blocks=kv_blocks)
        if group is not None:  # each rank decodes its share of a run's jobs
            sampler = rank_sampler(sampler, group)
        return SampleStep(sampler, store, settings.sample_slice_ms / 1000, settings.sample_runs_in_flight,
                          others_waiting.is_set if others_waiting is not None else None, written)  # fmt: skip
    except (LoraplexError, OSError) as exc:
        log.warning("pool %s: no native sampler (%s)", settings.pool, exc)
        reason = NotSupportedError(f"this pool has no native sampler: {exc}")

        def unavailable(step: Any) -> Any:  # each sampling request fails saying why (e.g. an MoE base model)
            raise reason

        return unavailable


def publishing_partials(settings: Settings, sampling: Any) -> Any:
    """The SAMPLE step with its streaming requests' partials published to Redis (pool/sample_partials.py), on a
    client of its own whose short timeouts bound what an unreachable Redis costs a plan."""
    if sampling is None:
        return None
    import redis

    from loraplex.pool.sample_partials import PublishingSampleStep
    from loraplex.queue.sample_partials import PartialWriter

    client = redis.Redis.from_url(settings.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
    return PublishingSampleStep(sampling, PartialWriter(client))


def sampler_budget(settings: Settings, engine: Any) -> Any:
    """The native sampler's rows and KV blocks (workers/sampling/kv_budget.py), sized now, after the engine is built:
    from the device's free memory on CUDA, from `sampler_kv_bytes` (or its CPU default) on the CPU. Logged."""
    from loraplex.workers.sampling import kv_budget
    from loraplex.workers.sampling.device_memory import free_bytes

    shape = kv_budget.KvShape.of(engine.model.config, engine.compute_dtype.itemsize)
    free: int | None = None
    configured = settings.sampler_kv_bytes
    if engine.device.type == "cuda":
        free = free_bytes(engine.device)
    elif configured is None:
        configured = kv_budget.CPU_KV_BYTES
    forced = settings.sampler_max_rows if isinstance(settings.sampler_max_rows, int) else None
    budget = kv_budget.plan_kv_budget(
        shape, free_bytes=free, fraction=settings.sampler_kv_memory_fraction, configured_bytes=configured,
        row_tokens=settings.sampler_row_tokens, forced_rows=forced,
        ceiling=kv_budget.ROWS_CEILING if engine.device.type == "cuda" else kv_budget.CPU_ROWS_CEILING,
    )  # fmt: skip
    log.info("pool %s: native sampler sized: %s", settings.pool, budget.describe())
    return budget


def sampler_rows(sampling: Any, world: int) -> int | None:
    """The rows the pool's native sampler decodes at once over all its ranks (each rank decodes its share of a run's
    rows with rank 0's sizing, near enough: their memory is alike); None without a native sampler."""
    sampler = getattr(sampling, "sampler", None)
    per_rank = getattr(getattr(sampler, "sampler", sampler), "max_rows", None)  # a rank's sampler wraps the Sampler
    return per_rank * world if isinstance(per_rank, int) else None


def sampling_engine(settings: Settings, engine: Any, group: Any) -> Any:
    """The engine the native sampler decodes on: this one, unless it is one rank of an FSDP-sharded pool, whose every
    rank then builds a whole copy of the base model (workers/sampling/replica.py). The ranks agree: if any rank cannot
    build its copy (too little memory, settings.sampler_replica_fraction), every rank raises the same error."""
    if group is None or not engine.shard_base:
        return engine
    from loraplex.errors import EngineError, LoraplexError
    from loraplex.workers.ranks.sampling import agree
    from loraplex.workers.sampling.replica import build_replica, replica_bytes

    replica, error = None, None
    try:
        if settings.sampler_replica_fraction <= 0:
            raise EngineError("sampling replicas are off on this pool (LORAPLEX_SAMPLER_REPLICA_FRACTION=0)")
        replica = build_replica(engine, model_loader(settings), settings.sampler_replica_fraction)
    except Exception as exc:  # noqa: BLE001 - every rank learns of it below
        error = exc
    agreed = agree(group, error)  # a collective: every rank of the pool calls this at the same point of its start
    if agreed is not None:
        raise agreed if isinstance(agreed, LoraplexError | OSError) else EngineError(str(agreed))
    log.info("rank %d: sampling on a whole copy of the base model (%.2f GiB)", group.rank,
             replica_bytes(engine) / 2**30)  # fmt: skip
    return replica


def rank_sampler(sampler: Any, group: Any) -> Any:
    """The sampler of one rank of a pool (workers/ranks/sampling.RankSampler)."""
    from loraplex.workers.ranks.sampling import RankSampler

    return RankSampler(sampler, group)


def vllm_sampling(settings: Settings, written: Callable[[str], None] | None = None) -> Any:
    """The SAMPLE step on a vLLM server this process starts (and supervises: a dead server is restarted with its
    adapters); the server stops when this process exits. Sampler checkpoints reach it as PEFT folders, exported once
    their files are written (`written`: waits for a folder the background writer still writes)."""
    import atexit

    from loraplex.models import resolve
    from loraplex.samplers.vllm import VllmSampler
    from loraplex.samplers.vllm_server import VllmServer
    from loraplex.samplers.vllm_step import VllmSampleStep
    from loraplex.service.peft_export import export_checkpoint

    folder = resolve(settings.base_model, settings.resolved_model_cache)
    logs = settings.home / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    # The server computes in the pool's dtype, so its logprobs are the trainer's (RL losses compare the two).
    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[settings.resolved_dtype]
    server = VllmServer(folder, max_loras=settings.vllm_max_loras, max_lora_rank=settings.max_rank,
                        log_path=logs / f"vllm-{settings.pool}.log", extra_args=("--dtype", dtype)).start()  # fmt: skip
    atexit.register(server.close)
    server.supervise()

    def export(checkpoint_dir: Path, out_dir: Path) -> Path:
        if written is not None:
            written(str(checkpoint_dir))
        return export_checkpoint(checkpoint_dir, out_dir, base_model_path=str(folder))

    log.info("pool %s: sampling on a vLLM server at %s (logs/vllm-%s.log)", settings.pool, server.base_url,
             settings.pool)  # fmt: skip
    return VllmSampleStep(VllmSampler(server), export, settings.home / "vllm-adapters" / settings.pool)


def device_free_memory(device: torch.device) -> Callable[[], int | None]:
    """The registration's free-memory figure: a GPU's measured now, once (later queries from a side thread could meet
    a CUDA-graph capture); the host's available memory, read each time."""
    from loraplex.workers.sampling.device_memory import free_bytes

    if device.type == "cuda":
        measured = free_bytes(device)
        return lambda: measured
    return lambda: free_bytes(device)


def model_loader(settings: Settings) -> BaseModelLoader:
    return BaseModelLoader(settings.base_model, str(settings.resolved_model_cache), settings.resolved_dtype)


def engine_spec(settings: Settings) -> EngineSpec:
    """Every rank's engine: the base model's loader and the EngineConfig the settings make."""
    from loraplex.workers.engine.config import EngineConfig
    from loraplex.workers.engine.recompute import RecomputePolicy
    from loraplex.workers.ranks.rank_loop import EngineSpec

    return EngineSpec(
        load_model=model_loader(settings),
        device=settings.device,
        cpu_threads=settings.resolved_pool_cpu_threads,
        config=EngineConfig(
            num_slots=settings.slots,
            max_rank=settings.max_rank,
            target_modules=tuple(settings.target_modules),
            microbatch_tokens=settings.microbatch_tokens,
            recompute=RecomputePolicy(settings.activation_checkpointing, settings.checkpoint_above_tokens),
            cuda_graphs=settings.cuda_graphs,
            fused_elementwise=settings.fused_kernels,
            fused_head=settings.fused_kernels,
            shared_lora_inputs=settings.shared_lora_inputs,
            shard_base=settings.pool_layout == "fsdp",
        ),
    )


def store_spec(settings: Settings) -> AdapterStoreSpec:
    """Each rank's tiered adapter store: host budget, and its spill folder (`resolved_spill_root`/rank<k>)."""
    from loraplex.workers.state.adapter_store import AdapterStoreSpec

    return AdapterStoreSpec(
        settings.host_budget_bytes, str(settings.resolved_spill_root), settings.sampler_snapshots_per_adapter
    )


def run_store_follower(
    group: RankGroup, spec: EngineSpec, stores: AdapterStoreSpec, settings: Settings | None = None
) -> None:
    """A follower rank's whole life (rank_loop.run_follower) with its own adapter store: it runs the same plans as
    rank 0, so it makes the same swaps, and (with `settings`) its own share of every sample run."""
    from loraplex.runtime.supervisor import die_with_parent
    from loraplex.workers.engine.executor import PlanExecutor
    from loraplex.workers.ranks.rank_loop import build_rank_engine, follow

    die_with_parent(signal.SIGKILL)  # a SIGKILLed leader leaves no follower behind (the restarted pool spawns anew)
    engine = build_rank_engine(spec, group)
    freeze_startup_objects()  # as rank 0 does (gcutil.py): a follower's pause would hold every rank's collective
    store = stores.build(engine, group.rank)
    sampling = native_sampling(settings, engine, store, group) if settings is not None else None  # as rank 0's
    executed = follow(PlanExecutor(engine, store, sampling), group)
    log.info("rank %d stopped after %d plans", group.rank, executed)


def run_pool(settings: Settings, stop: threading.Event, lease: PoolLease | None = None) -> None:
    from loraplex.workers.ranks.distributed import RankEnv, destroy_rank_group, init_rank_group, torchrun_env
    from loraplex.workers.ranks.rank_loop import spawn_ranks

    spec = engine_spec(settings)
    stores = store_spec(settings)
    env = torchrun_env()
    if settings.world_size > 1 or env is not None:
        model_loader(settings).prepare()
    if env is not None and env.world_size > 1 and env.rank != 0:  # torchrun: a follower rank, nothing else
        run_store_follower(init_rank_group(env, settings.device), spec, stores, settings)
        destroy_rank_group()
        sys.stdout.flush()
        os._exit(0)
    world = env.world_size if env is not None else settings.world_size
    ranks: ProcessContext | None = None
    group: RankGroup | None = None
    if world > 1:
        if env is None:  # this process is rank 0; spawn the others
            ranks, port = spawn_ranks(
                run_store_follower, (spec, stores, settings), world_size=world, ranks=range(1, world),
                device=settings.device,
            )
            env = RankEnv(rank=0, world_size=world, local_rank=0, master_addr="127.0.0.1", master_port=port)
        group = init_rank_group(env, settings.device)
        log.info("rank 0 of %d joined the process group", world)
    try:
        _lead(settings, stop, spec, stores, group, world, ranks, lease)
    finally:
        if group is not None:
            destroy_rank_group()
        if ranks is not None:
            try:
                ranks.join(timeout=30)
            except Exception:  # a rank failed: its traceback is in the exception
                log.exception("a rank process failed")


def _lead(
    settings: Settings,
    stop: threading.Event,
    spec: EngineSpec,
    stores: AdapterStoreSpec,
    group: RankGroup | None,
    world: int,
    ranks: ProcessContext | None,
    lease: PoolLease | None,
) -> None:
    """lease: the pool's lease (leadership.acquire_leadership), fencing every write; None only outside a pool process."""
    import redis

    from loraplex.dispatch.cost_calibration import OnlineCostModel
    from loraplex.dispatch.cost_model import default_cost
    from loraplex.dispatch.hooks import DispatchConfig, PlanHooks
    from loraplex.dispatch.loop import Dispatcher
    from loraplex.dispatch.tenant_weights import TenantWeights
    from loraplex.pool.durable.snapshotter import build_snapshotter
    from loraplex.pool.finish import PlanFinish
    from loraplex.pool.ready import ready_file, remove_ready_file, write_ready_file
    from loraplex.pool.records import applied_seq_lookup, sql_weights
    from loraplex.pool.registration import RegistrationKeeper, pool_describer
    from loraplex.queue.results import ResultStore
    from loraplex.runtime.background_writes import BackgroundWrites
    from loraplex.runtime.logutil import RateLimitedLog
    from loraplex.storage.db import make_db_engine, session_factory
    from loraplex.storage.models import PoolState
    from loraplex.storage.repositories import PoolRepository, ResidencyRepository, unit_of_work
    from loraplex.storage.statement_count import STATEMENTS
    from loraplex.workers.engine.executor import PlanExecutor
    from loraplex.workers.ranks.rank_loop import LeaderExecutor, build_rank_engine

    sessions = session_factory(make_db_engine(settings.resolved_database_url))
    # The heartbeat runs from the start: LOADING while the engine is built (gateways answer 503 and paused_capacity),
    # READY once the dispatcher reads, STOPPED after a clean stop. A failed beat (database away) is retried next time.
    state = {"now": PoolState.LOADING}
    beat_failed = RateLimitedLog(log, every_s=30.0)

    def heartbeat() -> None:
        first = True
        while not stop.is_set():
            try:
                with unit_of_work(sessions) as session:
                    PoolRepository(session).heartbeat(
                        settings.pool, settings.base_model, world, settings.slots, restarted=first, state=state["now"]
                    )
                first = False
            except Exception as exc:  # noqa: BLE001 - the pool keeps serving; gateways see the heartbeat age
                beat_failed.warning("pool heartbeat failed (%s: %s); retrying", type(exc).__name__, exc)
            stop.wait(settings.pool_heartbeat_seconds)

    beating = threading.Thread(target=heartbeat, name="pool-heartbeat", daemon=True)
    beating.start()
    # The pool's registration in the fleet (pool/registration.py), from the start: a loading pool's base model is
    # served (requests wait for it). Free memory once the engine is built: measured then on a GPU (a side thread's
    # device query must not meet a CUDA-graph capture), each round on the CPU.
    memory: dict[str, Callable[[], int | None]] = {"free": lambda: None}
    registry = redis.Redis.from_url(settings.redis_url)
    describe = pool_describer(settings, registry, world, lambda: str(state["now"]), lambda: memory["free"]())
    registration = RegistrationKeeper(registry, describe, settings.leader_lease_seconds).start()
    engine = build_rank_engine(spec, group)  # with several ranks, a collective: every rank builds its engine now
    memory["free"] = device_free_memory(engine.device)
    store = stores.build(engine, group.rank if group is not None else 0)
    writes = BackgroundWrites(hold_writes(settings))  # sampler saves' files, written beside the next plans
    # The step cost model (dispatch/cost_model.py), calibrated from rank 0's measured forward_backward steps.
    cost = OnlineCostModel(default_cost(settings.device), settings.microbatch_tokens) if settings.cost_model else None
    # Set by the dispatcher's prefetch thread while training waits unplanned; the sampler's idle slices end on it.
    others_waiting = threading.Event()
    sampling = native_sampling(settings, engine, store, group, others_waiting, writes.wait_folder)
    executor = PlanExecutor(engine, store, publishing_partials(settings, sampling), writes,
                            on_step=cost.observe_step if cost is not None else None)  # fmt: skip
    leader = LeaderExecutor(executor, group) if group is not None else None
    if lease is None:  # the adapters of an earlier run of this pool are gone, and their rows (with a lease: cleared
        with unit_of_work(sessions) as session:  # when it took the pool over, leadership.py)
            ResidencyRepository(session).clear(settings.pool)

    metrics = pool_metrics(settings, executor, store)
    STATEMENTS.subscribe(metrics.sql_statement)
    client = redis.Redis.from_url(settings.redis_url)
    # The snapshot cadence (durable/snapshotter.py) and the request log, when durable snapshots are on.
    snapshotter = build_snapshotter(settings, store, sessions, client, lease, writes) if settings.durable_snapshots else None
    # Moves between pools (pool/handoff.py) ride on the snapshots and the request log.
    handoff = None
    if snapshotter is not None:
        from loraplex.pool.handoff import PoolHandoff

        handoff = PoolHandoff(pool=settings.pool, redis=client, sessions=sessions, store=store,
                              executor=leader or executor, snapshotter=snapshotter, lease=lease, writes=writes,
                              adopt=getattr(leader or executor, "adopt", store.adopt))  # fmt: skip
    hooks = PlanHooks(
        results=ResultStore(client, lease=lease),
        # With the request log on, a sampler save is answered once its weights are frozen, before its files exist;
        # not yet with several ranks: a follower that loads a copy from its folder cannot wait for rank 0's writer.
        finish=PlanFinish(sessions, pool=settings.pool, store=store, writes=writes, lease=lease,
                          answer_before_files=snapshotter is not None and group is None),  # fmt: skip
        applied_seq_lookup=applied_seq_lookup(sessions),
        after_plan=snapshotter.after_plan if snapshotter is not None else None,
        observer=metrics,
        request_log=snapshotter is not None,
        tenant_weights=TenantWeights(sql_weights(sessions), settings.tenant_weight_cache_seconds),
        cost_model=cost,
        others_waiting=others_waiting,
        handoff=handoff,
    )
    rows = sampler_rows(sampling, world)
    config = DispatchConfig.from_settings(settings, pipelined=True, **({"sample_rows": rows} if rows else {}))

    def build_dispatcher() -> Dispatcher:
        return Dispatcher(client, settings.pool, leader or executor, config, hooks)

    dispatcher = _dispatcher_when_redis_answers(build_dispatcher, stop)
    if dispatcher is None:  # stopped while Redis was away
        registration.close()
        if snapshotter is not None:
            snapshotter.close()
        return
    try:
        if snapshotter is not None:
            _recover(settings, dispatcher, snapshotter, store, leader or executor, sessions, writes)
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        # Redis went away while this process adopted its adapters: nothing was answered or written yet, so the
        # supervisor's next process starts the recovery over (found by benchmarks/soak.py: a pool restarted while
        # redis-server was being restarted).
        log.error("pool %s: redis went away during recovery (%s); exiting so the next start recovers again",
                  settings.pool, exc)  # fmt: skip
        raise SystemExit(1) from None
    ready = ready_file(settings)

    def deposed(reason: str) -> None:
        """The lease is lost (another pool process took the pool over): stop planning now; writes are refused."""
        log.error("pool %s: lost its lease, another pool process leads it now (%s); stopping the dispatcher",
                  settings.pool, reason)  # fmt: skip
        remove_ready_file(ready)
        stop.set()

    if lease is not None:
        lease.on_lost(deposed)

    def watch_ranks(context: ProcessContext) -> None:
        """A rank that dies leaves the others stuck in a collective: end the pool (its state is durable elsewhere)."""
        while not stop.wait(RANK_CHECK_SECONDS):
            dead = [p for p in context.processes if not p.is_alive()]
            if dead:
                log.error("rank process(es) %s exited (%s): stopping the pool", [p.pid for p in dead],
                          [p.exitcode for p in dead])  # fmt: skip
                remove_ready_file(ready)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(1)

    if ranks is not None:
        threading.Thread(target=watch_ranks, args=(ranks,), name="pool-ranks", daemon=True).start()
    if stop.is_set():  # stopped (or deposed) while loading the model
        registration.close(withdraw=not (lease is not None and lease.lost))
        if leader is not None:
            leader.close()
        return
    publisher, metrics_http = serve_metrics(settings, dispatcher.redis, metrics)
    frozen = freeze_startup_objects()  # full collections skip the model and libraries from now on (gcutil.py)
    write_ready_file(ready)  # first, so a gateway's healthz 200 implies this file too
    state["now"] = PoolState.READY
    _beat_now(sessions, settings, PoolState.READY)  # gateways turn healthy now, not one heartbeat later
    log.info("pool %s ready: base model %s, %d slots, world size %d (%d startup objects frozen for the garbage "
             "collector)", settings.pool, settings.base_model, settings.slots, world, frozen)  # fmt: skip
    # Failover (pool/failover.py): this leader hands a dead sibling pool's adapters over, as that pool's hand-over would.
    failover = None
    if handoff is not None:
        from loraplex.pool.failover import FailoverSweeper

        failover = FailoverSweeper(pool=settings.pool, base_model=settings.base_model, redis=client, sessions=sessions,
                                   after_s=settings.pool_failover_seconds,
                                   lease_ttl_s=settings.leader_lease_seconds).start()  # fmt: skip
    try:
        dispatcher.run_forever(stop)
        if snapshotter is not None and not (lease is not None and lease.lost):
            snapshotter.flush(dispatcher.progress())  # a clean stop: every changed adapter's state to disk before the lease goes
    finally:
        if failover is not None:
            failover.close()
        publisher.close()  # after the dispatcher's last plan: its numbers are published once more
        if metrics_http is not None:
            metrics_http.close()
        writes.close()  # every background write done (the finisher waited for the plans' ones already)
        remove_ready_file(ready)
        state["now"] = PoolState.STOPPED
        stop.set()
        registration.close(withdraw=not (lease is not None and lease.lost))  # a deposed leader's is not its own now
        beating.join(timeout=5)
        _beat_now(sessions, settings, PoolState.STOPPED)
        if leader is not None:
            stop.set()  # the rank watcher stands down: the followers leave on purpose now
            leader.close()


def pool_metrics(settings: Settings, executor: Any, store: Any) -> Any:
    """The pool's Prometheus metrics (pool/metrics.py) fed from rank 0's executor and adapter store: its
    per-step seconds, cumulative swaps (workers/adapter_store.SwapStats), adapters per tier, the engine's CUDA-graph
    captures and the memory they hold, this process's garbage-collection seconds and its CUDA allocator's events;
    plans slower than `slow_plan_log_seconds` are logged."""
    from loraplex.pool.metrics import PoolMetrics
    from loraplex.pool.resources import resource_reader
    from loraplex.workers.engine.allocator_events import allocator_events
    from loraplex.workers.engine.device_memory import device_memory

    def swaps() -> dict[str, tuple[int, float]]:
        s = store.stats
        return {"gpu_to_cpu": (s.out_host, s.out_host_s), "cpu_to_gpu": (s.in_host, s.in_host_s),
                "cpu_to_disk": (s.spills, s.spill_s), "disk_to_gpu": (s.in_disk, s.in_disk_s)}  # fmt: skip

    def captures() -> int:
        graphs = executor.engine.graphs
        return graphs.captures if graphs is not None else 0

    def graph_memory() -> int:
        graphs = executor.engine.graphs
        return graphs.memory_bytes if graphs is not None else 0

    collector = GcClock()
    return PoolMetrics(settings.pool, slots=settings.slots, step_times=executor.drain_step_times, swaps=swaps,
                       tiers=store.tier_counts, graph_captures=captures, graph_memory=graph_memory,
                       gc_seconds=lambda: collector.seconds,
                       allocator_events=lambda: allocator_events(executor.engine.device),
                       resources=resource_reader(settings.resolved_blob_root,
                                                 lambda: device_memory(executor.engine.device)),
                       slow_plan_s=settings.slow_plan_log_seconds)  # fmt: skip


def serve_metrics(settings: Settings, redis_client: Any, metrics: Any) -> tuple[Any, Any]:
    """Publish the metrics to Redis every `pool_metrics_publish_seconds` (the gateways' /metrics/pools), and serve
    them on `pool_metrics_port` unless it is 0 (a port in use is logged: the pool serves on without it)."""
    from loraplex.pool.metrics_publisher import MetricsPublisher
    from loraplex.runtime.metrics_server import MetricsServer

    publisher = MetricsPublisher(redis_client, metrics, settings.pool_metrics_publish_seconds).start()
    server = None
    if settings.pool_metrics_port:
        try:
            server = MetricsServer(settings.pool_metrics_host, settings.pool_metrics_port, publisher.render,
                                   settings.metrics_token).start()  # fmt: skip
            log.info("pool %s: metrics at http://%s:%d/metrics", settings.pool, settings.pool_metrics_host,
                     server.port)  # fmt: skip
        except OSError as exc:
            log.error("pool %s: cannot serve metrics on %s:%d (%s)", settings.pool, settings.pool_metrics_host,
                      settings.pool_metrics_port, exc)  # fmt: skip
    return publisher, server


def _recover(
    settings: Settings, dispatcher: Any, snapshotter: Any, store: Any, executor: Any, sessions: Any, writes: Any = None
) -> None:
    """Adopt this pool's adapters from their durable snapshots and request logs (pool/durable/recovery.py) before the
    dispatcher reads anything: it continues from the seq_ids reached, and the snapshot cadence from the adopted state.
    `executor`: with several ranks the LeaderExecutor, so every rank adopts each snapshot and replays each logged
    request (the LoRA state is replicated: rank 0's copy is the one the snapshots are written from)."""
    from loraplex.pool.durable.recovery import adopt_into, recover_pool

    recovery = recover_pool(pool=settings.pool, store=store, executor=executor, sessions=sessions,
                            redis=dispatcher.redis, adopt=getattr(executor, "adopt", store.adopt),
                            writes=writes)  # fmt: skip
    dispatcher.seed_applied(recovery.seeds)
    adopt_into(snapshotter, recovery)


def _beat_now(sessions: Any, settings: Settings, state: Any) -> None:
    """Write the pool's state at once (best effort: the heartbeat thread writes it again)."""
    from loraplex.storage.repositories import PoolRepository, unit_of_work

    try:
        with unit_of_work(sessions) as session:
            PoolRepository(session).set_state(settings.pool, state)
    except Exception as exc:  # noqa: BLE001
        log.warning("could not record pool state %s (%s)", state, exc)


def _dispatcher_when_redis_answers(build: Callable[[], T], stop: threading.Event) -> T | None:
    """`build()` (the dispatcher creates its consumer group at once), retried with backoff while Redis is down;
    None when stopped first."""
    import redis

    from loraplex.runtime.logutil import Backoff, RateLimitedLog

    backoff, warn = Backoff(), RateLimitedLog(log, every_s=10.0)
    while not stop.is_set():
        try:
            return build()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            warn.warning("redis unavailable (%s); the pool waits for it", exc)
            stop.wait(backoff.next())
    return None


def preflight(settings: Settings, stop: threading.Event | None = None) -> None:
    """What the pool needs before it loads a model: a Redis to read, and a database at this build's schema (brought
    there now: migrations are idempotent and serialised, so a fresh database just works). Exits naming what is
    missing. A database that does not answer yet is waited for (up to 10 minutes, as the pool's records do), not
    exited on: a pool restarted during an outage serves as soon as it is back (`stop` ends the wait)."""
    from loraplex.runtime.logutil import RateLimitedLog
    from loraplex.storage.db import migrate
    from loraplex.storage.outage import retry_database

    def wait(seconds: float) -> None:
        if stop is None:
            time.sleep(seconds)
        elif stop.wait(seconds):
            raise SystemExit(0)  # stopped while the database was away

    if not settings.redis_url:
        sys.exit(
            "loraplex worker: LORAPLEX_REDIS_URL is not set: point it at the Redis the gateway uses "
            "(e.g. redis://127.0.0.1:6379/0), or run everything with `loraplex serve --embedded`"
        )
    retry_database(lambda: migrate(settings.resolved_database_url), "migrating the database before the pool starts",
                   RateLimitedLog(log, every_s=10.0), sleep=wait)  # fmt: skip


# How long a thread may keep the interpreter lock while another one waits for it (Python's default: 5 ms). The loop
# thread runs a plan's Python (the engine's launches, the policy) while the finisher thread records and publishes the
# plan before it and the prefetch thread reads the next requests: each of their Redis and SQL calls gives the lock up
# and may wait this long to get it back, and a plan's results or the next request wait with it.
GIL_SWITCH_INTERVAL_S = 0.0005


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    stop = threading.Event()
    stop_on_signals(stop)
    settings = get_settings()
    lease: PoolLease | None = None
    if os.environ.get("RANK", "0") == "0":  # under torchrun only rank 0 talks to Redis and SQL
        from loraplex.pool.leadership import acquire_leadership

        preflight(settings, stop)
        lease = acquire_leadership(settings, stop)  # waits while another pool process leads this pool
        if lease is None:
            return  # stopped while waiting
        from loraplex.pool.ready import clear_stale_ready_file, ready_file

        clear_stale_ready_file(ready_file(settings))
    run_pool(settings, stop, lease)
    status = 0
    if lease is not None:
        if lease.lost:
            print(f"loraplex worker: pool {settings.pool}: lost its lease to another pool process "
                  f"({lease.lost_reason}); stopped without writing further results", file=sys.stderr)  # fmt: skip
            status = 1
        else:
            _release(lease)
    if settings.world_size > 1 or os.environ.get("WORLD_SIZE", "1") != "1":
        # After destroy_process_group, skip the interpreter's exit handlers (a rare abort there; platform.md).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    if status:
        sys.exit(status)


def _release(lease: PoolLease) -> None:
    """Hand the lease back once every plan is finished, so a waiting pool process takes over at once."""
    import redis

    try:
        lease.release()
    except redis.RedisError as exc:
        log.warning("pool %s: releasing the lease failed (%s); it lapses by itself", lease.pool, exc)


if __name__ == "__main__":
    main()
