"""The fused per-microbatch LoRA path on CUDA in bf16 against the fp32 plain-torch reference: one layer at real Qwen3-4B
shapes (grouped_mm reading strided views of the gathered bank buffer in place, and the single-group matmul path), and the
whole engine in bf16 (with the Triton norms and MLP activation of workers/kernels/fused_elementwise.py too, against the eager
modules).

Tolerances: per layer, the elementwise bound of `check_against_fp32_reference`, |fused_bf16 - reference_fp32| <=
(8 u + 2 K u32) M (u = 2^-8, u32 = 2^-24, K the summed inner dimensions, M the same quantity from absolute values; M = 0
demands an exact zero). Engine: the max logprob error of the bf16 fused engine against the fp32 reference engine stays
<= 2x that of the bf16 engine on the reference op + 1e-3 (the fused path adds no error beyond bf16 rounding).

Run on the GPU machine: `python -m pytest -q -m gpu tests/gpu -s`."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from loraplex.workers.lora import lora_delta_grouped, lora_delta_reference, select_lora_op
from tests.helpers.datums import with_datums
from tests.helpers.gpu import QWEN3_4B, add_four_adapters, cuda_case, flat_logprobs, random_data
from tests.helpers.lora import check_against_fp32_reference, run_fused

pytestmark = [pytest.mark.usefixtures("exact_fp32_matmul")]
CUDA = torch.device("cuda")


def grouped_here() -> bool:
    return select_lora_op(CUDA, torch.bfloat16) is lora_delta_grouped


@pytest.mark.parametrize("module", sorted(QWEN3_4B))
@pytest.mark.parametrize("groups", [1, 4])
def test_fused_bf16_matches_fp32_reference_at_qwen3_4b_shapes(module: str, groups: int) -> None:
    n_in, n_out = QWEN3_4B[module]
    if groups == 4:  # 4 tenants x 2 sequences of 512 tokens, two of them lower ranks (zero padding in r_max 32)
        args = ([0, 3, 5, 6], [32, 16, 32, 8], [2.0, 4.0, 0.5, 1.0], [1024] * 4)
    else:  # a lone 1x512-token step
        args = ([3], [32], [2.0], [512])
    case = cuda_case(n_in, n_out, 32, *args, seed=len(module) + groups)
    ratios = check_against_fp32_reference(
        *case, dtype=torch.bfloat16, run=partial(run_fused, grouped=grouped_here(), lead=8)
    )
    print(f"fused {module} {n_in}x{n_out} G={groups}: max error/bound {ratios}")


def test_fused_bf16_unaligned_and_empty_groups() -> None:
    case = cuda_case(100, 36, 12, [1, 4, 2, 7], [12, 6, 3, 12], [1.0, 2.0, 0.25, 8.0], [17, 50, 9, 0], seed=5)
    ratios = check_against_fp32_reference(
        *case, dtype=torch.bfloat16, run=partial(run_fused, grouped=grouped_here(), lead=3)
    )
    print(f"fused unaligned: max error/bound {ratios}")


@pytest.mark.parametrize("siblings", [False, True], ids=["layers-alone", "sibling-nodes"])
def test_engine_bf16_fused_is_as_accurate_as_bf16_reference(
    tmp_path_factory: pytest.TempPathFactory, siblings: bool
) -> None:
    from loraplex.models import load_base_model, resolve
    from loraplex.workers.engine.build import build_engine
    from loraplex.workers.engine.config import EngineConfig
    from loraplex.workers.engine.engine import Engine

    tiny_dir: Path = resolve("tiny", tmp_path_factory.getbasetemp() / "model-cache")

    def engine(dtype: torch.dtype, **kw: object) -> Engine:
        model, _ = load_base_model(str(tiny_dir), tiny_dir.parent, dtype=dtype, device="cuda")
        e = build_engine(model, EngineConfig(num_slots=6, max_rank=16, **kw))  # type: ignore[arg-type]
        return add_four_adapters(e)

    oracle = engine(torch.float32, lora_op=lora_delta_reference, fused_elementwise=False)
    ref_bf16 = engine(torch.bfloat16, lora_op=lora_delta_reference, fused_elementwise=False)
    fused_bf16 = engine(
        torch.bfloat16, fused_elementwise=True, fused_head=True, shared_lora_inputs=siblings
    )  # Triton too
    assert fused_bf16.fused_lora and fused_bf16.compute_dtype == torch.bfloat16
    assert fused_bf16.fused_elementwise and fused_bf16.fused_modules > 0
    g = torch.Generator().manual_seed(0)

    mixed = [(m, random_data(g, 2, 64), "cross_entropy", None, False) for m in "abcd"]
    lone = [("b", random_data(g, 1, 64), "cross_entropy", None, False)]
    for items in (mixed, lone):
        for _ in range(2):
            outs = [
                e.forward_backward([e.prepare(*with_datums(it)) for it in items])
                for e in (oracle, ref_bf16, fused_bf16)
            ]
            lp_oracle, lp_ref, lp_fused = (flat_logprobs(o) for o in outs)
            err_ref, err_fused = (lp_ref - lp_oracle).abs().max().item(), (lp_fused - lp_oracle).abs().max().item()
            print(f"max |logprob - fp32 oracle|: bf16 reference {err_ref:.3g}, bf16 fused {err_fused:.3g}")
            assert err_fused <= 2 * err_ref + 1e-3
            models = sorted({m for m, *_ in items})
            grads = [e.adapter_grads(m) for e in (oracle, ref_bf16, fused_bf16) for m in models]
            n = len(models)
            for o, r, f in zip(grads[:n], grads[n : 2 * n], grads[2 * n :], strict=True):
                for name in o:
                    for i in (0, 1):
                        e_r = (r[name][i] - o[name][i]).abs().max().item()
                        e_f = (f[name][i] - o[name][i]).abs().max().item()
                        assert e_f <= 2 * e_r + 1e-3 * o[name][i].abs().max().item() + 1e-6, (name, i, e_f, e_r)
            for e in (oracle, ref_bf16, fused_bf16):
                assert all("metrics" in r for r in e.optim_step([(m, {"learning_rate": 1e-3}) for m in models]))
    assert all((g.fused_calls > 0) == siblings for g in fused_bf16.sibling_groups)
