"""What a gateway has queued on its pool, read straight from Redis (tests of the gateway without a pool)."""

from __future__ import annotations

from loraplex.protocol import RequestKind
from loraplex.queue import keys
from loraplex.queue.envelope import Envelope, decode


def queued(services) -> dict[str, Envelope]:
    """request_id -> envelope of everything queued on the gateway's pool, in arrival order."""
    entries = services.redis.xrange(keys.request_stream(services.settings.pool))
    return {env.request_id: env for env in (decode(fields) for _, fields in entries)}


def queued_work(services) -> dict[str, Envelope]:
    """`queued` less the rejections held in rejected requests' seq_ids (api/service/rejections.py)."""
    return {rid: env for rid, env in queued(services).items() if env.kind != RequestKind.REJECTED}


def rejections(services) -> dict[tuple[str, int], Envelope]:
    """(model_id, seq_id) -> the queued rejection in that seq_id's place."""
    return {(e.model_id, e.seq_id): e for e in queued(services).values() if e.kind == RequestKind.REJECTED}
