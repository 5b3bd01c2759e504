"""The grouped_mm LoRA op on CUDA in bf16 against the fp32 plain-torch reference on the same inputs (outputs and all
gradients), at real Qwen3-4B shapes; grouped_mm's CUDA sharp edges; and the engine in bf16 with either op.

Tolerances (stated in `check_against_fp32_reference`): elementwise |grouped_bf16 - reference_fp32| <= (8 u + 2 K u32) M
with u = 2^-8 (bf16 unit roundoff), u32 = 2^-24, K the summed inner dimensions, M the same quantity computed from absolute
values; M = 0 (rank padding, empty groups, unused slots) demands an exact zero.

Run on the GPU machine: `python -m pytest -q -m gpu tests/gpu -s` (-s prints the error/bound ratios)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from loraplex.workers.lora import LoraOp, Routing, lora_delta_grouped, lora_delta_reference, select_lora_op
from tests.helpers.datums import with_datums
from tests.helpers.gpu import QWEN3_4B, add_four_adapters, cuda_case, flat_logprobs, random_data
from tests.helpers.lora import check_against_fp32_reference, run_op

pytestmark = [pytest.mark.usefixtures("exact_fp32_matmul")]
CUDA = torch.device("cuda")


def test_select_lora_op_on_this_gpu() -> None:
    major, minor = torch.cuda.get_device_capability(CUDA)
    expected = lora_delta_grouped if major in (9, 10) else lora_delta_reference
    assert select_lora_op(CUDA, torch.bfloat16) is expected, f"sm{major}{minor}"
    assert select_lora_op(CUDA, torch.float32) is lora_delta_reference


@pytest.mark.parametrize("module", sorted(QWEN3_4B))
def test_bf16_grouped_matches_fp32_reference_at_qwen3_4b_shapes(module: str) -> None:
    n_in, n_out = QWEN3_4B[module]
    # 4 tenants x 2 sequences of 512 tokens, one of them a lower rank (zero-padded in the r_max = 32 bank).
    case = cuda_case(n_in, n_out, 32, [0, 3, 5, 6], [32, 16, 32, 8], [2.0, 4.0, 0.5, 1.0], [1024] * 4, seed=len(module))
    ratios = check_against_fp32_reference(*case, dtype=torch.bfloat16)
    print(f"{module} {n_in}x{n_out}: max error/bound {ratios}")


@pytest.mark.parametrize(
    ("n_in", "n_out", "r_max", "rows"),
    [
        (64, 48, 16, [40, 7, 0, 33]),  # an empty group in the middle
        (256, 512, 32, [0, 300, 1, 211]),  # empty first group, a 1-row group
        (100, 36, 12, [17, 50, 9, 0]),  # in, out, r_max not multiples of 8: zero-padded; empty last group
    ],
)
def test_bf16_grouped_matches_fp32_reference_uneven_empty_and_unaligned(
    n_in: int, n_out: int, r_max: int, rows: list[int]
) -> None:
    ranks = [r_max, max(1, r_max // 2), 3, r_max]
    case = cuda_case(n_in, n_out, r_max, [1, 4, 2, 7], ranks, [1.0, 2.0, 0.25, 8.0], rows, seed=n_in)
    ratios = check_against_fp32_reference(*case, dtype=torch.bfloat16)
    print(f"{n_in}x{n_out} r{r_max} rows {rows}: max error/bound {ratios}")


def test_routing_build_does_not_wait_for_the_gpu_queue() -> None:
    """Routing is built at every microbatch while the previous one's backward may still be queued: building it must not
    synchronise (a blocking host-to-device copy would), or the host loses its run-ahead."""
    args = ([3, 1, 2], [8, 4, 8], [2.0, 1.0, 0.5], [512, 1024, 512])
    Routing.build(*args, device=CUDA)  # warm the pinned-memory pool
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU work queued ahead
    t0 = time.perf_counter()
    routing = Routing.build(*args, device=CUDA)
    elapsed = time.perf_counter() - t0
    still_busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert still_busy and elapsed < 0.2, f"Routing.build took {elapsed:.3f} s behind a busy GPU"
    assert routing.offs.tolist() == [512, 1536, 2048] and routing.row_scales[600].item() == 1.0


def test_zero_stride_gradient_and_misaligned_input_on_cuda() -> None:
    x, a, b, routing, _ = cuda_case(128, 256, 32, [2, 5, 0], [32, 8, 16], [1.0, 2.0, 0.5], [100, 3, 61], seed=3)
    x = x.bfloat16()
    ones = torch.ones(x.shape[0], 256, device=CUDA, dtype=torch.bfloat16)
    expanded = run_op(lora_delta_grouped, x, a, b, routing, None)  # y.sum().backward(): zero-stride incoming gradient
    dense = run_op(lora_delta_grouped, x, a, b, routing, ones)
    for got, want in zip(expanded, dense, strict=True):
        assert torch.equal(got, want)
    storage = torch.empty(x.numel() + 1, device=CUDA, dtype=torch.bfloat16)
    shifted = storage[1:].view_as(x)  # base pointer 2 bytes off 16-byte alignment: the op must copy it
    shifted.copy_(x)
    assert shifted.data_ptr() % 16 != 0
    for got, want in zip(run_op(lora_delta_grouped, shifted, a, b, routing, ones), dense, strict=True):
        assert torch.equal(got, want)


def test_engine_bf16_grouped_is_as_accurate_as_bf16_reference(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The tiny model on CUDA, mixed batches of 4 adapters, 2 steps: the bf16 engine with the grouped op stays as close
    to the fp32 engine (reference op) as the bf16 engine with the reference op does (error <= 2x that of the bf16
    reference + 1e-3): grouped_mm adds no error beyond bf16 rounding."""
    from loraplex.models import load_base_model, resolve
    from loraplex.workers.engine.build import build_engine
    from loraplex.workers.engine.config import EngineConfig
    from loraplex.workers.engine.engine import Engine

    tiny_dir: Path = resolve("tiny", tmp_path_factory.getbasetemp() / "model-cache")

    def engine(dtype: torch.dtype, op: LoraOp | None) -> Engine:
        model, _ = load_base_model(str(tiny_dir), tiny_dir.parent, dtype=dtype, device="cuda")
        e = build_engine(model, EngineConfig(num_slots=6, max_rank=16, lora_op=op))
        return add_four_adapters(e)

    oracle = engine(torch.float32, lora_delta_reference)
    ref_bf16 = engine(torch.bfloat16, lora_delta_reference)
    grouped_bf16 = engine(torch.bfloat16, None)
    assert all(bank.op is select_lora_op(CUDA, torch.bfloat16) for bank in grouped_bf16.banks.values())
    g = torch.Generator().manual_seed(0)

    items = [(m, random_data(g, 2, 64), "cross_entropy", None, False) for m in "abcd"]
    for _ in range(2):
        outs = [
            e.forward_backward([e.prepare(*with_datums(it)) for it in items]) for e in (oracle, ref_bf16, grouped_bf16)
        ]
        lp_oracle, lp_ref, lp_grouped = (flat_logprobs(o) for o in outs)
        err_ref, err_grouped = (lp_ref - lp_oracle).abs().max().item(), (lp_grouped - lp_oracle).abs().max().item()
        print(f"max |logprob - fp32 oracle|: bf16 reference {err_ref:.3g}, bf16 grouped {err_grouped:.3g}")
        assert err_grouped <= 2 * err_ref + 1e-3
        for e in (oracle, ref_bf16, grouped_bf16):
            assert all("metrics" in r for r in e.optim_step([(m, {"learning_rate": 1e-3}) for m in "abcd"]))
