"""LORAPLEX_DTYPE reaches the base model of every rank: the pool's own spec (pool/process.engine_spec) built from the
settings, two spawned gloo ranks, each reporting the dtype of its base weights, its activations and its LoRA masters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraplex.pool.process import engine_spec
from loraplex.settings import Settings
from loraplex.workers.ranks.distributed import RankGroup
from loraplex.workers.ranks.rank_loop import EngineSpec, build_rank_engine, spawn_ranks

pytestmark = [pytest.mark.timeout(180)]


def _report(group: RankGroup, spec: EngineSpec, out_dir: str) -> None:
    engine = build_rank_engine(spec, group)
    lora = {id(p) for b in engine.banks.values() for p in (b.lora_A, b.lora_B)}
    report = {
        "compute": str(engine.compute_dtype),
        "base": sorted({str(p.dtype) for p in engine.model.parameters() if id(p) not in lora}),
        "masters": str(engine.optimizer.data.dtype),
        "summary": engine.summary(),
    }
    Path(out_dir, f"rank{group.rank}.json").write_text(json.dumps(report))


@pytest.mark.parametrize(("setting", "expected"), [("bf16", "torch.bfloat16"), ("auto", "torch.float32")])
def test_dtype_setting_reaches_every_rank(tiny_dir: Path, tmp_path: Path, setting: str, expected: str) -> None:
    settings = Settings(
        base_model=str(tiny_dir), model_cache=tiny_dir.parent, home=tmp_path, dtype=setting, world_size=2, slots=2
    )
    context, _port = spawn_ranks(_report, (engine_spec(settings), str(tmp_path)), world_size=2, ranks=range(2), device="cpu")
    context.join(timeout=150)
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["compute"] == expected
        assert report["base"] == [expected]  # embeddings, norms, every projection: nothing left in another dtype
        assert report["masters"] == "torch.float32"  # LoRA banks keep fp32 masters
        assert f"dtype {expected.removeprefix('torch.')}" in report["summary"] and "2 slots" in report["summary"]
