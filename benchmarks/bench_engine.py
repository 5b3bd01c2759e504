"""Engine benchmark: plain PEFT, our engine one adapter at a time ("single-resident", no swap costs), and our
engine concurrent (one mixed forward/backward + one batched AdamW), on a random-init Qwen3-shaped model.

    python3 benchmarks/bench_engine.py --model qwen3-4b-shape --rank 32 --seq-len 512 --cap 4096 --out results.json
    python3 benchmarks/bench_engine.py --mode cost      # 4 saturated tenants, cost model vs one by one
    python3 benchmarks/bench_engine.py --mode ragged    # ragged lengths vs uniform rows, packed and padded

--mode ragged: real-token throughput of ragged lengths (lognormal, 32-2,048 tokens) against uniform 512-token
rows with the same real-token count (4 adapters x 8 x 512 tokens per step), for the packed engine (the default) and the
padded one (EngineConfig(packed=False); `--layouts packed` or `padded` for one), all in one call.

Workloads: "underfilled" (4 adapters x 1 sequence each) and "saturated" (4 adapters x 8 sequences each). Every variant
is timed in the same process after warm-up; times are medians over --iters steps, with the GPU synchronised around
each phase. Needs only torch, transformers, peft and loraplex.workers/models (runs on the GPU image)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lengths import lognormal_lengths  # noqa: E402
from loraplex.models import build_preset_model, load_base_model  # noqa: E402
from loraplex.protocol.payloads import DatumPayload  # noqa: E402
from loraplex.workers.engine.batching import layout, split_microbatches  # noqa: E402
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.engine import Engine  # noqa: E402
from loraplex.workers.engine.lm_head import target_logprobs  # noqa: E402
from loraplex.workers.kernels import fused_elementwise as kernels_module  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    dtype = getattr(torch, args.dtype)
    if args.model.endswith("-shape"):
        return build_preset_model(args.model, dtype=dtype, device=args.device)
    model, _ = load_base_model(args.model, Path(args.cache), dtype=dtype, device=args.device)
    return model


def datums(vocab: int, n: int, seq_len: int, gen: torch.Generator) -> list[DatumPayload]:
    """`n` random rows of `seq_len` tokens, next-token targets, unit weights: the payloads the engine reads."""
    out = []
    for _ in range(n):
        toks = torch.randint(0, vocab, (seq_len + 1,), generator=gen).tolist()
        out.append(
            DatumPayload(model_input=toks[:-1], loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * seq_len})
        )
    return out


def timed(fn, iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def peak_reset() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gb() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


# ---- baselines ----------------------------------------------------------------------------------------------------
def frozen_base_step(model, n_seq: int, seq_len: int, device: str, fused: bool, fused_head: bool):  # type: ignore[no-untyped-def]
    """One forward + backward of the frozen base over n_seq x seq_len random tokens (activation gradients only; the
    model's parameters must not require grad). fused: the engine's Triton kernels (installed on the model)."""
    ids = torch.randint(0, model.config.vocab_size, (n_seq, seq_len + 1), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    body, head = model.get_decoder(), model.get_output_embeddings()

    def step() -> None:
        # A fresh context each step: active() is a generator context manager, entered once per instance.
        with kernels_module.active() if fused else contextlib.nullcontext():
            embeds = body.embed_tokens(ids[:, :-1]).detach().requires_grad_(True)
            hidden = body(inputs_embeds=embeds, use_cache=False).last_hidden_state.flatten(0, 1)
            (-target_logprobs(hidden, head.weight, ids[:, 1:].flatten(), fused=fused_head)).sum().backward()

    return step


def bench_frozen_base(model, args, tokens_per_step: int, fused: bool = False) -> dict[str, float]:
    """Forward + backward of the frozen base alone (activation grads only): the floor LoRA is measured against.
    fused: with the engine's kernels (Triton norms / RoPE / activation, and the fused LM head if --head has it)."""
    n_seq = tokens_per_step // args.seq_len
    step = frozen_base_step(model, n_seq, args.seq_len, args.device, fused, fused and "fused" in args.head.split(","))
    peak_reset()
    times = timed(step, args.iters, args.warmup)
    return {
        "step_s": statistics.median(times),
        "tok_s": tokens_per_step / statistics.median(times),
        "peak_gb": peak_gb(),
    }


def bench_frozen_base_graphed(model, args, tokens_per_step: int) -> dict[str, float]:
    """The frozen base's step with the engine's kernels captured as one CUDA graph (forward and backward) and
    replayed: its device time without the host's launches (an eager step of this model waits on the host), the same
    footing as the engine's graphed LoRA step."""
    n_seq = tokens_per_step // args.seq_len
    step = frozen_base_step(model, n_seq, args.seq_len, args.device, True, "fused" in args.head.split(","))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the warm-up the capture needs: kernels compiled, the allocator's pools made
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    times = timed(graph.replay, args.iters, args.warmup)
    median = statistics.median(times)
    result = {"step_s": median, "tok_s": tokens_per_step / median, "peak_gb": peak_gb()}
    del graph
    peak_reset()
    return result


def bench_peft(args, tokens_per_step: int) -> dict[str, float]:
    """Plain PEFT, one adapter, HF causal-LM loss, torch AdamW (fused on CUDA)."""
    from peft import LoraConfig, get_peft_model

    model = build_model(args)
    peft_model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=list(TARGETS)))
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, fused=torch.cuda.is_available())
    gen = torch.Generator().manual_seed(2)
    n_seq = tokens_per_step // args.seq_len
    ids = torch.randint(0, model.config.vocab_size, (n_seq, args.seq_len), generator=gen).to(args.device)
    phase: dict[str, list[float]] = {"fwd_bwd": [], "optim": []}

    def step() -> None:
        t0 = time.perf_counter()
        peft_model(input_ids=ids, labels=ids).loss.backward()
        sync()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        phase["fwd_bwd"].append(t1 - t0)
        phase["optim"].append(time.perf_counter() - t1)

    peak_reset()
    times = timed(step, args.iters, args.warmup)
    result = {
        "step_s": statistics.median(times),
        "tok_s": tokens_per_step / statistics.median(times),
        "fwd_bwd_s": statistics.median(phase["fwd_bwd"][args.warmup :]),
        "optim_s": statistics.median(phase["optim"][args.warmup :]),
        "peak_gb": peak_gb(),
    }
    return result  # the PEFT model is freed when this frame goes


# ---- our engine ---------------------------------------------------------------------------------------------------
def bench_engine_workload(engine: Engine, ids: list[str], per_adapter: int, args, concurrent: bool) -> dict[str, float]:
    gen = torch.Generator().manual_seed(3)
    data = {m: datums(engine.vocab_size, per_adapter, args.seq_len, gen) for m in ids}
    adam = {"learning_rate": 1e-5, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
    tokens = len(ids) * per_adapter * args.seq_len
    phase: dict[str, list[float]] = {"fwd_bwd": [], "optim": []}

    def run(group: list[str]) -> None:
        t0 = time.perf_counter()
        engine.forward_backward([engine.prepare(m, data[m], "cross_entropy", None, False) for m in group])
        sync()
        t1 = time.perf_counter()
        results = engine.optim_step([(m, adam) for m in group])
        sync()
        assert all(isinstance(r, dict) for r in results), results
        phase["fwd_bwd"][-1] += t1 - t0
        phase["optim"][-1] += time.perf_counter() - t1

    def step() -> None:
        phase["fwd_bwd"].append(0.0)
        phase["optim"].append(0.0)
        if concurrent:
            run(ids)
        else:
            for m in ids:  # one tenant at a time, as a single-resident server would run them
                run([m])

    peak_reset()
    times = timed(step, args.iters, args.warmup)
    return {
        "step_s": statistics.median(times),
        "tok_s": tokens / statistics.median(times),
        "fwd_bwd_s": statistics.median(phase["fwd_bwd"][args.warmup :]),
        "optim_s": statistics.median(phase["optim"][args.warmup :]),
        "peak_gb": peak_gb(),
    }


# ---- cost-model coalescing vs one by one --------------------------------------------------------------------------
def bench_cost_model(engine: Engine, args) -> dict[str, Any]:
    """Each round, every one of --adapters tenants runs one forward_backward (--saturated-seqs x --seq-len tokens: one
    microbatch each at the defaults) and one optim_step. "cost model": the pool's path, i.e. the dispatch policy with
    the online cost model, calibrated from this executor's own step times as the pool's is (OnlineCostModel fed by
    PlanExecutor(on_step=)), choosing mixed or per-adapter steps, run by the PlanExecutor; "one by one": each tenant's
    forward_backward then its optim_step as steps of their own (a single-resident server). Rounds alternate between
    the two after warm-up (drift hits both alike); medians of --rounds rounds each, in this one call."""
    from loraplex.dispatch.cost_calibration import OnlineCostModel
    from loraplex.dispatch.cost_model import default_cost
    from loraplex.dispatch.policy import PolicyLimits
    from loraplex.workers.engine.executor import PlanExecutor

    cost = OnlineCostModel(default_cost(args.device), args.cap)
    mixed_exec = PlanExecutor(engine, on_step=cost.observe_step)
    alone_exec = PlanExecutor(engine)
    limits = PolicyLimits(plan_tokens=args.plan_tokens, max_adapters_per_step=engine.num_slots)
    out: dict[str, Any] = {}
    for workload in args.cost_workloads.split(","):
        out[workload] = cost_workload(engine, args, workload, cost, mixed_exec, alone_exec, limits)
        print("cost", workload, {k: v for k, v in out[workload].items() if k != "round_s"}, flush=True)
    return out


def cost_workload(engine: Engine, args, workload: str, cost, mixed_exec, alone_exec, limits) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """One workload of bench_cost_model (see there)."""
    from loraplex.dispatch.policy import plan_batch
    from loraplex.protocol import BatchPlan, PlannedRequest, RequestKind, Step, StepKind

    adam = {"learning_rate": 1e-5, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
    per_adapter = {"saturated": args.saturated_seqs, "underfilled": 1}[workload]
    ids = [f"{workload}{i}" for i in range(args.adapters)]
    for i, m in enumerate(ids):
        engine.create_adapter(m, rank=args.rank, alpha=2 * args.rank, seed=100 + i)
    gen = torch.Generator().manual_seed(4)
    data = {m: datums(engine.vocab_size, per_adapter, args.seq_len, gen) for m in ids}
    applied: dict[str, int | None] = dict.fromkeys(ids, 0)
    seq = {"n": 1}
    shapes: list[list[int]] = []  # adapters per forward_backward step, per cost-model round

    def requests(m: str) -> tuple[PlannedRequest, PlannedRequest]:
        n = seq["n"]
        fb = PlannedRequest(f"{m}-{n}", m, m, n, RequestKind.FORWARD_BACKWARD,
                            {"data": data[m], "loss_fn": "cross_entropy"})  # fmt: skip
        return fb, PlannedRequest(f"{m}-{n}o", m, m, n + 1, RequestKind.OPTIM_STEP, {"adam_params": adam})

    def by_cost_model() -> None:
        pending = [r for m in ids for r in requests(m)]
        fb_steps: list[int] = []
        while pending:
            decision = plan_batch(pending, applied, limits, cost=cost)
            outcomes = mixed_exec.execute(decision.plan)
            assert all(o.ok for o in outcomes), [o.error for o in outcomes if not o.ok]
            fb_steps += [len(st.requests) for st in decision.plan.steps if st.kind == StepKind.FORWARD_BACKWARD]
            applied.update(decision.applied_seq)
            pending = list(decision.pending)
        shapes.append(fb_steps)
        seq["n"] += 2

    def one_by_one() -> None:
        for m in ids:
            fb, opt = requests(m)
            plan = BatchPlan((Step(StepKind.FORWARD_BACKWARD, (fb,)), Step(StepKind.OPTIM_STEP, (opt,))))
            outcomes = alone_exec.execute(plan)
            assert all(o.ok for o in outcomes), [o.error for o in outcomes if not o.ok]
            applied[m] = seq["n"] + 1
        seq["n"] += 2

    times: dict[str, list[float]] = {"cost_model": [], "one_by_one": []}
    variants = (("cost_model", by_cost_model), ("one_by_one", one_by_one))
    for _ in range(args.warmup):
        for _, run in variants:
            run()
    shapes.clear()
    for k in range(args.rounds):
        for name, run in variants if k % 2 == 0 else variants[::-1]:  # ABBA: neither always goes first
            sync()
            t0 = time.perf_counter()
            run()
            sync()
            times[name].append(time.perf_counter() - t0)
    tokens = args.adapters * per_adapter * args.seq_len
    med = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "rounds": args.rounds,
        "round_s": times,
        "median_round_s": med,
        "tok_s": {name: tokens / m for name, m in med.items()},
        "cost_model_over_one_by_one": med["one_by_one"] / med["cost_model"],  # target >= 1.00 saturated
        "adapters_per_fb_step": [statistics.mean(s) for s in shapes],
        "fitted_cost": vars(cost.params) | {"observations": cost.observations},
    }
    for m in ids:
        engine.delete_adapter(m)
    return result


def bench_long(engine: Engine, args) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """--mode long: one sequence of each --long-lengths tokens, one forward_backward, with the layers' activations kept
    (recompute "never") and recomputed ("always"): seconds, tokens/s and peak GB, or "out of memory"."""
    from loraplex.workers.engine.recompute import RecomputePolicy

    engine.create_adapter("long", rank=args.rank, alpha=2 * args.rank, seed=0)
    engine.microbatch_tokens = max(engine.microbatch_tokens, max(int(n) for n in args.long_lengths.split(",")))
    out: dict[str, Any] = {}
    for mode in ("never", "always"):
        engine.recompute = RecomputePolicy(mode)
        for n in (int(x) for x in args.long_lengths.split(",")):
            data = datums(engine.vocab_size, 1, n, torch.Generator().manual_seed(n))
            peak_reset()
            try:
                times = []
                for _ in range(2):  # the first also warms the allocator
                    sync()
                    t0 = time.perf_counter()
                    engine.forward_backward([engine.prepare("long", data, "cross_entropy", None, False)])
                    sync()
                    times.append(time.perf_counter() - t0)
                engine.optim_step([("long", {"learning_rate": 1e-6})])
                row: dict[str, Any] = {"s": times[-1], "tok_s": n / times[-1],
                                       "peak_gb": torch.cuda.max_memory_allocated() / 2**30}  # fmt: skip
            except torch.OutOfMemoryError:
                row = {"out_of_memory": True}
            out[f"{mode} {n}"] = row
            print("long", mode, n, row, flush=True)
    engine.delete_adapter("long")
    return out


# ---- ragged lengths vs uniform rows, packed and padded ------------------------------------------------------------
def datums_of(vocab: int, lengths: list[int], gen: torch.Generator) -> list[DatumPayload]:
    return [d for n in lengths for d in datums(vocab, 1, n, gen)]


def bench_ragged(engine: Engine, args: argparse.Namespace) -> dict[str, Any]:
    """Real-token throughput of ragged lengths against uniform --seq-len rows holding the same real tokens: per step,
    --adapters adapters x (--saturated-seqs x --seq-len) tokens each, one mixed forward_backward + one batched AdamW.
    For each layout in --layouts (packed: the engine's default; padded: EngineConfig(packed=False)), both workloads are timed
    in this one call (medians of --iters steps after --warmup); tok_s counts real tokens only."""
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(5)
    per_adapter = args.saturated_seqs * args.seq_len
    ids = [f"ragged{i}" for i in range(args.adapters)]
    for i, m in enumerate(ids):
        engine.create_adapter(m, rank=args.rank, alpha=2 * args.rank, seed=200 + i)
    lengths = {
        "uniform": {m: [args.seq_len] * args.saturated_seqs for m in ids},
        "ragged": {m: lognormal_lengths(rng, per_adapter, args.ragged_median, args.ragged_sigma, args.ragged_min,
                                        args.ragged_max) for m in ids},  # fmt: skip
    }
    data = {w: {m: datums_of(engine.vocab_size, ls[m], gen) for m in ids} for w, ls in lengths.items()}
    adam = {"learning_rate": 1e-5, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
    tokens = args.adapters * per_adapter
    all_ragged = [n for m in ids for n in lengths["ragged"][m]]
    out: dict[str, Any] = {
        "tokens_per_step": tokens,
        "ragged_lengths": {"count": len(all_ragged), "min": min(all_ragged), "median": statistics.median(all_ragged),
                           "mean": statistics.mean(all_ragged), "max": max(all_ragged)},
    }  # fmt: skip
    for layout_name in args.layouts.split(","):
        engine.packed = {"packed": True, "padded": False}[layout_name]
        per_layout: dict[str, Any] = {}
        for workload in ("uniform", "ragged"):
            prepared = [engine.prepare(m, data[workload][m], "cross_entropy", None, False) for m in ids]
            seqs = layout(prepared)
            mbs = split_microbatches(seqs, engine.microbatch_tokens, engine.packed)
            rows = sum(len(mb) * max(s.length for s in mb) for mb in mbs)  # what the device runs through the layers
            phase: dict[str, list[float]] = {"fwd_bwd": [], "optim": []}

            def step(prepared: list[Any] = prepared, phase: dict[str, list[float]] = phase) -> None:
                t0 = time.perf_counter()
                engine.forward_backward(prepared)
                sync()
                t1 = time.perf_counter()
                results = engine.optim_step([(m, adam) for m in ids])
                sync()
                assert all(isinstance(r, dict) for r in results), results
                phase["fwd_bwd"].append(t1 - t0)
                phase["optim"].append(time.perf_counter() - t1)

            peak_reset()
            times = timed(step, args.iters, args.warmup)
            per_layout[workload] = {
                "step_s": statistics.median(times),
                "tok_s": tokens / statistics.median(times),
                "fwd_bwd_s": statistics.median(phase["fwd_bwd"][args.warmup :]),
                "optim_s": statistics.median(phase["optim"][args.warmup :]),
                "microbatches": len(mbs),
                "device_tokens": rows if not engine.packed else tokens,  # padded: count x longest per microbatch
                "peak_gb": peak_gb(),
            }
            print("ragged", layout_name, workload, per_layout[workload], flush=True)
        per_layout["ragged_over_uniform"] = per_layout["ragged"]["tok_s"] / per_layout["uniform"]["tok_s"]  # >= 0.95
        out[layout_name] = per_layout
    if "packed" in out and "padded" in out:
        out["packed_over_padded"] = {
            w: out["packed"][w]["tok_s"] / out["padded"][w]["tok_s"] for w in ("uniform", "ragged")
        }
    engine.packed = True
    for m in ids:
        engine.delete_adapter(m)
    return out


def lora_ops() -> dict[str, Any]:
    from loraplex.workers import lora

    ops = {"reference": lora.lora_delta_reference}
    grouped = getattr(lora, "lora_delta_grouped", None)
    if grouped is not None:
        ops["grouped"] = grouped
    return ops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3-4b-shape")
    p.add_argument("--cache", default=".loraplex/models", help="model cache (only for non-shape models)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--cap", type=int, default=4096, help="microbatch token cap")
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--slots", type=int, default=0,
                   help="engine slots (0: max(8, adapters)); an MoE's expert banks are large (Qwen3-30B-A3B at rank 16: "
                        "3.3 GB per slot, x4 with gradients and Adam moments)")  # fmt: skip
    p.add_argument("--saturated-seqs", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--ops", default="auto", help="comma list of LoRA paths to compare: auto (fused),reference,grouped")
    p.add_argument("--skip-peft", action="store_true")
    p.add_argument("--skip-frozen", action="store_true", help="no frozen-base rows (a big MoE's take minutes)")
    p.add_argument("--workloads", default="underfilled,saturated,lone,one_adapter",
                   help="comma list of the engine rows to time: underfilled,saturated (each mixed and one by one), "
                        "lone (1x512), one_adapter (one adapter, --saturated-seqs x --seq-len)")  # fmt: skip
    p.add_argument("--elementwise", default="on",
                   help="comma list: on (Triton RMSNorm / RoPE / MLP activation on CUDA, the engine's default), off (HF's eager modules)")  # fmt: skip
    p.add_argument("--graphs", default="on",
                   help="comma list: on (the body of training microbatches as CUDA graphs, the engine's default), off (eager)")  # fmt: skip
    p.add_argument("--head", default="fused",
                   help="comma list: fused (the LM head's log-softmax as Triton kernels, the engine's default on CUDA), eager (chunked torch)")  # fmt: skip
    p.add_argument("--siblings", default="auto",
                   help="comma list: on (q/k/v and gate/up LoRA as one node sharing the A product), off (each layer alone), auto (the engine's default)")  # fmt: skip
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--long-lengths", default="8192,16384,32768,65536", help="--mode long: single-sequence lengths")
    p.add_argument("--mode", default="all", choices=("all", "cost", "long", "ragged"),
                   help="all: PEFT, frozen base, single vs concurrent; cost: only the cost-model coalescing vs one by "
                        "one comparison; long: the longest single sequence, layers recomputed or not; "
                        "ragged: ragged lengths vs uniform rows, packed and padded")  # fmt: skip
    p.add_argument("--rounds", type=int, default=8, help="--mode cost: timed rounds per variant (median)")
    p.add_argument("--cost-workloads", default="saturated", help="--mode cost: saturated,underfilled")
    p.add_argument("--plan-tokens", type=int, default=16384, help="--mode cost: the policy's token cap per step")
    p.add_argument("--layouts", default="packed,padded", help="--mode ragged: packed,padded (the engine's layouts)")
    p.add_argument("--ragged-median", type=float, default=256.0, help="--mode ragged: lognormal median length")
    p.add_argument("--ragged-sigma", type=float, default=1.0, help="--mode ragged: lognormal sigma")
    p.add_argument("--ragged-min", type=int, default=32, help="--mode ragged: shortest datum")
    p.add_argument("--ragged-max", type=int, default=2048, help="--mode ragged: longest datum")
    p.add_argument("--seed", type=int, default=0, help="--mode ragged: the lengths' seed")
    args = p.parse_args()

    torch.manual_seed(0)
    env = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "model": args.model,
        "dtype": args.dtype,
        "rank": args.rank,
        "seq_len": args.seq_len,
        "cap": args.cap,
        "adapters": args.adapters,
        "date": time.strftime("%Y-%m-%d"),
    }
    results: dict[str, Any] = {"env": env}
    if args.mode in ("cost", "long", "ragged"):
        model = build_model(args)
        config = EngineConfig(num_slots=args.slots or max(8, args.adapters), max_rank=args.rank, target_modules=TARGETS,
                              microbatch_tokens=args.cap)  # fmt: skip
        engine = build_engine(model, config, args.device)
        if args.mode == "cost":
            results["cost_model_vs_one_by_one"] = bench_cost_model(engine, args)
        elif args.mode == "long":
            results["long_sequences"] = bench_long(engine, args)
        else:
            results["ragged_vs_uniform"] = bench_ragged(engine, args)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2))
        print(json.dumps(results, indent=2))
        return
    saturated_tokens = args.saturated_seqs * args.seq_len
    if not args.skip_peft:
        results["peft_single"] = bench_peft(args, saturated_tokens)
        peak_reset()
        print("peft", results["peft_single"], flush=True)

    model = build_model(args)
    model.requires_grad_(False)  # the frozen base: activation gradients only, no weight gradients (as under LoRA)
    if not args.skip_frozen:
        results["frozen_base"] = bench_frozen_base(model, args, saturated_tokens)
        print("frozen base", results["frozen_base"], flush=True)
        if "on" in args.elementwise.split(",") and kernels_module.available():
            kernels_module.install(model)
            results["frozen_base_fused"] = bench_frozen_base(model, args, saturated_tokens, fused=True)
            print("frozen base, the engine's kernels", results["frozen_base_fused"], flush=True)
            if torch.cuda.is_available():
                results["frozen_base_graphed"] = bench_frozen_base_graphed(model, args, saturated_tokens)
                print("frozen base, the engine's kernels, one CUDA graph", results["frozen_base_graphed"], flush=True)
    config = EngineConfig(num_slots=args.slots or max(8, args.adapters), max_rank=args.rank, target_modules=TARGETS,
                          microbatch_tokens=args.cap, fused_elementwise="on" in args.elementwise.split(","),
                          cuda_graphs="on" in args.graphs.split(","))  # fmt: skip
    engine = build_engine(model, config, args.device)
    for i in range(args.adapters):
        engine.create_adapter(f"a{i}", rank=args.rank, alpha=2 * args.rank, seed=i)
    default_op = next(iter(engine.banks.values())).op
    variants = [(o, e, g, h, s) for s in args.siblings.split(",") for h in args.head.split(",")
                for g in args.graphs.split(",") for e in args.elementwise.split(",") for o in args.ops.split(",")]  # fmt: skip
    for op_name, fused_elementwise, graphs, head, siblings in variants:
        if siblings != "auto":
            engine.shared_lora_inputs = siblings == "on"
        engine.fused_head = head == "fused"
        engine.fused_elementwise = fused_elementwise == "on" and bool(engine.fused_modules)  # installed when asked
        engine.cuda_graphs = graphs == "on" and engine.graphs is not None
        # auto: the engine's default (the fused per-microbatch path); a named op: that op per layer, unfused.
        op = default_op if op_name == "auto" else lora_ops()[op_name]
        engine.fused_lora = op_name == "auto"
        for bank in engine.banks.values():
            bank.op = op
        results.setdefault("ops", {})[op_name] = "fused" if engine.fused_lora else getattr(op, "__name__", str(op))
        ids = [f"a{i}" for i in range(args.adapters)]
        per_op: dict[str, Any] = {}
        wanted = set(args.workloads.split(","))
        line = []
        for workload, per_adapter in (("underfilled", 1), ("saturated", args.saturated_seqs)):
            if workload not in wanted:
                continue
            single = bench_engine_workload(engine, ids, per_adapter, args, concurrent=False)
            mixed = bench_engine_workload(engine, ids, per_adapter, args, concurrent=True)
            per_op[workload] = w = {"single": single, "concurrent": mixed, "ratio": mixed["tok_s"] / single["tok_s"]}
            line.append(f"{workload} {mixed['tok_s']:,.0f} / {single['tok_s']:,.0f} tok/s ({w['ratio']:.3f}x)")
        if "lone" in wanted:
            per_op["lone_1x512"] = lone = bench_engine_workload(engine, ids[:1], 1, args, concurrent=True)
            line.append(f"lone 1x{args.seq_len} {1e3 * lone['step_s']:.1f} ms")
        if "one_adapter" in wanted:
            per_op["one_adapter_8x512"] = one = bench_engine_workload(engine, ids[:1], args.saturated_seqs, args,
                                                                      concurrent=True)  # fmt: skip
            line.append(f"one adapter {args.saturated_seqs}x{args.seq_len} {one['tok_s']:,.0f} tok/s")
        if engine.graphs is not None:
            per_op["graphs"] = {"captures": engine.graphs.captures, "replays": engine.graphs.replays}
        # a row's own peak, or its mixed and one-by-one runs'
        peaks = [r["peak_gb"] for w in per_op.values() for r in (w, *w.values()) if isinstance(r, dict) and "peak_gb" in r]
        print(f"{op_name} elementwise {fused_elementwise} graphs {graphs} head {head} siblings {siblings}: "
              f"{', '.join(line)}, peak {max(peaks, default=0.0):.1f} GB, {per_op.get('graphs')}", flush=True)  # fmt: skip
        suffix = ("" if fused_elementwise == "off" else "_triton_elementwise") + ("" if graphs == "off" else "_graphs")
        suffix += ("" if head == "eager" else "_fused_head") + {"auto": "", "on": "_sibling_nodes", "off": "_layers_alone"}[siblings]
        results[f"engine_{op_name}" + suffix] = per_op
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
