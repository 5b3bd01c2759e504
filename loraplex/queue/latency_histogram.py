"""Latency histograms that merge: fixed log-spaced buckets (each edge 1.25x the one before, from 1 ms), kept sparse as
{bucket index: count}. The timeline's entries carry them (queue/timeline.py) so that the dashboard can merge any
number of entries into one histogram and read its percentiles; a percentile is within one bucket (+-12%) of the
exact one, and exact for values under 1 ms (bucket 0) in the sense that it reads 1 ms. Pure: no I/O."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

FIRST_EDGE_S = 0.001
GROWTH = 1.25
BUCKETS = 64  # the last bucket's upper edge: 0.001 * 1.25**63, about 1,300 s; anything longer counts there

Histogram = dict[int, int]


def bucket_of(seconds: float) -> int:
    if seconds <= FIRST_EDGE_S:
        return 0
    return min(BUCKETS - 1, math.ceil(math.log(seconds / FIRST_EDGE_S, GROWTH)))


def upper_edge(bucket: int) -> float:
    return FIRST_EDGE_S * GROWTH**bucket


def observe(hist: Histogram, seconds: float) -> None:
    b = bucket_of(seconds)
    hist[b] = hist.get(b, 0) + 1


def merge(histograms: Iterable[Mapping[int | str, int]]) -> Histogram:
    """The sum of several histograms (their JSON form, with string keys, too)."""
    out: Histogram = {}
    for hist in histograms:
        for b, n in hist.items():
            out[int(b)] = out.get(int(b), 0) + int(n)
    return out


def count(hist: Mapping[int, int]) -> int:
    return sum(hist.values())


def percentile(hist: Mapping[int, int], q: float) -> float | None:
    """The q-quantile (0 < q <= 1) read as the geometric middle of its bucket (bucket 0: its edge); None when empty."""
    total = count(hist)
    if total == 0:
        return None
    rank = max(1, math.ceil(q * total))
    seen = 0
    for b in sorted(hist):
        seen += hist[b]
        if seen >= rank:
            return FIRST_EDGE_S if b == 0 else math.sqrt(upper_edge(b - 1) * upper_edge(b))
    return upper_edge(max(hist))
