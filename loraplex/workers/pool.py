"""The worker pool process (`python -m loraplex.workers.pool`): loads the base model, builds the engine, and runs the
dispatcher as pool leader on rank 0. Service dependencies (redis, SQL) are imported here only, so the engine modules
stay importable on the GPU machine without them."""

from __future__ import annotations

import logging
import os
import signal
import threading

from loraplex.settings import Settings, get_settings

log = logging.getLogger("loraplex.pool")

HEARTBEAT_SECONDS = 5.0


def run_pool(settings: Settings, stop: threading.Event) -> None:
    import redis

    from loraplex.dispatch.loop import Dispatcher
    from loraplex.dispatch.records import OutcomeRecorder
    from loraplex.embedded import ready_file
    from loraplex.models import load_base_model
    from loraplex.storage.db import make_engine, session_factory
    from loraplex.storage.repositories import PoolRepository, unit_of_work
    from loraplex.workers.engine import Engine
    from loraplex.workers.executor import PlanExecutor

    sessions = session_factory(make_engine(settings.resolved_database_url))
    model, _tokenizer = load_base_model(settings.base_model, settings.resolved_model_cache, device=settings.device)
    engine = Engine(
        model,
        slots=settings.slots,
        max_rank=settings.max_rank,
        target_modules=settings.target_modules,
        device=settings.device,
        microbatch_tokens=settings.microbatch_tokens,
    )
    recorder = OutcomeRecorder(sessions)
    dispatcher = Dispatcher(
        redis.Redis.from_url(settings.redis_url),
        settings.pool,
        recorder.timed(PlanExecutor(engine)),
        on_outcomes=recorder,
        settings=settings,
        applied_seq_lookup=recorder.applied_seq,
    )

    def heartbeat() -> None:
        while not stop.is_set():
            with unit_of_work(sessions) as session:
                PoolRepository(session).heartbeat(settings.pool, settings.base_model, 1, settings.slots)
            stop.wait(HEARTBEAT_SECONDS)

    threading.Thread(target=heartbeat, name="pool-heartbeat", daemon=True).start()
    ready = ready_file(settings)
    ready.write_text(str(os.getpid()))
    log.info("pool %s ready: base model %s, %d slots", settings.pool, settings.base_model, settings.slots)
    try:
        dispatcher.run_forever(stop)
    finally:
        ready.unlink(missing_ok=True)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    run_pool(get_settings(), stop)


if __name__ == "__main__":
    main()
