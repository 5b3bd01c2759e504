"""The engine's CUDA-graph body (workers/engine/body_graphs.py) on CUDA: a bf16 engine replaying graphs computes what the
bf16 engine on the plain-torch reference op computes, as measured against the fp32 reference engine (logprobs and
adapter gradients within 2x the bf16 reference's own error), over steps that capture buckets, replay them with other
adapters, ranks, lengths and data, and run one-off shapes eagerly; the optimizer steps in between (the graphs read the
master banks anew each microbatch). Twice: with each LoRA layer alone and with q/k/v, gate/up as sibling nodes
(lora/siblings.py), captured into the graphs and eager. Then buckets of one group count sharing their static banks, and
a capture declined for want of room (it runs eagerly, as accurately). Then an MoE engine's graphs, expert LoRA
included."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.lora import lora_delta_reference
from tests.helpers.calls import CallCount
from tests.helpers.datums import with_datums
from tests.helpers.gpu import add_four_adapters, flat_logprobs, random_data

if TYPE_CHECKING:
    from loraplex.workers.engine.engine import Engine



def _engines(
    tmp_path_factory: pytest.TempPathFactory, preset: str = "tiny", eager_reference: bool = False, **graphed_kw: object
) -> tuple[Engine, Engine, Engine]:
    """The fp32 oracle, the bf16 reference op (`eager_reference`: the graphed engine's own ops, run eagerly) and the
    bf16 engine replaying graphs, each with adapters a-d."""
    from loraplex.models import load_base_model, resolve

    tiny_dir: Path = resolve(preset, tmp_path_factory.getbasetemp() / "model-cache")

    def engine(dtype: torch.dtype, **kw: object) -> Engine:
        model, _ = load_base_model(str(tiny_dir), tiny_dir.parent, dtype=dtype, device="cuda")
        e = build_engine(model, EngineConfig(num_slots=6, max_rank=16, **kw))  # type: ignore[arg-type]
        return add_four_adapters(e)

    oracle = engine(torch.float32, lora_op=lora_delta_reference)
    if eager_reference:
        ref_bf16 = engine(torch.bfloat16, fused_elementwise=True, cuda_graphs=False)
    else:
        ref_bf16 = engine(torch.bfloat16, lora_op=lora_delta_reference)
    graphed = engine(torch.bfloat16, fused_elementwise=True, cuda_graphs=True, **graphed_kw)
    assert graphed.cuda_graphs and graphed.graphs is not None
    return oracle, ref_bf16, graphed


def _step_and_compare(engines: tuple[Engine, Engine, Engine], items: list[tuple], same_start: bool = False) -> None:
    """One forward_backward of `items` on each engine: the graphed engine's logprobs and adapter gradients within 2x
    the bf16 reference's error against the fp32 oracle; then an optimizer step on each. `same_start`: the bf16 engines
    then take the oracle's new weights, so the next comparison measures one step's error, not two bf16 trajectories'
    drift (Adam moves a near-zero gradient's weight by about the learning rate whatever its rounding noise)."""
    oracle, ref_bf16, graphed = engines
    outs = [e.forward_backward([e.prepare(*with_datums(it)) for it in items]) for e in engines]
    lp_oracle, lp_ref, lp_graphed = (flat_logprobs(o) for o in outs)
    err_ref, err_graphed = (lp_ref - lp_oracle).abs().max().item(), (lp_graphed - lp_oracle).abs().max().item()
    print(f"max |logprob - fp32 oracle|: bf16 reference {err_ref:.3g}, bf16 graphed {err_graphed:.3g}")
    assert err_graphed <= 2 * err_ref + 1e-3
    models = sorted({m for m, *_ in items})
    for m in models:
        o, r, f = (e.adapter_grads(m) for e in engines)
        for name in o:
            for i in (0, 1):
                e_r, e_f = (r[name][i] - o[name][i]).abs().max().item(), (f[name][i] - o[name][i]).abs().max().item()
                assert e_f <= 2 * e_r + 1e-3 * o[name][i].abs().max().item() + 1e-6, (m, name, i, e_f, e_r)
    for e in engines:
        e.optim_step([(m, {"learning_rate": 1e-3}) for m in models])
    if same_start:
        for m in models:
            weights = oracle.adapter_weights(m)
            for e in (ref_bf16, graphed):
                e.load_adapter_weights(m, weights)


@pytest.mark.usefixtures("exact_fp32_matmul")
@pytest.mark.parametrize("siblings", [False, True], ids=["layers-alone", "sibling-nodes"])
def test_engine_on_cuda_graphs_is_as_accurate_as_the_bf16_reference(
    tmp_path_factory: pytest.TempPathFactory, siblings: bool
) -> None:
    engines = _engines(tmp_path_factory, shared_lora_inputs=siblings)
    graphed = engines[2]
    assert graphed.graphs is not None
    g = torch.Generator().manual_seed(0)
    # Buckets: mixed (4 groups + pad group -> 8, 256 tokens) and lone (1 + pad -> 2 groups); each runs three times
    # (eager, capture, replay) with new data, the lone one with two adapters of different rank and scale.
    plan = [[(m, random_data(g, 2, 29 + 3 * i), "cross_entropy", None, False) for i, m in enumerate("abcd")]] * 3
    plan += [[(m, random_data(g, 1, 64), "cross_entropy", None, False)] for m in "bdb"]
    plan += [[("c", random_data(g, 3, 200), "cross_entropy", None, False)]]  # a one-off bucket: eager
    for items in plan:
        _step_and_compare(engines, items)
    assert graphed.graphs.captures == 2, graphed.graphs.captures
    assert all((g.fused_calls > 0) == siblings for g in graphed.sibling_groups)
    assert graphed.graphs.replays == 2 * 2, graphed.graphs.replays  # the capture's own run and one more, each
    assert sorted(graphed.graphs.banks) == [2, 8] and graphed.graphs.memory_bytes > 0


@pytest.mark.usefixtures("exact_fp32_matmul")
def test_microbatches_of_one_length_replay_the_dense_attention_as_accurately(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sequences of one length filling a bucket (4 adapters x 2 x 32 tokens; one adapter 4 x 64) take the attention's
    dense path in the captures (an eager microbatch from its second time on) and stay as accurate; each bucket runs
    three times (eager, capture, replay)."""
    from loraplex.workers.kernels import packed_attention as pa

    dense = CallCount(monkeypatch, pa, "uniform_attention")
    engines = _engines(tmp_path_factory)
    graphs = engines[2].graphs
    assert graphs is not None
    g = torch.Generator().manual_seed(2)
    plan = [[(m, random_data(g, 2, 32), "cross_entropy", None, False) for m in "abcd"]] * 3
    plan += [[("c", random_data(g, 4, 64), "cross_entropy", None, False)]] * 3
    for items in plan:
        _step_and_compare(engines, items)
    assert graphs.captures == 2 and all(key.uniform for key in graphs.graphs), list(graphs.graphs)
    assert sorted(key.max_length for key in graphs.graphs) == [32, 64] and dense.calls > 0


@pytest.mark.usefixtures("exact_fp32_matmul")
def test_buckets_share_their_group_counts_banks_and_a_capture_without_room_runs_eagerly(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    engines = _engines(tmp_path_factory)
    graphs = engines[2].graphs
    assert graphs is not None
    g = torch.Generator().manual_seed(1)

    def lone(model_id: str, rows: int, length: int) -> list[tuple]:
        return [(model_id, random_data(g, rows, length), "cross_entropy", None, False)]

    # Two buckets of 2 groups (one adapter + the pad group): 256 and 768 tokens, captured on their second sighting,
    # then the first replayed again after the second's capture wrote the same banks.
    for items in [lone("b", 1, 64), lone("b", 1, 64), lone("d", 3, 200), lone("d", 3, 200), lone("a", 1, 64)]:
        _step_and_compare(engines, items)
    assert graphs.captures == 2 and list(graphs.banks) == [2], (graphs.captures, list(graphs.banks))
    held = graphs.memory_bytes
    # No room left for the eager path after another capture (margin: the whole device): a new bucket (1,024 tokens)
    # is warmed up, not captured, and runs eagerly from then on.
    graphs.margin = torch.cuda.get_device_properties(0).total_memory
    for items in [lone("c", 5, 200), lone("c", 5, 200), lone("c", 5, 200)]:
        _step_and_compare(engines, items)
    assert graphs.captures == 2 and len(graphs.declined) == 1 and graphs.memory_bytes == held
    assert next(iter(graphs.declined)).tokens == 1024 and graphs.no_room_tokens == 1024
    # A larger bucket (1,280 tokens) is not even warmed up; a smaller one (512) still is, and is declined too.
    for items in [lone("a", 3, 400), lone("a", 3, 400), lone("b", 2, 200), lone("b", 2, 200)]:
        _step_and_compare(engines, items)
    assert graphs.captures == 2 and sorted(k.tokens for k in graphs.declined) == [512, 1024]
    assert graphs.no_room_tokens == 512


@pytest.mark.usefixtures("exact_fp32_matmul")
def test_an_moe_engine_on_cuda_graphs_trains_its_expert_banks_as_the_bf16_reference(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """tiny-moe (LoRA on attention and every expert's gate / up / down): the captured backward adds the expert banks'
    gradients into the optimizer's (checked by _step_and_compare with every other bank's), across replays with other
    adapters and data; then with grouped_mm's group limit lowered, so the expert LoRA runs in chunks inside new
    captures, as accurately. The bf16 reference is the same engine run eagerly (the fused expert ops are held to the
    reference op by test_lora_experts_cuda), and every step starts all three engines from the oracle's weights: left
    to their own optimizer steps, two bf16 paths that round differently drift apart (measured on an H100: after two
    steps the fused ops' logprob error 0.107, the reference op's 0.0425; with the LoRA gradients summed in fp32, one
    v_proj gradient's error 0.25 against 0.097 a few steps on)."""
    from loraplex.workers.lora.expert_bank import SlotBankExperts

    engines = _engines(tmp_path_factory, preset="tiny-moe", eager_reference=True)
    graphs = engines[2].graphs
    assert graphs is not None
    g = torch.Generator().manual_seed(2)
    mixed = [[(m, random_data(g, 2, 29 + 3 * i), "cross_entropy", None, False) for i, m in enumerate("abcd")]] * 3
    lone = [[(m, random_data(g, 1, 64), "cross_entropy", None, False)] for m in "bdb"]
    for items in mixed + lone:
        _step_and_compare(engines, items, same_start=True)
    assert graphs.captures == 2 and graphs.replays == 4, (graphs.captures, graphs.replays)
    assert any("experts" in name for name in engines[2].adapter_grads("a"))
    experts = [m for m in engines[2].model.modules() if isinstance(m, SlotBankExperts)]
    for m in experts:
        m.max_groups = 5  # the new bucket: 4 experts x 8 groups (4 adapters + pad group, padded) in 7 chunks
    for items in [[(m, random_data(g, 1, 40), "cross_entropy", None, False) for m in "abcd"]] * 3:
        _step_and_compare(engines, items, same_start=True)
    assert graphs.captures == 3, graphs.captures
