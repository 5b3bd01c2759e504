"""The decode step's masked LoRA expand reference (workers/kernels/lora_expand.py) is the per-row LoRA: row m of
adapter group g adds scale_g * (x_m A_g) B_g to each projection's columns, and nothing where its scale is 0."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from loraplex.workers.kernels.lora_expand import masked_expand, masked_expand_reference


def test_reference_is_each_rows_own_adapter() -> None:
    gen = torch.Generator().manual_seed(0)
    rows, groups, rank, inp = 9, 3, 4, 12
    widths = (10, 6, 6)  # q, k, v as one stacked output
    width = groups * rank
    x = torch.randn(rows, inp, generator=gen, dtype=torch.float64)
    a = [torch.randn(groups, inp, rank, generator=gen, dtype=torch.float64) for _ in widths]
    bs = [torch.randn(groups, rank, w, generator=gen, dtype=torch.float64) for w in widths]
    row_group = torch.tensor([0, 1, 2, 1, 0, 2, 2, 1, 0])
    scales = torch.tensor([0.5, 2.0, 0.0])  # group 2: base rows
    mask = torch.zeros(rows, width, dtype=torch.float64)
    for m, g in enumerate(row_group.tolist()):
        mask[m, g * rank : (g + 1) * rank] = scales[g]
    a_cat = torch.cat([ai.permute(1, 0, 2).reshape(inp, width) for ai in a], dim=1)  # [in, 3 * G * r]
    b_all = torch.cat([bi.reshape(width, -1) for bi in bs], dim=1)  # [G * r, sum of widths]
    base = torch.randn(rows, sum(widths), generator=gen, dtype=torch.float64)
    segments = [(0, 10), (10, 16), (16, 22)]
    out = base.clone()
    masked_expand_reference(out, x @ a_cat, mask, b_all, segments)
    expected = base.clone()
    for m, g in enumerate(row_group.tolist()):
        for i, (lo, hi) in enumerate(segments):
            expected[m, lo:hi] += scales[g].double() * (x[m] @ a[i][g]) @ bs[i][g]
    torch.testing.assert_close(out, expected)
    assert torch.equal(out[[2, 5, 6]], base[[2, 5, 6]])  # scale 0: the base product untouched

    again = base.clone()
    masked_expand(again, x @ a_cat, mask, b_all, segments)  # on the CPU: the reference itself
    assert torch.equal(again, out)


KERNEL_CHECK = """
import torch
from loraplex.workers.kernels.lora_expand import masked_expand_reference
from loraplex.workers.kernels.triton_lora_expand import masked_expand_kernel

gen = torch.Generator().manual_seed(3)
for rows, widths, wrapped in [(37, (256, 100, 256), (0, 2)), (64, (384,), (0,)), (5, (40, 24), (0, 1))]:
    groups, rank = 4, 32
    width = groups * rank
    starts = [sum(widths[:i]) for i in range(len(widths))]
    segments = [(starts[i], starts[i] + widths[i]) for i in wrapped]
    h = torch.randn(rows, len(wrapped) * width, generator=gen)
    b = torch.randn(width, sum(widths), generator=gen) * 0.1
    out = torch.randn(rows, sum(widths), generator=gen)
    mask = torch.zeros(rows, width)
    for m in range(rows):
        g = m * (groups + 1) // rows  # runs of rows per group, the last run base rows (no adapter)
        if g < groups:
            mask[m, g * rank : (g + 1) * rank] = 0.5 + g
    want = out.clone()
    masked_expand_reference(want, h, mask, b, segments)
    got = out.clone()
    masked_expand_kernel(got, h, mask, b, torch.tensor(segments, dtype=torch.int32))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
print("kernel ok")
"""


def test_the_triton_kernel_equals_the_reference_in_tritons_interpreter() -> None:
    """The GPU kernel's logic (tile bounds, segments, the skipped all-zero mask blocks) run by Triton's CPU
    interpreter on random inputs; tests/gpu/test_lora_expand_cuda.py runs it compiled."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # read when triton is imported: a process of its own
    done = subprocess.run([sys.executable, "-c", KERNEL_CHECK], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and "kernel ok" in done.stdout, done.stderr[-2000:]
