"""Every Redis key and stream name loraplex uses, in one place. All start with `loraplex:` so a shared Redis stays tidy
and `redis-cli --scan --pattern 'loraplex:*'` shows everything we own.

    loraplex:pool:{pool}:tenant:{tenant}:requests   stream per tenant: one entry per accepted request (queue/envelope.py)
    loraplex:pool:{pool}:tenants         set: the tenants that have a stream on this pool (the dispatcher reads them all)
    loraplex:pool:{pool}:doorbell        stream: one entry when a tenant's stream is new, so a blocked read wakes for it
    loraplex:pool:{pool}:queued_tokens   hash: tenant -> tokens of its queued requests (the quota's count)
    loraplex:pool:{pool}:replay:{model_id}   sorted set: the adapter's answered requests since its durable snapshot
                                         before last, scored by seq_id (queue/replay_log.py: the durable request log)
    loraplex:pool:{pool}:replay_adapters     set: the adapters that have a request log on this pool
    loraplex:dispatchers                 consumer-group name on those streams (one leader per pool reads them)
    loraplex:result:{request_id}         string: the Outcome JSON (queue/results.py), with a TTL
    loraplex:notify:{request_id}         list: a token pushed when the result lands; waiters BLPOP it
    loraplex:state:{request_id}          string: JobState, so a client can tell queued from running
    loraplex:partial:{request_id}        stream: a streaming sample's tokens so far, one entry per slice, then an end
                                         entry; a TTL, deleted by its reader (queue/sample_partials.py)
    loraplex:idem:{model_id}:{seq_id}    string: the request_id that first claimed this (model_id, seq_id)
    loraplex:idem:{model_id}:{kind}      same, for create_adapter / delete_adapter (outside the seq_id chain)
    loraplex:owner:{request_id}          string: the tenant that submitted the request (only it may read the future)
    loraplex:trace:{model_id}            stream: the adapter's answered requests and when each passed each stage
                                         (queue/request_traces.py)
    loraplex:timeline                    stream: every pool's and gateway's numbers every few seconds, kept hours
                                         (queue/timeline.py: the admin dashboard's history)
    loraplex:gateways                    hash: gateway id -> its last report (JSON), for the dashboard's health
    loraplex:pool:{pool}:stats           hash: running totals of the pool's plans (queue/stats.py)
    loraplex:pool:{pool}:metrics         string: the pool's Prometheus metrics (text format), with a TTL, for the
                                         gateways' /metrics/pools (queue/published_metrics.py)
    loraplex:metrics:pools               set: the pools that publish metrics there
    loraplex:pool:{pool}:leader          string "<token> <holder>" with a TTL: the pool's leader lease (queue/lease.py)
    loraplex:pool:{pool}:leader_token    integer: the pool's fencing-token counter (INCR per acquisition, never expires)
    loraplex:pool:{pool}:registration    string: what the pool serves and its load (JSON, queue/pool_registry.py), with
                                         the lease's TTL: a pool whose leader is gone drops out of the fleet with it
    loraplex:fleet:pools                 set: the pools that ever registered (their registrations may have expired)
    loraplex:fleet:last_seen             hash: pool -> when its leader last registered (seconds since the epoch, never
                                         expires): how long a dead pool has been dead (pool/failover.py)
    loraplex:pool:{pool}:move_orders     hash: adapter -> the pool an operator asked to move it to (queue/handoff.py)
    loraplex:pool:{pool}:moved           hash: adapter -> the pool it was handed to (its late entries go there)
    loraplex:pool:{pool}:adopt           set: adapters handed to this pool, to adopt from snapshot + request log
    loraplex:openai:sampler:{tenant}:{model_path}   hash: the OpenAI endpoint's sampler over that checkpoint (or "" for
                                         the base model): `sampler_id`, and `seq` its seq_id counter (api/openai/models.py)
    loraplex:openai:idem:{tenant}:{digest}          string: "<sampler_id> <first seq_id>" an Idempotency-Key took
"""

from __future__ import annotations

from enum import StrEnum

from loraplex.protocol import CONTROL_KINDS, RequestKind
from loraplex.protocol import CONTROL_SEQ_ID as CONTROL_SEQ_ID  # public here too: the envelope's create/delete seq_id

PREFIX = "loraplex:"
CONSUMER_GROUP = f"{PREFIX}dispatchers"


class JobState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETE = "complete"
    FAILED = "failed"


def request_stream(pool: str, tenant_id: str) -> str:
    """One stream per tenant, so the dispatcher reads every tenant's backlog side by side (fair share holds for the
    whole backlog, not only for what one arrival-ordered read window holds)."""
    return f"{PREFIX}pool:{pool}:tenant:{tenant_id}:requests"


def pool_tenants(pool: str) -> str:
    return f"{PREFIX}pool:{pool}:tenants"


def pool_doorbell(pool: str) -> str:
    return f"{PREFIX}pool:{pool}:doorbell"


def queued_tokens(pool: str) -> str:
    return f"{PREFIX}pool:{pool}:queued_tokens"


def replay_log_prefix(pool: str) -> str:
    """The request log keys of a pool's adapters are this prefix + model_id (the ack script builds them)."""
    return f"{PREFIX}pool:{pool}:replay:"


def replay_log(pool: str, model_id: str) -> str:
    return replay_log_prefix(pool) + model_id


def replay_adapters(pool: str) -> str:
    return f"{PREFIX}pool:{pool}:replay_adapters"


def pool_stats(pool: str) -> str:
    return f"{PREFIX}pool:{pool}:stats"


def pool_metrics(pool: str) -> str:
    return f"{PREFIX}pool:{pool}:metrics"


def metrics_pools() -> str:
    return f"{PREFIX}metrics:pools"


def pool_leader(pool: str) -> str:
    return f"{PREFIX}pool:{pool}:leader"


def pool_leader_token(pool: str) -> str:
    return f"{PREFIX}pool:{pool}:leader_token"


def pool_registration(pool: str) -> str:
    return f"{PREFIX}pool:{pool}:registration"


def fleet_pools() -> str:
    return f"{PREFIX}fleet:pools"


def fleet_last_seen() -> str:
    return f"{PREFIX}fleet:last_seen"


def move_orders(pool: str) -> str:
    return f"{PREFIX}pool:{pool}:move_orders"


def moved_adapters(pool: str) -> str:
    return f"{PREFIX}pool:{pool}:moved"


def adopt_orders(pool: str) -> str:
    return f"{PREFIX}pool:{pool}:adopt"


def result_key(request_id: str) -> str:
    return f"{PREFIX}result:{request_id}"


def notify_key(request_id: str) -> str:
    return f"{PREFIX}notify:{request_id}"


def state_key(request_id: str) -> str:
    return f"{PREFIX}state:{request_id}"


def sample_partials(request_id: str) -> str:
    return f"{PREFIX}partial:{request_id}"


def idempotency_key(model_id: str, seq_id: int | str) -> str:
    return f"{PREFIX}idem:{model_id}:{seq_id}"


def request_idempotency_key(kind: RequestKind | str, model_id: str, seq_id: int) -> str:
    """The idempotency key of one request: (model_id, seq_id) for training steps, (model_id, kind) for create/delete."""
    kind = RequestKind(kind)
    return idempotency_key(model_id, kind.value if kind in CONTROL_KINDS else seq_id)


def request_owner(request_id: str) -> str:
    return f"{PREFIX}owner:{request_id}"


def request_trace(model_id: str) -> str:
    return f"{PREFIX}trace:{model_id}"


def timeline() -> str:
    return f"{PREFIX}timeline"


def gateways() -> str:
    return f"{PREFIX}gateways"


def session_reaper_lock() -> str:
    """Held (SET NX EX) by the one gateway that expires idle sessions this round (service/sessions.py)."""
    return f"{PREFIX}session_reaper"


def openai_sampler(tenant_id: str, model_path: str) -> str:
    """The OpenAI endpoint's cached sampler over `model_path` ("" for the base model) and its seq_id counter."""
    return f"{PREFIX}openai:sampler:{tenant_id}:{model_path}"


def openai_idempotency(tenant_id: str, digest: str) -> str:
    """The seq_ids an OpenAI request's Idempotency-Key header took (digest: of the model and the key)."""
    return f"{PREFIX}openai:idem:{tenant_id}:{digest}"


def pipeline_runner(pipeline_id: str) -> str:
    """The lease of the Celery task running a pipeline ("<token>"; loraplex/pipelines/lease.py): a task handed out
    again while another run of it lives finds it held and waits."""
    return f"{PREFIX}pipeline:{pipeline_id}:runner"


def pipeline_tenant_running(tenant_id: str) -> str:
    """The tenant's pipelines training now (a sorted set: pipeline id -> when its claim lapses, ms; loraplex/pipelines/
    tenant_slots.py): at most `max_running_pipelines_per_tenant` at once."""
    return f"{PREFIX}pipeline:tenant:{tenant_id}:running"


def pipeline_workers() -> str:
    """The live pipelines workers (a sorted set: worker name -> when its heartbeat lapses, ms; queue/
    pipeline_workers.py)."""
    return f"{PREFIX}pipeline:workers"


def pending_saves(tenant_id: str) -> str:
    """The tenant's checkpoint saves accepted but not yet recorded (a hash: request id -> estimated bytes;
    service/checkpoint_quota.py), counted against its checkpoint quotas until they finish."""
    return f"{PREFIX}tenant:{tenant_id}:pending_saves"
