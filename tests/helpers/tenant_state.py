"""What the gateway has written, read straight from SQL and Redis (gateway tests without a pool): a comparable
copy of the rows a request may touch, each tenant's queued envelopes, and the queue/database consistency check
the fuzz tests end with."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from loraplex.protocol import RequestKind
from loraplex.queue import keys
from loraplex.queue.envelope import Envelope, decode
from loraplex.storage.models import Adapter, AdapterStatus, Checkpoint, Pipeline, TrainingSession


def db_state(services) -> dict[str, Any]:
    """Every adapter, checkpoint, session and pipeline row (all tenants), as plain tuples: equal states = nothing written."""
    with services.sessions() as db:
        adapters = sorted(
            (a.model_id, a.tenant_id, str(a.status), a.applied_seq_id, a.session_id, repr(a.user_metadata))
            for a in db.scalars(select(Adapter))
        )
        checkpoints = sorted(
            (c.tenant_id, c.model_id, str(c.kind), c.name, c.blob_uri, str(c.expires_at))
            for c in db.scalars(select(Checkpoint))
        )
        sessions = sorted(
            (s.id, s.tenant_id, str(s.last_heartbeat_at), str(s.finished_at), s.finish_reason)
            for s in db.scalars(select(TrainingSession))
        )
        pipelines = sorted((p.id, p.tenant_id, str(p.state), p.step) for p in db.scalars(select(Pipeline)))
    return {"adapters": adapters, "checkpoints": checkpoints, "sessions": sessions, "pipelines": pipelines}


def stream_of(services, tenant_id: str) -> list[Envelope]:
    """The envelopes queued in `tenant_id`'s request stream on the gateway's pool, in arrival order."""
    stream = keys.request_stream(services.settings.pool, tenant_id)
    return [decode(fields) for _, fields in services.redis.xrange(stream)]


def check_consistent(services, tenant_ids: dict[str, str]) -> None:
    """The queue and the database agree (no pool runs, so nothing is consumed):
    - every adapter row still `creating` has its create request queued in its owner's stream;
    - every queued entry of a tenant's stream is for an adapter row of that tenant (no orphan entry), queued after
      that adapter's create (every row here was made through the gateway, so each has its create queued);
    - every adapter row belongs to the tenant whose stream holds its create (no row of bob's made by alice's
      requests), and the entry names the row's tenant."""
    with services.sessions() as db:
        rows = {a.model_id: (a.tenant_id, a.status) for a in db.scalars(select(Adapter))}
    creates: dict[str, str] = {}  # model_id -> the tenant whose stream queued its creation
    for name, tenant_id in tenant_ids.items():
        for env in stream_of(services, tenant_id):
            assert env.tenant_id == tenant_id, f"{name}'s stream holds an entry of tenant {env.tenant_id}: {env}"
            assert env.model_id in rows, f"{name}'s stream holds {env.kind} for {env.model_id!r}, which has no row"
            owner, _ = rows[env.model_id]
            assert owner == tenant_id, f"{name}'s stream holds {env.kind} for another tenant's adapter {env.model_id}"
            if env.kind == RequestKind.CREATE_ADAPTER:
                assert env.model_id not in creates, f"{env.model_id} created twice"
                creates[env.model_id] = tenant_id
            else:
                assert env.model_id in creates, f"{env.kind} for {env.model_id} queued before (or without) its create"
    for model_id, (owner, status) in rows.items():
        if status == AdapterStatus.CREATING:
            assert creates.get(model_id) == owner, f"adapter {model_id} is creating but its create is not queued"
