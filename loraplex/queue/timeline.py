"""The fleet's timeline: every few seconds each pool (pool/timeline.py) and each gateway process (api/timeline.py)
adds one entry of what happened since its last one (requests, errors, tokens per tenant, latency histograms, memory)
to one Redis stream, `loraplex:timeline`; an entry's id is its time (Redis's clock, in ms), so a time range is one
XRANGE. Entries older than `KEEP_S` are trimmed as new ones arrive (MINID, approximate). The admin dashboard reads it
(admin/dashboard_data.py); Prometheus, where it runs, keeps the longer history of the same numbers.

Entry fields: `src` ("pool" or "gateway"), `name` (the pool's name, the gateway's id) and `d` (the JSON of its numbers).
Each gateway also keeps its last report in the hash `loraplex:gateways` (id -> JSON with `at`), so a gateway that
stopped reporting shows as silent since then."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, cast

import orjson
import redis as redis_lib

from loraplex.queue import keys
from loraplex.queue.redis_text import text

KEEP_S = 6 * 3600
POOL, GATEWAY = "pool", "gateway"


@dataclass(frozen=True)
class TimelineEntry:
    id: str
    at: float  # unix seconds
    src: str
    name: str
    data: dict[str, Any]


def add(redis: redis_lib.Redis, src: str, name: str, data: dict[str, Any], keep_s: float = KEEP_S) -> None:
    now_ms = int(time.time() * 1000)
    fields: dict[Any, Any] = {"src": src, "name": name, "d": orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS)}
    pipe = redis.pipeline(transaction=False)
    pipe.xadd(keys.timeline(), fields, minid=str(now_ms - int(keep_s * 1000)), approximate=True)
    if src == GATEWAY:
        pipe.hset(keys.gateways(), name, orjson.dumps({**data.get("about", {}), "at": time.time()}))
    pipe.execute()


def read(redis: redis_lib.Redis, after_id: str | None = None, since: float | None = None,
         count: int | None = None) -> list[TimelineEntry]:  # fmt: skip
    """Entries after the id `after_id` (exclusive), else from `since` (unix seconds), else all kept; oldest first."""
    low = f"({after_id}" if after_id else ("-" if since is None else str(int(since * 1000)))
    out: list[TimelineEntry] = []
    entries = cast(list[tuple[bytes, dict[bytes, bytes]]], redis.xrange(keys.timeline(), low, "+", count=count))
    for entry_id, fields in entries:
        eid = text(entry_id)
        f = {text(k): v for k, v in fields.items()}
        try:
            data = orjson.loads(f.get("d") or b"{}")
        except orjson.JSONDecodeError:
            continue  # not ours: left out
        out.append(TimelineEntry(eid, int(eid.split("-", 1)[0]) / 1000.0, text(f.get("src", b"")),
                                 text(f.get("name", b"")), data))  # fmt: skip
    return out


def gateways(redis: redis_lib.Redis) -> dict[str, dict[str, Any]]:
    """Every gateway id that ever reported -> its last report (with `at`, unix seconds)."""
    out: dict[str, dict[str, Any]] = {}
    for name, raw in redis.hgetall(keys.gateways()).items():
        try:
            out[text(name)] = orjson.loads(raw)
        except orjson.JSONDecodeError:
            continue
    return out


def forget_gateways(redis: redis_lib.Redis, older_than_s: float) -> None:
    """Drop the gateways silent for longer than this (a restarted gateway process has a new id)."""
    cutoff = time.time() - older_than_s
    stale = [name for name, report in gateways(redis).items() if float(report.get("at", 0)) < cutoff]
    if stale:
        redis.hdel(keys.gateways(), *stale)
