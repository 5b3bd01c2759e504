"""The application layer's shared services for one process (a gateway, a Celery worker, the CLI): the SQL session
factory, the Redis clients, the producer onto the pool's stream, the result store and the per-process rules (auth
cache, rate limit, long-poll slots)."""

from __future__ import annotations

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from loraplex.queue.producer import Producer
from loraplex.queue.results import ResultStore
from loraplex.service.auth_cache import AuthCache
from loraplex.service.context import Services
from loraplex.service.long_polls import LongPollSlots, process_long_polls
from loraplex.service.rate_limit import TenantRateLimit
from loraplex.settings import Settings
from loraplex.storage.db import make_db_engine, session_factory

# Redis connections a gateway process uses beyond one per worker thread: code on the event loop (the session reaper's
# lock, a middleware's check) holds at most one at a time.
EVENT_LOOP_CONNECTIONS = 8


def _redis_client(settings: Settings, max_connections: int) -> redis.Redis:
    # Fail fast while Redis is down (one quick retry, which also replaces a connection a Redis restart broke): the
    # request gets a 503 with Retry-After at once instead of redis-py's default ~5 s of retries (api/errors.py).
    return redis.Redis.from_url(
        settings.redis_url,
        decode_responses=False,
        socket_connect_timeout=2.0,
        retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), retries=1),
        max_connections=max_connections,
    )


def build_services(settings: Settings) -> Services:
    if not settings.redis_url:
        raise RuntimeError("LORAPLEX_REDIS_URL is not set (`loraplex serve --embedded` sets it for its children)")
    # Two connection pools, each sized so it never runs out (redis-py's default cap of 100 did, and every call then
    # failed with 503): the short calls' pool one connection per worker thread (a thread holds at most one at a
    # time), the long-polls' their own, as many as service/long_polls.py lets wait at once, so waits never take the
    # connections the short calls need.
    long_polls = process_long_polls(settings.max_long_polls, settings.gateway_threads)
    client = _redis_client(settings, settings.gateway_threads + EVENT_LOOP_CONNECTIONS)
    wait_client = _redis_client(settings, long_polls)
    db_engine = make_db_engine(settings.resolved_database_url)
    return Services(
        settings=settings,
        sessions=session_factory(db_engine),
        redis=client,
        producer=Producer(
            client,
            settings.pool,
            max_queued_requests=settings.max_queued_requests_per_tenant,
            max_queued_tokens=settings.max_queued_tokens_per_tenant,
        ),
        results=ResultStore(client, wait_redis=wait_client),
        auth=AuthCache(settings.auth_cache_seconds),
        rate_limit=TenantRateLimit(settings.tenant_requests_per_second, settings.tenant_request_burst),
        long_polls=LongPollSlots(settings.max_long_polls_per_tenant, long_polls),
    )
