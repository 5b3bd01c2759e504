"""Native sampler benchmark: decode throughput of workers/sampling/sampler.py on a random-init Qwen3-shaped
model, and HF `generate` with PEFT on the same work, in one process:

    python3 benchmarks/bench_sampler.py --model qwen3-4b-shape --rank 32 --prompts 32 --prompt-len 128 --new 128

Variants (each: `--prompts` prompts of `--prompt-len` random tokens, `--new` new tokens each, sampled at temperature 1
with a seed and no EOS stop, so every row runs to full length): base model only; one adapter; 4 adapters mixed in one
batch (prompts split evenly); the same 4 adapters one after another; HF + PEFT `generate` (one adapter, greedy with
no EOS, batched). Each variant runs once untimed first (a new decode shape captures its CUDA graph then), and the
base and mixed variants also run with `cuda_graphs=False` (the same decoder, eager) for comparison. Also: the time to
take a sampler copy of a rank-`--rank` adapter on the training path (AdapterStore.freeze_copy: into a free slot,
device to device; and with every slot taken, to host memory), and a greedy agreement check of our sampler with HF + PEFT on
the same adapter (first 4 prompts, 16 tokens). Needs only torch, transformers, peft and loraplex (the GPU image)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_engine import TARGETS, build_model, sync  # noqa: E402
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.engine import Engine  # noqa: E402
from loraplex.workers.sampling.jobs import SampleJob, SampleParams  # noqa: E402
from loraplex.workers.sampling.sampler import Sampler  # noqa: E402
from loraplex.workers.state.adapter_store import AdapterStore  # noqa: E402


def give_b_weights(engine: Engine, model_id: str, seed: int) -> None:
    """A trained-looking adapter: B random (a fresh one is zero, which would make every adapter the base model)."""
    record = engine.adapter(model_id)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for bank in engine.banks.values():
            b = bank.lora_B[record.slot, : record.rank]
            b.copy_((torch.randn(b.shape, generator=gen) * 0.02).to(b.device, b.dtype))


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    cuda = torch.cuda.is_available()
    p.add_argument("--model", default="qwen3-4b-shape" if cuda else "tiny")
    p.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "loraplex-models"))
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--dtype", default="bfloat16" if cuda else "float32")
    p.add_argument("--rank", type=int, default=32 if cuda else 8)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--breakdown", action="store_true", help="time the decode step's parts and profile its kernels")
    p.add_argument("--kv", default="dense,paged", help="KV caches to run the variants on: dense, paged or both")
    p.add_argument("--variants", default="all", help="comma-separated variant names (default all)")
    p.add_argument("--samples", type=int, default=16, help="samples per prompt of the shared_prompts variant")
    p.add_argument("--skip-copies", action="store_true", help="skip the sampler-copy timings")
    p.add_argument("--expand-kernel", action="store_true", help="the LoRA expand's Triton kernel in the decode step")
    p.add_argument("--out")
    args = p.parse_args()

    model = build_model(args)
    vocab = model.config.vocab_size
    engine = build_engine(model, EngineConfig(num_slots=8, max_rank=args.rank, target_modules=TARGETS), args.device)
    ids = [f"a{i}" for i in range(4)]
    for i, model_id in enumerate(ids):
        engine.create_adapter(model_id, rank=args.rank, alpha=2 * args.rank, seed=i)
        give_b_weights(engine, model_id, seed=100 + i)
    gen = torch.Generator().manual_seed(0)
    prompts = [tuple(torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist()) for _ in range(args.prompts)]
    params = SampleParams(max_tokens=args.new, temperature=1.0, seed=7)
    new_tokens = args.prompts * args.new
    results: dict[str, Any] = {"args": vars(args), "gpu": torch.cuda.get_device_name() if cuda else "cpu"}
    per = args.prompts // 4
    wanted = set(args.variants.split(","))
    sampler = None
    for kv in args.kv.split(","):
        paged = kv == "paged"
        kernel = args.expand_kernel
        sampler = Sampler(
            engine, tokenizer=None, max_rows=args.prompts, eos_token_ids=(), paged_kv=paged, expand_kernel=kernel
        )
        eager = Sampler(
            engine, tokenizer=None, max_rows=args.prompts, eos_token_ids=(), cuda_graphs=False, paged_kv=paged,
            expand_kernel=kernel,
        )  # fmt: skip

        def run(assignments: list[str | None], by: Sampler = sampler) -> None:
            outs = by.generate([SampleJob(pr, m, params) for pr, m in zip(prompts, assignments, strict=False)])
            assert len(outs) == len(assignments) and all(len(o.sequences[0].tokens) == args.new for o in outs)

        def shared(by: Sampler = sampler) -> None:
            """--prompts rows as prompts / samples jobs of `samples` samples each (4 adapters): each job's prompt
            prefilled once and, paged, held once for its samples."""
            groups = max(1, args.prompts // args.samples)
            jobs = [
                SampleJob(prompts[j], ids[j % 4], params, num_samples=min(args.samples, args.prompts))
                for j in range(groups)
            ]
            outs = by.generate(jobs)
            assert all(len(s.tokens) == args.new for o in outs for s in o.sequences)

        variants = {
            "base_only": lambda run=run: run([None] * args.prompts),
            "one_adapter": lambda run=run: run(["a0"] * args.prompts),
            "four_mixed": lambda run=run: run([ids[i // per] for i in range(args.prompts)]),
            "four_one_after_another": lambda sampler=sampler: [
                sampler.generate([SampleJob(pr, ids[k], params) for pr in prompts[k * per : (k + 1) * per]])
                for k in range(4)
            ],
            "shared_prompts": shared,
            "base_only_eager": lambda run=run, eager=eager: run([None] * args.prompts, eager),
            "four_mixed_eager": lambda run=run, eager=eager: run([ids[i // per] for i in range(args.prompts)], eager),
        }
        for name, fn in variants.items():
            if name not in wanted and "all" not in wanted:
                continue
            warm = time.perf_counter()
            fn()  # a new shape captures its graph here (and kernels, the allocator warm up)
            first_s = time.perf_counter() - warm
            seconds = timed(fn, args.repeats)
            key = f"{kv}:{name}"
            results[key] = {"s": seconds, "tok_s": new_tokens / seconds, "first_call_s": first_s}
            print(key, results[key], flush=True)
        del eager
        ratios = {
            "mixed_over_base": ("four_mixed", "base_only"),
            "mixed_over_sequential": ("four_mixed", "four_one_after_another"),
            "shared_over_unshared": ("shared_prompts", "four_mixed"),
            "graph_over_eager_base": ("base_only", "base_only_eager"),
            "graph_over_eager_mixed": ("four_mixed", "four_mixed_eager"),
        }
        for ratio, (a, b) in ratios.items():
            if f"{kv}:{a}" in results and f"{kv}:{b}" in results:
                results[f"{kv}:{ratio}"] = results[f"{kv}:{a}"]["tok_s"] / results[f"{kv}:{b}"]["tok_s"]
    assert sampler is not None
    if not args.skip_copies:
        copy_timings(engine, args, results)
    if args.breakdown:
        for kv in args.kv.split(","):
            results[f"{kv}:breakdown"] = breakdown(engine, ids, prompts, params, kv == "paged", args.expand_kernel)
    if not args.skip_hf:
        results.update(hf_peft(args, engine, prompts, new_tokens))
        one = f"{args.kv.split(',')[-1]}:one_adapter"
        if "hf_peft" in results and one in results:
            results["ours_over_hf_peft"] = results[one]["tok_s"] / results["hf_peft"]["tok_s"]
    print(json.dumps({k: v for k, v in results.items() if k != "args"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


def copy_timings(engine: Engine, args: argparse.Namespace, results: dict[str, Any]) -> None:
    """A sampler copy on the training path: the adapter's weights into a free slot, or to (pinned) host memory."""
    store = AdapterStore(engine, 1 << 40, Path(tempfile.mkdtemp(prefix="bench-sampler-spill-")))
    results["sampler_copy_ms"] = time_copies(store, "s", 10)
    print("sampler copy (free slot, device to device)", results["sampler_copy_ms"], flush=True)
    for k in range(4, engine.num_slots):  # every slot taken: the copy goes to host memory
        store.create(f"a{k}", rank=args.rank, alpha=2 * args.rank, seed=k)
    results["sampler_copy_host_ms"] = time_copies(store, "h", 6)
    print("sampler copy (no free slot, to host)", results["sampler_copy_host_ms"], flush=True)
    for k in range(4, engine.num_slots):
        store.delete(f"a{k}")
    results["save_for_sampler_ms"] = save_for_sampler(engine, store)
    print("save_weights_for_sampler", results["save_for_sampler_ms"], flush=True)


def time_copies(store: AdapterStore, tag: str, repeats: int) -> dict[str, float]:
    """freeze_copy of a1 `repeats` times (each deleted after): median and max ms, the first two left out (warm-up)."""
    times = []
    for k in range(repeats):
        sync()
        t0 = time.perf_counter()
        store.freeze_copy("a1", f"tinker://a1/sampler_weights/{tag}{k}")
        sync()
        times.append(time.perf_counter() - t0)
        store.delete(f"tinker://a1/sampler_weights/{tag}{k}")
    return {"median": 1e3 * statistics.median(times[2:]), "max": 1e3 * max(times[2:])}


def save_for_sampler(engine: Engine, store: AdapterStore) -> dict[str, float]:
    """A whole save_weights_for_sampler plan as the pool runs it (PlanExecutor with background writes): the plan's
    time on the training path (host time and the compute stream: the sampler copy and the weights' device copy; the
    device-to-host copy runs on a side stream beside it), and the file write beside it."""
    from loraplex.protocol import BatchPlan, PlannedRequest, RequestKind, Step, StepKind
    from loraplex.runtime.background_writes import BackgroundWrites
    from loraplex.workers.engine.executor import PlanExecutor

    folder = Path(tempfile.mkdtemp(prefix="bench-sampler-save-"))
    writes = BackgroundWrites()
    executor = PlanExecutor(engine, store, writes=writes)
    plan_s, write_s = [], []
    for k in range(6):
        path = f"tinker://a1/sampler_weights/p{k}"
        request = PlannedRequest(f"s{k}", "t", "a1", 1, RequestKind.SAVE_SAMPLER,
                                 {"name": f"p{k}", "path": path, "directory": str(folder / f"p{k}")})  # fmt: skip
        sync()
        t0 = time.perf_counter()
        (outcome,) = executor.execute(BatchPlan((Step(StepKind.CHECKPOINT, (request,)),)))
        if engine.device.type == "cuda":
            torch.cuda.current_stream(engine.device).synchronize()  # the compute stream only: training's
        t1 = time.perf_counter()
        assert outcome.ok, outcome.error
        writes.take(f"s{k}")
        plan_s.append(t1 - t0)
        write_s.append(time.perf_counter() - t1)
        store.delete(path)
    writes.close()
    return {"plan_median": 1e3 * statistics.median(plan_s[2:]), "plan_max": 1e3 * max(plan_s[2:]),
            "file_write_after_median": 1e3 * statistics.median(write_s[2:])}  # fmt: skip


def breakdown(
    engine: Engine,
    ids: list[str],
    prompts: list[tuple[int, ...]],
    params: SampleParams,
    paged: bool,
    expand_kernel: bool = False,
) -> dict[str, Any]:
    """Where a decode step's time goes: a graph replay alone (base / 1 / 4 adapters), choosing the tokens from [B, V]
    logits, one prefill of every prompt; and the CUDA kernels of one eager step (top 12 by device time). Paged: every
    row holds its own prompt's KV (zeros) and each timed step appends one position to every row."""
    from loraplex.workers.sampling.choice import choose_tokens, stream_key
    from loraplex.workers.sampling.static_decoder import StaticDecoder

    rows, out = len(prompts), {}
    prompt_len = len(prompts[0])
    width = 1 << (prompt_len + 200 - 1).bit_length()  # room for every timed step's new position
    tokens = [1] * rows
    with torch.inference_mode():
        for groups in (0, 1, 4):
            decoder = StaticDecoder(engine, rows, width, groups, paged=paged, expand_kernel=expand_kernel)
            decoder.load([engine.adapter(m).slot for m in ids[:groups]])
            positions = [prompt_len] * rows
            if paged:
                c = engine.model.config
                zeros = torch.zeros(decoder.kv_heads, prompt_len, decoder.head_dim, dtype=engine.compute_dtype,
                                    device=engine.device)  # fmt: skip
                kv = [(zeros, zeros)] * c.num_hidden_layers
                assert decoder.cache is not None
                for r in range(rows):
                    slots = decoder.prompt_slots(r, prompts[r])
                    for layer, (k, v) in enumerate(kv):
                        decoder.cache.write(layer, slots, k.transpose(0, 1), v.transpose(0, 1))
                    decoder.set_row(r, None, 0.0, kv, prompt=r, max_new=200)
                    decoder.drop_prompt(r)
            for r in range(rows):
                if groups:
                    decoder.mask[r, (r % groups) * engine.max_rank : (r % groups + 1) * engine.max_rank] = 0.5
                    decoder.adapter_rows.add(r)  # the step runs the LoRA side path

            def step(d: StaticDecoder = decoder, positions: list[int] = positions) -> None:
                d.step(tokens, positions)
                if paged:
                    positions[:] = [p + 1 for p in positions]

            eager = timed(step, 20)
            decoder.enable_graphs()  # the step's bucket is captured at its first step
            replay = timed(step, 50)
            out[f"step_ms_{groups}_adapters"] = {"graph": 1e3 * replay, "eager": 1e3 * eager}
            if groups in (0, 4):
                decoder.use_graphs = False
                cuda = engine.device.type == "cuda"
                kind = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
                with torch.profiler.profile(activities=[kind]) as prof:
                    step()
                    sync()
                table = prof.key_averages().table(
                    sort_by="cuda_time_total" if cuda else "self_cpu_time_total", row_limit=12
                )
                print(f"kernels of one eager step, {groups} adapters, paged={paged}:\n{table}", flush=True)
            del decoder
        logits = torch.randn(rows, engine.vocab_size, device=engine.device)
        streams = [stream_key(7, r) for r in range(rows)]
        out["choose_ms"] = 1e3 * timed(  # what a decode step does: draws on the device, one copy back
            lambda: choose_tokens(
                logits, [1.0] * rows, [-1] * rows, [1.0] * rows, streams=streams, steps=[3] * rows
            ).to_host(),
            20,
        )
        sampler = Sampler(engine, tokenizer=None, max_rows=rows, eos_token_ids=(), paged_kv=paged)
        one = SampleParams(max_tokens=1, temperature=1.0, seed=7)
        out["prefill_and_first_token_ms"] = 1e3 * timed(
            lambda: sampler.generate([SampleJob(pr, None, one) for pr in prompts]), 3
        )
    print("breakdown", "paged" if paged else "dense", out, flush=True)
    return out


def hf_peft(
    args: argparse.Namespace, engine: Engine, prompts: list[tuple[int, ...]], new_tokens: int
) -> dict[str, Any]:
    """HF generate with PEFT holding a0's weights; and greedy agreement with our sampler on 4 prompts."""
    from peft import LoraConfig, get_peft_model

    hf = build_model(args)
    peft_model = get_peft_model(hf, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=list(TARGETS)))
    weights = engine.adapter_weights("a0")
    with torch.no_grad():
        for name, module in peft_model.named_modules():
            if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
                key = next((k for k in weights if name.endswith(k)), None)
                if key is None:
                    continue
                a, b = weights[key]
                module.lora_A["default"].weight.copy_(a.t().to(module.lora_A["default"].weight))
                module.lora_B["default"].weight.copy_(b.t().to(module.lora_B["default"].weight))
    peft_model.eval()
    # No EOS at all (as our runs): min_new_tokens would instead mask EOS out of the greedy choice, a different rule.
    peft_model.generation_config.eos_token_id = None
    batch = torch.tensor(prompts, device=args.device)

    def generate() -> None:
        with torch.inference_mode():
            out = peft_model.generate(input_ids=batch, attention_mask=torch.ones_like(batch), max_new_tokens=args.new,
                                      do_sample=False, pad_token_id=0)  # fmt: skip
        assert out.shape[1] == batch.shape[1] + args.new

    seconds = timed(generate, 1)
    agree_prompts = batch[:4]
    with torch.inference_mode():
        theirs = peft_model.generate(input_ids=agree_prompts, attention_mask=torch.ones_like(agree_prompts),
                                     max_new_tokens=16, do_sample=False, pad_token_id=0)  # fmt: skip
    sampler = Sampler(engine, tokenizer=None, max_rows=4, eos_token_ids=())
    ours = sampler.generate(
        [SampleJob(prompts[i], "a0", SampleParams(max_tokens=16, temperature=0.0)) for i in range(4)]
    )
    agree = [
        sum(int(x == y) for x, y in zip(o.sequences[0].tokens, theirs[i, batch.shape[1] :].tolist(), strict=True)) / 16
        for i, o in enumerate(ours)
    ]
    return {"hf_peft": {"s": seconds, "tok_s": new_tokens / seconds}, "greedy_agreement_with_peft": agree}


if __name__ == "__main__":
    main()
