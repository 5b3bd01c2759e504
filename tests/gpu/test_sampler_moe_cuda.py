"""The native sampler on an MoE base (`tiny-moe`) on CUDA in bf16: the decode step (routed experts with expert LoRA
through grouped_mm) is captured as one CUDA graph and replays what it gives eagerly (greedy tokens identical), runs
with no host sync, its batched MoE MLP is within 2x the bf16 reference loop's own error of the fp32 reference, and the
sampled logprobs are the bf16 training forward's within bf16 noise.

Run on the GPU machine: `python -m pytest -q -m gpu tests/gpu/test_sampler_moe_cuda.py -s`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from loraplex.workers.engine.engine import Engine
from loraplex.workers.sampling.jobs import SampleJob, SampleParams
from loraplex.workers.sampling.moe_decode import MoeDecodeMlp, moe_batched, moe_reference, rows_of
from loraplex.workers.sampling.sampler import Sampler
from tests.helpers.datums import datums
from tests.helpers.sampling import engine_with_adapters

pytestmark = [pytest.mark.usefixtures("exact_fp32_matmul")]
ADAPTERS = {"r4": (4, 8.0, 1), "r8": (8, 16.0, 2), "r2": (2, 4.0, 3)}
GREEDY = SampleParams(max_tokens=16, temperature=0.0)


def build(moe_dir: Path, dtype: torch.dtype) -> tuple[Engine, Any]:
    return engine_with_adapters(moe_dir, ADAPTERS, num_slots=4, max_rank=8, seed=5, dtype=dtype, device="cuda")


def jobs() -> list[SampleJob]:
    g = torch.Generator().manual_seed(9)
    order = ["r8", None, "r4", "r2", None, "r4", "r8", "r2", "r4"]
    return [
        SampleJob(tuple(torch.randint(2, 512, (3 + (5 * i) % 19,), generator=g).tolist()), m, GREEDY)
        for i, m in enumerate(order)
    ]


def test_moe_graph_replay_equals_eager_and_logprobs_equal_the_training_forward(tiny_moe_dir: Path) -> None:
    engine, tokenizer = build(tiny_moe_dir, torch.bfloat16)
    graphs = Sampler(engine, tokenizer, max_rows=16)
    eager = Sampler(engine, tokenizer, max_rows=16, cuda_graphs=False)
    with_graph = graphs.generate(jobs())
    assert graphs.stats.graph_captures >= 1  # the MoE step captured (per row bucket): static shapes, no host sync
    without = eager.generate(jobs())
    worst = 0.0
    for job, a, b in zip(jobs(), with_graph, without, strict=True):
        assert a.sequences[0].tokens == b.sequences[0].tokens
        assert max(abs(x - y) for x, y in zip(a.sequences[0].logprobs, b.sequences[0].logprobs, strict=True)) <= 2e-2
        if job.model_id is None:
            continue
        seq = a.sequences[0]
        tokens = [*job.prompt, *seq.tokens]
        datum = {"model_input": tokens[:-1], "loss_fn_inputs": {"target_tokens": tokens[1:]}}
        (out,) = engine.forward_backward([engine.prepare(job.model_id, datums([datum]), "cross_entropy", None, True)])
        expected = out["loss_fn_outputs"][0]["logprobs"][len(job.prompt) - 1 :]
        worst = max(worst, max(abs(x - float(y)) for x, y in zip(seq.logprobs, expected, strict=True)))
    print(f"\nbf16 tiny-moe: sampled logprobs vs the training forward, max |diff| {worst:.4f}")
    assert worst <= 0.1  # bf16: the decode step and the packed training forward round differently


def test_batched_moe_mlp_bf16_is_within_the_reference_error_and_never_syncs(tiny_moe_dir: Path) -> None:
    fp32, _ = build(tiny_moe_dir, torch.float32)
    bf16, _ = build(tiny_moe_dir, torch.bfloat16)
    slots = torch.tensor([fp32.adapter(m).slot for m in ADAPTERS], device="cuda")
    g = torch.Generator(device="cuda").manual_seed(3)
    rows = 64
    x32 = torch.randn(rows, 64, device="cuda", generator=g)
    group = torch.randint(-1, len(ADAPTERS), (rows,), device="cuda", generator=g)
    scales = torch.tensor([fp32.adapter(m).scale for m in ADAPTERS], device="cuda")
    mask = torch.zeros(rows, len(ADAPTERS), 8, device="cuda")
    mask[group >= 0, group[group >= 0]] = scales[group[group >= 0]][:, None]
    mask = mask.view(rows, -1)
    row_group, row_scale = rows_of(mask, rows, len(ADAPTERS), 8, x32.device)
    outs = {}
    for name, engine, dtype in (("fp32", fp32, torch.float32), ("bf16", bf16, torch.bfloat16)):
        mlp: Any = engine.body.layers[1].mlp
        moe = MoeDecodeMlp(mlp, lambda x, m: [], lambda x, m: [], len(ADAPTERS), 8, dtype, x32.device)
        moe.load(slots)
        with torch.inference_mode():
            outs[f"{name}-reference"] = moe_reference(x32.to(dtype), mlp, moe.stacks, row_group, row_scale).float()
            if name == "bf16":
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")  # a host sync in the batched form raises
                try:
                    outs["bf16-batched"] = moe_batched(x32.to(dtype), mlp, moe.stacks, row_group, row_scale).float()
                    outs["bf16-one-group-at-a-time"] = moe_batched(
                        x32.to(dtype), mlp, moe.stacks, row_group, row_scale, max_groups=4
                    ).float()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
    truth = outs["fp32-reference"]
    ulp = truth.abs().max().item() * 2**-8
    bound = 2 * (outs["bf16-reference"] - truth).abs().max().item() + ulp
    for name in ("bf16-batched", "bf16-one-group-at-a-time"):
        assert (outs[name] - truth).abs().max().item() <= bound, name
