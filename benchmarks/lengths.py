"""Datum lengths of the benchmarks' workloads (stdlib only: bench_engine runs on the GPU image without the
service's dependencies, bench_service and its tenant processes with them)."""

from __future__ import annotations

import math
import random


def lognormal_lengths(rng: random.Random, total: int, median: float, sigma: float, shortest: int, longest: int) -> list[int]:
    """Lognormal datum lengths clipped to [shortest, longest], drawn until they hold `total` tokens; the last one is
    cut to make the sum exactly `total` (so it may be shorter)."""
    lengths: list[int] = []
    while sum(lengths) < total:
        n = max(shortest, min(longest, round(rng.lognormvariate(math.log(median), sigma))))
        lengths.append(min(n, total - sum(lengths)))
    return lengths


def workload_lengths(workload: str, tenant: int, seq_len: int, saturated_seqs: int) -> list[int]:
    """A tenant's datum lengths per step: underfilled one seq_len row; saturated `saturated_seqs` of them; ragged
    the saturated tenant's tokens in lognormal lengths (median 256, sigma 1, 32 to 2,048: bench_engine --mode
    ragged's defaults), drawn per tenant."""
    if workload == "underfilled":
        return [seq_len]
    if workload == "saturated":
        return [seq_len] * saturated_seqs
    if workload == "ragged":
        return lognormal_lengths(random.Random(7000 + tenant), seq_len * saturated_seqs, 256.0, 1.0, 32, 2048)
    raise ValueError(f"unknown workload {workload!r} (underfilled, saturated, ragged)")
