"""Sibling LoRA layers in one node (lora/siblings.py) on CUDA in bf16 at Qwen3-4B shapes (q/k/v: 2560 -> 4096, 1024,
1024; gate/up: 2560 -> 9728, 9728; rank 32), with the base matmul fused in: the one node's outputs, x.grad and bank
gradients are as close to the fp32 results of the layers run alone as the bf16 layers run alone are (within 2x their
error + a bf16 ulp of the magnitude), for one group (host rank; a CUDA graph's r_max with the scale on the device) and
four groups through grouped_mm reading strided column blocks of the shared product.

Run on the GPU machine: `python -m pytest -q -m gpu tests/gpu -s`."""

from __future__ import annotations

import pytest
import torch

from loraplex.workers.lora import Routing
from tests.helpers.lora import flat_sibling_banks, make_banks, run_siblings

pytestmark = [pytest.mark.usefixtures("exact_fp32_matmul")]
CUDA = torch.device("cuda")
SIBLINGS = {"q/k/v": (4096, 1024, 1024), "gate/up": (9728, 9728)}


@pytest.mark.parametrize("siblings", sorted(SIBLINGS))
@pytest.mark.parametrize(("groups", "single"), [(1, True), (1, False), (4, True)], ids=str)
def test_one_node_in_bf16_is_as_accurate_as_the_layers_alone(siblings: str, groups: int, single: bool) -> None:
    if groups == 4:
        slots, ranks, scales, rows = [0, 3, 5, 6], [32, 16, 32, 8], [2.0, 4.0, 0.5, 1.0], [1024] * 4
    else:
        slots, ranks, scales, rows = [3], [32 if not single else 16], [2.0], [512]
    outs = SIBLINGS[siblings]
    used = dict(zip(slots, ranks, strict=True))
    banks = [tuple(t.to(CUDA) for t in make_banks(used, 2560, n, 32, seed=i)) for i, n in enumerate(outs)]
    flat, layouts = flat_sibling_banks(banks)  # type: ignore[arg-type]
    routing = Routing.build(slots, ranks, scales, rows, device=CUDA)
    g = torch.Generator(device=CUDA).manual_seed(groups)
    n = routing.num_rows
    x = torch.randn(n, 2560, device=CUDA, generator=g)
    grads: list[torch.Tensor | None] = [torch.randn(n, o, device=CUDA, generator=g) for o in outs]
    bases32 = [torch.randn(o, 2560, device=CUDA, generator=g) / 50 for o in outs]
    bases16 = [w.to(torch.bfloat16) for w in bases32]
    kw = {"single": single}
    exact = run_siblings(flat, layouts, routing, x, grads, together=False, bases=bases32, **kw)  # type: ignore[arg-type]
    alone = run_siblings(flat, layouts, routing, x, grads, together=False, bases=bases16, dtype=torch.bfloat16, **kw)  # type: ignore[arg-type]
    one = run_siblings(flat, layouts, routing, x, grads, together=True, bases=bases16, dtype=torch.bfloat16, **kw)  # type: ignore[arg-type]
    names = [f"out {i}" for i in range(len(outs))] + ["x.grad", "bank grads"]
    for name, e, a, o in zip(
        names, [*exact[0], exact[1], exact[2]], [*alone[0], alone[1], alone[2]], [*one[0], one[1], one[2]], strict=True
    ):
        assert e is not None and a is not None and o is not None
        err_alone = (a.float() - e).abs().max().item()
        err_one = (o.float() - e).abs().max().item()
        print(f"{siblings} G={groups} single={single} {name}: bf16 alone {err_alone:.3g}, one node {err_one:.3g}")
        assert err_one <= 2 * err_alone + 2**-8 * e.abs().max().item(), name
