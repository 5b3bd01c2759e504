"""An MoE base (`tiny-moe`: expert banks on every expert's gate / up / down) on 2 FSDP2 ranks on CPU (gloo), through
the real rank loop, against world size 1 on the same plans (tests/integration/test_distributed.py's, for a dense base):
every request's logprobs and loss, every optimizer result and the adapters' weights match, the expert banks are
replicated plain Parameters and bit-identical on both ranks, and the experts' base weights are sharded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from loraplex.workers.ranks.rank_loop import EngineSpec
from tests.helpers.distributed import ENGINE_CONFIG, TinyLoader, assert_same_run, make_plans, run_one_process, run_ranks

pytestmark = [pytest.mark.timeout(180)]


def test_two_ranks_train_moe_adapters_as_one(tiny_moe_dir: Path, tmp_path: Path) -> None:
    plans = make_plans()
    spec = EngineSpec(TinyLoader(str(tiny_moe_dir)), "cpu", ENGINE_CONFIG)
    ranks: list[dict[str, Any]] = run_ranks(2, "cpu", spec, plans, tmp_path)
    assert_same_run(ranks[0], run_one_process(spec, plans))
    r0, r1 = (r["state"] for r in ranks)
    experts = [n for n in r0["banks"] if ".experts." in n]
    assert len(experts) == 3 * 2  # gate, up, down x 2 layers
    for name, (a0, b0) in r0["banks"].items():
        a1, b1 = r1["banks"][name]
        assert torch.equal(a0, a1) and torch.equal(b0, b1), name
    for report in ranks:
        base, lora = report["state"]["base"], report["state"]["lora"]
        assert any("experts.base.gate_up_proj" in n and sharded for n, (sharded, _, _) in base.items())
        assert all(kind == "Parameter" and not sharded for kind, sharded, _ in lora.values())
