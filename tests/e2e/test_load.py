"""Load on the embedded stack: 32 tenants x 50 steps (forward_backward + optim_step) through the
Python client at once: 0 lost, 0 duplicated, every adapter's applied seq_id exact, steps of several adapters share
forward_backward batches; latency and the dispatcher's time per plan are printed (benchmarks/load_check.py)."""

from __future__ import annotations

import json

from benchmarks.load_check import load_check


def test_32_tenants_train_50_steps_at_once_and_nothing_is_lost_or_applied_twice(stack) -> None:
    report = load_check(stack, tenants=32, steps=50, prefix="load-")
    print(json.dumps(report))
    assert report["errors"] == []
    assert report["lost"] == 0 and report["duplicated"] == 0
    assert report["applied_seq_ids_all_right"]
    assert report["adapters_per_fb_step"] > 1
