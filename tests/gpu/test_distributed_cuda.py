"""The multi-rank code path on CUDA with NCCL (run on the GPU machine: `pytest -m gpu tests/gpu/test_distributed_cuda.py`).

One GPU allows one rank, so this runs the integration scenario (tests/integration/test_distributed.py) as a process
group of one on cuda:0: FSDP2 sharding (trivial), the NCCL all-reduce of bank gradients and all-gather of outputs, and
plans broadcast on the gloo control group; it must equal the same plans on an engine with no process group. With more
GPUs each test also runs at world sizes 2, 4 and 8 where the machine has that many (`nvidia-h200-x2/-x4/-x8`:
the real split of rows across ranks). Needs no service dependencies."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from loraplex.models import resolve
from loraplex.workers.ranks.rank_loop import EngineSpec
from tests.helpers.distributed import (
    ENGINE_CONFIG,
    TinyLoader,
    assert_same_run,
    make_plans,
    run_one_process,
    run_ranks,
)

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
WORLD_SIZES = pytest.mark.parametrize("world", [1, 2, 4, 8], ids=lambda w: f"world{w}")


def _gpus(world: int) -> int:
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    return world


@WORLD_SIZES
def test_nccl_ranks_match_one_process_on_cuda(tmp_path: Path, world: int) -> None:
    tiny = resolve("tiny", tmp_path / "model-cache")
    spec = EngineSpec(TinyLoader(str(tiny)), "cuda", ENGINE_CONFIG)
    plans = make_plans()
    reports = run_ranks(_gpus(world), "cuda", spec, plans, tmp_path)
    reference = run_one_process(spec, plans)
    assert_same_run(reports[0], reference)
    state = reports[0]["state"]
    assert all(sharded for sharded, _, _ in state["base"].values())
    assert all(kind == "Parameter" and not sharded for kind, sharded, _ in state["lora"].values())
    for other in reports[1:]:
        assert all(torch.equal(x, y) for x, y in zip(state["adam"], other["state"]["adam"], strict=True))


@WORLD_SIZES
def test_replicated_base_ranks_match_one_process_on_cuda(tmp_path: Path, world: int) -> None:
    """pool_layout "replicate" (Engine(shard_base=False)) with NCCL: a whole base on every rank, no FSDP, so the body
    also runs as CUDA graphs in a process group; equal to one process (fp32, to the reference's tolerance)."""
    tiny = resolve("tiny", tmp_path / "model-cache")
    spec = EngineSpec(TinyLoader(str(tiny)), "cuda", replace(ENGINE_CONFIG, shard_base=False))
    plans = make_plans()
    reports = run_ranks(_gpus(world), "cuda", spec, plans, tmp_path)
    assert_same_run(reports[0], run_one_process(spec, plans))
    assert not any(sharded for sharded, _, _ in reports[0]["state"]["base"].values())


def _max_diffs(got: dict, want: dict) -> tuple[float, float]:
    lp = 0.0
    for gp, wp in zip(got["outcomes"], want["outcomes"], strict=True):
        for g, w in zip(gp, wp, strict=True):
            assert g.ok == w.ok, (g, w)
            outputs = [r.result.to_wire().get("loss_fn_outputs", []) if r.result else [] for r in (g, w)]
            for dg, dw in zip(*outputs, strict=True):
                lp = max(lp, float((torch.tensor(dg["logprobs"]) - torch.tensor(dw["logprobs"])).abs().max()))
    weights = max(
        float((x - y).abs().max())
        for m in got["state"]["weights"]
        for name in got["state"]["weights"][m]
        for x, y in zip(got["state"]["weights"][m][name], want["state"]["weights"][m][name], strict=True)
    )
    return lp, weights


@WORLD_SIZES
def test_bf16_base_model_shards_and_trains_on_cuda(tmp_path: Path, world: int) -> None:
    """bf16 base weights (as the GPU benchmarks load them) with fp32 banks: FSDP2 shards the bf16 weights only."""
    tiny = resolve("tiny", tmp_path / "model-cache")
    spec = EngineSpec(TinyLoader(str(tiny), "bfloat16"), "cuda", ENGINE_CONFIG)
    plans = make_plans()
    reports = run_ranks(_gpus(world), "cuda", spec, plans, tmp_path)
    reference = run_one_process(spec, plans)
    lp, weights = _max_diffs(reports[0], reference)
    print(f"bf16: max |logprob diff| {lp:.3g}, max |weight diff| {weights:.3g}")
    assert lp < 0.1 and weights < 0.05
