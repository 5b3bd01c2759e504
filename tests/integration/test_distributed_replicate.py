"""The "replicate" pool layout (Settings.pool_layout, EngineConfig(shard_base=False)) across 2 ranks on CPU (gloo), through
the real rank loop: every rank holds the whole base model (plain tensors, no FSDP), rows are split across ranks and
the bank gradients all-reduced as under FSDP2, so the run equals the same plans on one process (the same scenario as
test_distributed.py: mixed adapters of ranks 2, 4, 8, uneven datums, forward-only requests, a bad request)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from loraplex.workers.ranks.rank_loop import EngineSpec
from tests.helpers.distributed import ENGINE_CONFIG, TinyLoader, assert_same_run, make_plans, run_one_process, run_ranks

pytestmark = [pytest.mark.timeout(180)]

REPLICATE = replace(ENGINE_CONFIG, shard_base=False)


def test_two_replicated_ranks_equal_one_process_and_hold_the_whole_base(
    tiny_dir: Path, tmp_path: Path
) -> None:
    spec = EngineSpec(TinyLoader(str(tiny_dir)), "cpu", REPLICATE)
    plans = make_plans()
    ranks = run_ranks(2, "cpu", spec, plans, tmp_path)
    reference = run_one_process(spec, plans)
    assert ranks[1]["followed"] == len(reference["outcomes"])
    assert_same_run(ranks[0], reference)
    for report in ranks:
        base: dict[str, Any] = report["state"]["base"]
        assert base and not any(sharded for sharded, _, _ in base.values())  # a whole copy on every rank
    r0, r1 = (r["state"] for r in ranks)
    assert all(torch.equal(x, y) for x, y in zip(r0["adam"], r1["adam"], strict=True))
