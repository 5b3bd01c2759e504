"""Which LoRA delta op a worker uses for its device and compute dtype.

CPU decision, measured with `python -m benchmarks.lora_microbench --threads 1` (torch 2.13.0 CPU, the project's 2-core
CPU machine, forward + backward of one layer with x and both banks requiring grad, T = 2048 rows split evenly into G groups,
r = 16; minimum of 20 runs, ms; 2 threads gave the same ratios but noisier numbers while other jobs ran):

    fp32        in x out  G=1 ref/grouped    G=2            G=4            G=8
                256x256   1.48 / 1.48        2.49 / 1.69    3.46 / 1.67    5.52 / 1.82
              1024x1024   5.39 / 4.86 *      9.16 / 5.42   12.24 / 5.56   18.94 / 5.49
    bf16        256x256   1.18 / 1.16        2.22 / 1.56    3.38 / 1.79    5.88 / 2.37
              1024x1024   3.21 / 3.14        6.10 / 3.91    9.28 / 4.18   15.66 / 4.91
    fp32 tiny preset shapes (T=64, 64x64, r=8): G=2 0.21 / 0.19, G=4 0.38 / 0.21, G=8 0.64 / 0.26

    (* G=1 runs the same plain-matmul path in both ops; the difference is noise.)

grouped_mm wins at every G >= 2 on CPU (1.4x at 2 groups, 2-3.5x at 8) and the single-group path is shared, so CPU uses
the grouped op in fp32, bf16 and fp16; fp64 (not supported by grouped_mm) keeps the reference loop. Most of the loop's cost
is per group: a matmul pair, a cat, and in backward a full-bank-sized zero gradient per slice.

CUDA: `F.grouped_mm` is a fused CUTLASS kernel only on sm90 / sm100 in bf16; elsewhere torch runs a synchronising
per-group loop, no better than the reference, so the reference is used there (and for fp32 / fp16 on any GPU).
Measured on the H200 (torch 2.11.0+cu130, bf16, T = 4096 rows, r = 32, same micro-benchmark, synchronised after every
forward + backward, so these are latencies that include launch and host time, not GPU throughput), ref / grouped ms:

    in x out     G=1            G=2            G=4            G=8            G=16
    2560x4096    0.50 / 0.52    1.07 / 0.57    1.63 / 0.53    3.06 / 0.65    6.60 / 0.40
    2560x1024    0.40 / 0.55    0.80 / 0.44    1.84 / 0.49    3.44 / 0.66    5.30 / 0.67
    2560x9728    0.91 / 0.83    1.41 / 0.68    1.49 / 0.41    2.83 / 0.46    5.73 / 0.54
    9728x2560    0.51 / 0.48    0.85 / 0.58    1.73 / 0.62    3.00 / 0.58    5.62 / 0.79

The grouped op's cost stays flat in G; the loop's grows linearly (G=1 is the shared plain-matmul path: equal up to noise).
"""

from __future__ import annotations

import torch

from loraplex.workers.lora.grouped import lora_delta_grouped
from loraplex.workers.lora.reference import lora_delta_reference
from loraplex.workers.lora.slot_bank import LoraOp

_CPU_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FUSED_CUDA_MAJORS = (9, 10)  # sm90 (H100/H200), sm100 (B200): grouped_mm has a fused bf16 kernel there


def select_lora_op(device: str | torch.device, dtype: torch.dtype) -> LoraOp:
    """The LoRA delta op for activations of `dtype` on `device`: `lora_delta_grouped` where it is measured or known to be
    faster, otherwise `lora_delta_reference`. Both have the same semantics; both take the plain-matmul path for one group."""
    device = torch.device(device)
    if device.type == "cpu":
        return lora_delta_grouped if dtype in _CPU_GROUPED_DTYPES else lora_delta_reference
    if device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.is_available():
        major, _ = torch.cuda.get_device_capability(device)
        if major in _FUSED_CUDA_MAJORS:
            return lora_delta_grouped
    return lora_delta_reference
