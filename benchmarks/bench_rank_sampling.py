"""Sampling on a pool of several ranks against one rank, through the pool's own pieces (engine_spec, store_spec,
native_sampling, the rank loop): each world size trains two adapters a few steps, saves their sampler copies, then
times SAMPLE plans of `--jobs` jobs (two copies and the base model, alternating; `--samples` samples each, a random
`--prompt-len`-token prompt, `--new` new tokens each at temperature 1, seeded, no EOS stop) until every job is answered:

    python3 benchmarks/bench_rank_sampling.py --worlds 1,2 --jobs 16 --samples 4 --new 32 --threads 1

World size 1 runs in this process (no process group, as a pool of one rank); larger ones spawn their ranks (gloo on
the CPU, NCCL on CUDA), the FSDP-sharded base plus a whole copy per rank for sampling (workers/sampling/replica.py).
`--threads`: torch's threads per rank on the CPU (0: torch's default). The tokens of every world size are compared
with the first's (the same seeded jobs give the same tokens whatever the world size)."""

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

from loraplex.pool.process import (  # noqa: E402
    engine_spec,
    model_loader,
    native_sampling,
    run_store_follower,
    store_spec,
)
from loraplex.protocol import BatchPlan, PlannedRequest, RequestKind, Step, StepKind  # noqa: E402
from loraplex.settings import Settings  # noqa: E402
from loraplex.workers.engine.executor import PlanExecutor  # noqa: E402
from loraplex.workers.ranks.distributed import RankGroup  # noqa: E402
from loraplex.workers.ranks.rank_loop import LeaderExecutor, build_rank_engine, spawn_ranks  # noqa: E402


def _req(rid: str, model_id: str, kind: RequestKind, **payload: Any) -> PlannedRequest:
    return PlannedRequest(request_id=rid, tenant_id="t", model_id=model_id, seq_id=0, kind=kind, payload=payload)


def _sample_plan_requests(args: argparse.Namespace, tag: str, copies: list[str | None]) -> tuple[PlannedRequest, ...]:
    g = torch.Generator().manual_seed(1234)
    out = []
    for j in range(args.jobs):
        prompt = torch.randint(10, 500, (args.prompt_len,), generator=g).tolist()
        out.append(_req(f"{tag}-{j}", "sampler-1", RequestKind.SAMPLE, prompt=prompt, sampler_copy=copies[j % 3],
                        num_samples=args.samples, max_tokens=args.new, temperature=1.0, seed=j,
                        stop_at_eos=False))  # fmt: skip
    return tuple(out)


def drive(execute: Any, args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    create = Step(StepKind.CREATE, tuple(_req(f"c{m}", m, RequestKind.CREATE_ADAPTER, rank=8, alpha=16.0, seed=i)
                                          for i, m in enumerate("ab")))  # fmt: skip
    assert all(o.ok for o in execute(BatchPlan((create,))))
    g = torch.Generator().manual_seed(0)
    for step in range(3):  # a few steps at a high rate: the copies are not the base model
        reqs = []
        for m in "ab":
            ids = torch.randint(0, 500, (33,), generator=g).tolist()
            data = [{"model_input": ids[:-1], "loss_fn_inputs": {"target_tokens": ids[1:]}}]
            reqs.append(_req(f"fb{step}{m}", m, RequestKind.FORWARD_BACKWARD, data=data, loss_fn="cross_entropy"))
        opt = tuple(_req(f"o{step}{m}", m, RequestKind.OPTIM_STEP, adam_params={"learning_rate": 0.05}) for m in "ab")
        assert all(o.ok for o in execute(BatchPlan((Step(StepKind.FORWARD_BACKWARD, tuple(reqs)),
                                                    Step(StepKind.OPTIM_STEP, opt)))))  # fmt: skip
    copies = [f"tinker://{m}/sampler_weights/w" for m in "ab"]
    saves = tuple(_req(f"s{m}", m, RequestKind.SAVE_SAMPLER, name="w", path=p, directory=f"{tmp}/{m}")
                  for m, p in zip("ab", copies, strict=True))  # fmt: skip
    assert all(o.ok for o in execute(BatchPlan((Step(StepKind.CHECKPOINT, saves),))))
    seconds, tokens = [], None
    for r in range(args.repeats + 1):  # the first run is a warm-up
        requests = _sample_plan_requests(args, f"r{r}", [copies[0], copies[1], None])
        done: dict[str, Any] = {}
        t0 = time.perf_counter()
        while len(done) < len(requests):
            for o in execute(BatchPlan((Step(StepKind.SAMPLE, requests),))):
                assert o.ok, o
                if not o.unfinished:
                    done[o.request_id] = o.result
        if r:
            seconds.append(time.perf_counter() - t0)
        tokens = [[s.tokens for s in done[q.request_id].sequences] for q in requests]
    return {"seconds": seconds, "tokens": tokens}


def _settings(args: argparse.Namespace, world: int, home: Path) -> Settings:
    return Settings(
        home=home, model_cache=home.parent / "models", base_model=args.model, world_size=world, device=args.device, slots=4, max_rank=8,
        pool_cpu_threads=args.threads, sampler_max_rows=args.rows, sample_slice_ms=args.slice_ms,
        sampler_replica_fraction=0.9,
    )  # fmt: skip


def _rank(group: RankGroup, settings: Settings, args: argparse.Namespace, out: str) -> None:
    if not group.is_leader:
        run_store_follower(group, engine_spec(settings), store_spec(settings), settings)
        return
    engine = build_rank_engine(engine_spec(settings), group)
    store = store_spec(settings).build(engine, 0)
    leader = LeaderExecutor(PlanExecutor(engine, store, native_sampling(settings, engine, store, group)), group)
    report = drive(leader.execute, args, f"{out}/ckpt")
    leader.close()
    Path(out, "report.json").write_text(json.dumps(report))


def run_world(args: argparse.Namespace, world: int, tmp: Path) -> dict[str, Any]:
    home = tmp / f"world{world}"
    settings = _settings(args, world, home)
    model_loader(settings).prepare()  # a folder preset built once, before any rank loads it
    if world == 1:
        engine = build_rank_engine(engine_spec(settings), None)
        store = store_spec(settings).build(engine, 0)
        executor = PlanExecutor(engine, store, native_sampling(settings, engine, store, None))
        return drive(executor.execute, args, str(home / "ckpt"))
    home.mkdir(parents=True)
    context, _ = spawn_ranks(_rank, (settings, args, str(home)), world_size=world, ranks=range(world),
                             device=args.device)  # fmt: skip
    while not context.join(timeout=1.0):
        pass
    return json.loads((home / "report.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worlds", default="1,2")
    p.add_argument("--model", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--jobs", type=int, default=16)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--rows", type=int, default=32, help="rows each rank decodes at once (LORAPLEX_SAMPLER_MAX_ROWS)")
    p.add_argument("--slice-ms", type=float, default=100.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="")
    args = p.parse_args()
    results: dict[str, Any] = {"args": vars(args), "worlds": {}}
    first_tokens = None
    with tempfile.TemporaryDirectory() as tmp:
        for world in [int(w) for w in args.worlds.split(",")]:
            report = run_world(args, world, Path(tmp))
            median = statistics.median(report["seconds"])
            new_tokens = args.jobs * args.samples * args.new
            same = first_tokens is None or report["tokens"] == first_tokens
            first_tokens = first_tokens or report["tokens"]
            results["worlds"][world] = {"median_s": median, "runs_s": report["seconds"],
                                        "new_tok_per_s": new_tokens / median, "same_tokens_as_first": same}  # fmt: skip
            print(f"world {world}: {median * 1000:.0f} ms per run of {args.jobs} jobs x {args.samples} samples x "
                  f"{args.new} new tokens ({new_tokens / median:.0f} new tok/s), runs {[round(s, 3) for s in report['seconds']]}, "
                  f"tokens equal world {args.worlds.split(',')[0]}'s: {same}", flush=True)  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
