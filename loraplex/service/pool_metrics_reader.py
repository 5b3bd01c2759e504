"""Every pool's metrics as the pools last published them to Redis (queue/published_metrics.py), parsed and merged
into one set of metric families (each series keeps its `pool` label). GET /metrics/pools serves them; the admin
dashboard reads them through `pool_metric_families` too, so neither needs to reach a pool's own port."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import redis as redis_lib
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from loraplex.queue import published_metrics

log = logging.getLogger(__name__)


def pool_metric_families(redis: redis_lib.Redis) -> list[Metric]:
    merged: dict[str, Metric] = {}
    for pool, raw in published_metrics.read_all(redis).items():
        try:
            families = list(text_string_to_metric_families(raw.decode()))
        except (ValueError, UnicodeDecodeError) as exc:  # not ours, or cut short: leave that pool out
            log.warning("pool %s: unreadable published metrics in Redis (%s)", pool, exc)
            continue
        for family in families:
            have = merged.get(family.name)
            if have is None:
                merged[family.name] = family
            elif have.type == family.type:
                have.samples.extend(family.samples)
    return list(merged.values())


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def pool_exposition(redis: redis_lib.Redis) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(pool_metric_families(redis)))
    return generate_latest(registry)
