"""The engine's CUDA-graph body (workers/body_graphs.py) on CUDA: a bf16 engine replaying graphs computes what the
bf16 engine on the plain-torch reference op computes, as measured against the fp32 reference engine (logprobs and
adapter gradients within 2x the bf16 reference's own error), over steps that capture buckets, replay them with other
adapters, ranks, lengths and data, and run one-off shapes eagerly; the optimizer steps in between (the graphs read the
master banks anew each microbatch). Twice: with each LoRA layer alone and with q/k/v, gate/up as sibling nodes
(lora/siblings.py), captured into the graphs and eager."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex.workers.lora import lora_delta_reference
from tests.helpers.gpu import add_four_adapters, flat_logprobs, random_data

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("siblings", [False, True], ids=["layers-alone", "sibling-nodes"])
def test_engine_on_cuda_graphs_is_as_accurate_as_the_bf16_reference(
    tmp_path_factory: pytest.TempPathFactory, siblings: bool
) -> None:
    from loraplex.models import load_base_model, resolve
    from loraplex.workers.engine import Engine

    tiny_dir: Path = resolve("tiny", tmp_path_factory.getbasetemp() / "model-cache")
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")

    def engine(dtype: torch.dtype, **kw: object) -> Engine:
        model, _ = load_base_model(str(tiny_dir), tiny_dir.parent, dtype=dtype, device="cuda")
        e = Engine(model, num_slots=6, max_rank=16, **kw)  # type: ignore[arg-type]
        return add_four_adapters(e)

    try:
        oracle = engine(torch.float32, lora_op=lora_delta_reference)
        ref_bf16 = engine(torch.bfloat16, lora_op=lora_delta_reference)
        graphed = engine(torch.bfloat16, fused_elementwise=True, cuda_graphs=True, shared_lora_inputs=siblings)
        assert graphed.cuda_graphs and graphed.graphs is not None
        g = torch.Generator().manual_seed(0)
        # Buckets: mixed (4 groups + pad group -> 8, 256 tokens) and lone (1 + pad -> 2 groups); each runs three times
        # (eager, capture, replay) with new data, the lone one with two adapters of different rank and scale.
        plan = [[(m, random_data(g, 2, 29 + 3 * i), "cross_entropy", None, False) for i, m in enumerate("abcd")]] * 3
        plan += [[(m, random_data(g, 1, 64), "cross_entropy", None, False)] for m in "bdb"]
        plan += [[("c", random_data(g, 3, 200), "cross_entropy", None, False)]]  # a one-off bucket: eager
        for items in plan:
            outs = [e.forward_backward([e.prepare(*it) for it in items]) for e in (oracle, ref_bf16, graphed)]
            lp_oracle, lp_ref, lp_graphed = (flat_logprobs(o) for o in outs)
            err_ref, err_graphed = (lp_ref - lp_oracle).abs().max().item(), (lp_graphed - lp_oracle).abs().max().item()
            print(f"max |logprob - fp32 oracle|: bf16 reference {err_ref:.3g}, bf16 graphed {err_graphed:.3g}")
            assert err_graphed <= 2 * err_ref + 1e-3
            models = sorted({m for m, *_ in items})
            for m in models:
                o, r, f = (e.adapter_grads(m) for e in (oracle, ref_bf16, graphed))
                for name in o:
                    for i in (0, 1):
                        e_r, e_f = (
                            (r[name][i] - o[name][i]).abs().max().item(),
                            (f[name][i] - o[name][i]).abs().max().item(),
                        )
                        assert e_f <= 2 * e_r + 1e-3 * o[name][i].abs().max().item() + 1e-6, (m, name, i, e_f, e_r)
            for e in (oracle, ref_bf16, graphed):
                e.optim_step([(m, {"learning_rate": 1e-3}) for m in models])
        assert graphed.graphs.captures == 2, graphed.graphs.captures
        assert all((g.fused_calls > 0) == siblings for g in graphed.sibling_groups)
        assert graphed.graphs.replays == 2 * 2, graphed.graphs.replays  # the capture's own run and one more, each
    finally:
        torch.set_float32_matmul_precision(previous)
