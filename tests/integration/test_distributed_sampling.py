"""Native sampling on a pool of 2 ranks (FSDP2-sharded base, gloo on CPU) through the pool's own pieces: each rank's
engine and adapter store as the pool process builds them, `native_sampling` on rank 0 and the real follower
(`run_store_follower`) on rank 1, plans through the rank loop. Each rank decodes its share of a run's rows on a whole
copy of the base model (workers/sampling/replica.py) and the outputs meet on rank 0 (workers/ranks/sampling.py).

Compared with the same plans on one process (fp32): two adapters trained a few steps, their sampler copies sampled
greedy and seeded (mixed adapters and base rows, several samples per job, prompt and top-k logprobs), the rows split
across both ranks (one job's samples on both); the run once uninterrupted and once with training plans between its
slices; the sampled logprobs equal a forward of the trainer on the sampled sequence. Also: a "replicate" pool samples
on its engines; a replica refused on one rank turns sampling off on every rank, which stay in step."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from loraplex.pool.process import engine_spec, native_sampling, run_store_follower, store_spec
from loraplex.protocol import BatchPlan, PlannedRequest, RequestKind, Step, StepKind
from loraplex.settings import Settings
from loraplex.workers.engine.executor import PlanExecutor
from loraplex.workers.ranks.distributed import RankGroup, is_sharded
from loraplex.workers.ranks.rank_loop import LeaderExecutor, build_rank_engine, spawn_ranks
from loraplex.workers.ranks.sampling import RankSampler, assign_rows
from loraplex.workers.sampling.jobs import SampleJob, SampleParams
from loraplex.workers.sampling.replica import ReplicaEngine

pytestmark = [pytest.mark.timeout(240)]

WORLD = 2
ADAM = {"learning_rate": 5e-2}
PROMPTS = [[3, 5, 7, 9, 11], [40, 41, 42], [100, 7, 250, 3, 9, 17, 60], [8], [300, 301, 302, 303]]


def _settings(tiny_dir: Path, home: Path) -> Settings:
    return Settings(
        home=home, base_model=str(tiny_dir), model_cache=tiny_dir.parent, dtype="fp32", slots=4, max_rank=8,
        world_size=WORLD, sample_slice_ms=1.0, sampler_max_rows=4, sampler_replica_fraction=0.9,
    )  # fmt: skip


def _req(rid: str, model_id: str, kind: RequestKind, **payload: Any) -> PlannedRequest:
    return PlannedRequest(request_id=rid, tenant_id="t", model_id=model_id, seq_id=0, kind=kind, payload=payload)


def _train_plan(tag: str, lengths: int = 9) -> BatchPlan:
    g = torch.Generator().manual_seed(len(tag) * 31 + sum(map(ord, tag)))
    steps = []
    for m in ("a", "b"):
        ids = torch.randint(0, 512, (lengths + 1,), generator=g).tolist()
        data = [{"model_input": ids[:-1], "loss_fn_inputs": {"target_tokens": ids[1:]}}]
        steps.append(_req(f"{tag}-fb-{m}", m, RequestKind.FORWARD_BACKWARD, data=data, loss_fn="cross_entropy"))
    optim = tuple(_req(f"{tag}-o-{m}", m, RequestKind.OPTIM_STEP, adam_params=ADAM) for m in ("a", "b"))
    return BatchPlan((Step(StepKind.FORWARD_BACKWARD, tuple(steps)), Step(StepKind.OPTIM_STEP, optim)))


def _samples(tag: str, copies: dict[str, str]) -> tuple[PlannedRequest, ...]:
    """Five jobs over two sampler copies and the base model: greedy and seeded, several samples each."""
    specs: list[dict[str, Any]] = [
        {"sampler_copy": copies["a"], "temperature": 0.0, "prompt_logprobs": True},
        {"sampler_copy": copies["b"], "temperature": 1.0, "seed": 7, "num_samples": 5},
        {"sampler_copy": None, "temperature": 0.8, "top_k": 20, "seed": 11, "num_samples": 2},
        {"sampler_copy": copies["a"], "temperature": 1.0, "top_p": 0.9, "seed": 5, "num_samples": 2,
         "topk_sample_logprobs": 2},  # fmt: skip
        {"sampler_copy": copies["b"], "temperature": 0.0, "max_tokens": 6},
    ]
    return tuple(
        _req(f"{tag}-s{i}", "sampler-1", RequestKind.SAMPLE, prompt=PROMPTS[i], **{"max_tokens": 10, "stop_at_eos": False, **spec})
        for i, spec in enumerate(specs)
    )  # fmt: skip


def _sample_until_done(execute: Any, requests: tuple[PlannedRequest, ...], between: Any = None) -> tuple[list, int]:
    """The SAMPLE step again and again (one slice each) until every request is answered; `between(i)` runs training
    plans between slices. Returns (each request's wire result, the slices)."""
    results: dict[str, Any] = {}
    slices = 0
    while len(results) < len(requests):
        slices += 1
        for outcome in execute(BatchPlan((Step(StepKind.SAMPLE, requests),))):
            assert outcome.ok, outcome
            if not outcome.unfinished:
                results[outcome.request_id] = outcome.result.to_wire()  # type: ignore[union-attr]
        if between is not None and len(results) < len(requests):
            between(slices)
    return [results[r.request_id] for r in requests], slices


def _drive(execute: Any, tmp: str) -> dict[str, Any]:
    """The scenario, on one process or as rank 0: what it reports."""
    create = Step(StepKind.CREATE, (_req("ca", "a", RequestKind.CREATE_ADAPTER, rank=4, alpha=8.0, seed=1),
                                    _req("cb", "b", RequestKind.CREATE_ADAPTER, rank=8, alpha=16.0, seed=2)))  # fmt: skip
    assert all(o.ok for o in execute(BatchPlan((create,))))
    for i in range(3):
        assert all(o.ok for o in execute(_train_plan(f"t{i}")))
    copies = {m: f"tinker://{m}/sampler_weights/w1" for m in ("a", "b")}
    saves = tuple(
        _req(f"save-{m}", m, RequestKind.SAVE_SAMPLER, name="w1", path=copies[m], directory=f"{tmp}/w1-{m}")
        for m in ("a", "b")
    )
    assert all(o.ok for o in execute(BatchPlan((Step(StepKind.CHECKPOINT, saves),))))
    whole, whole_slices = _sample_until_done(execute, _samples("whole", copies))
    # The trainer's forward of adapter a (unchanged since its copy was saved) on the greedy sample of job 0.
    tokens = whole[0]["sequences"][0]["tokens"]
    seq = PROMPTS[0] + tokens
    forward = _req("fwd", "a", RequestKind.FORWARD, loss_fn="cross_entropy",
                   data=[{"model_input": seq[:-1], "loss_fn_inputs": {"target_tokens": seq[1:]}}])  # fmt: skip
    (fwd,) = execute(BatchPlan((Step(StepKind.FORWARD_BACKWARD, (forward,)),)))
    assert fwd.ok, fwd
    trained = 0

    def train(i: int) -> None:
        nonlocal trained
        trained += 1
        assert all(o.ok for o in execute(_train_plan(f"between{i}")))

    interleaved, interleaved_slices = _sample_until_done(execute, _samples("inter", copies), train)
    return {
        "whole": whole,
        "interleaved": interleaved,
        "slices": (whole_slices, interleaved_slices),
        "trained_between": trained,
        "forward_logprobs": fwd.result.to_wire()["loss_fn_outputs"][0]["logprobs"],  # type: ignore[union-attr]
    }


def _replica_facts(sampling: Any, engine: Any) -> dict[str, Any]:
    sampler = sampling.sampler
    assert isinstance(sampler, RankSampler) and sampler.engine is engine
    replica = sampler.sampler.engine
    assert isinstance(replica, ReplicaEngine)
    banks = {id(p) for b in engine.banks.values() for p in (b.lora_A, b.lora_B)}
    replica_banks = {id(p) for _, p in replica.model.named_parameters() if id(p) in banks}
    base = {n: (is_sharded(p), tuple(p.shape)) for n, p in replica.model.named_parameters() if id(p) not in banks}
    training = {n: (is_sharded(p), tuple(p.shape)) for n, p in engine.model.named_parameters() if id(p) not in banks}
    return {"shared_banks": replica_banks == banks, "base": base, "training_base": training}


def _scenario(group: RankGroup, settings: Settings, tmp: str, out: str) -> None:
    if not group.is_leader:  # the pool's own follower: its engine, store and sampler as the pool process builds them
        run_store_follower(group, engine_spec(settings), store_spec(settings), settings)
        return
    engine = build_rank_engine(engine_spec(settings), group)
    store = store_spec(settings).build(engine, group.rank)
    sampling = native_sampling(settings, engine, store, group)
    leader = LeaderExecutor(PlanExecutor(engine, store, sampling), group)
    started = time.perf_counter()
    report = _drive(leader.execute, tmp)
    report["seconds"] = time.perf_counter() - started
    if settings.pool_layout == "fsdp":
        report["replica"] = _replica_facts(sampling, engine)
    else:  # every rank holds the base whole already: it samples on its engine itself
        report["decodes_on_its_engine"] = sampling.sampler.sampler.engine is engine
    leader.close()
    torch.save(report, Path(out) / "rank0.pt")


@pytest.fixture(scope="module")
def runs(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The scenario on 2 ranks (spawned) and on one process (here)."""
    out = tmp_path_factory.mktemp("ranks-sampling")
    two = _spawn(_settings(tiny_dir, out / "home2"), out)
    one_settings = _settings(tiny_dir, out / "home1").model_copy(update={"world_size": 1})
    engine = build_rank_engine(engine_spec(one_settings), None)
    store = store_spec(one_settings).build(engine, 0)
    executor = PlanExecutor(engine, store, native_sampling(one_settings, engine, store, None))
    started_one = time.perf_counter()
    one = _drive(executor.execute, str(out / "ckpt1"))
    one["seconds"] = time.perf_counter() - started_one
    return {"two": two, "one": one}


def _spawn(settings: Settings, out: Path) -> dict[str, Any]:
    """The scenario on 2 spawned ranks: rank 0's report."""
    started = time.monotonic()
    context, _ = spawn_ranks(_scenario, (settings, str(out / "ckpt2"), str(out)), world_size=WORLD,
                             ranks=range(WORLD), device="cpu")  # fmt: skip
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() - started > 200:
                raise TimeoutError("the ranks did not finish in 200 s")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
    return torch.load(out / "rank0.pt", weights_only=False)


def _assert_same_samples(got: list[dict[str, Any]], want: list[dict[str, Any]], atol: float = 1e-5) -> None:
    for g, w in zip(got, want, strict=True):
        assert [s["tokens"] for s in g["sequences"]] == [s["tokens"] for s in w["sequences"]]
        assert [s["stop_reason"] for s in g["sequences"]] == [s["stop_reason"] for s in w["sequences"]]
        for gs, ws in zip(g["sequences"], w["sequences"], strict=True):
            torch.testing.assert_close(torch.tensor(gs["logprobs"]), torch.tensor(ws["logprobs"]), atol=atol, rtol=0)
            if ws.get("topk_logprobs"):
                assert [[t for t, _ in pos] for pos in gs["topk_logprobs"]] == [[t for t, _ in pos] for pos in ws["topk_logprobs"]]  # fmt: skip
        if w.get("prompt_logprobs") is not None:
            got_lp = [x for x in g["prompt_logprobs"][1:]]
            torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(w["prompt_logprobs"][1:]), atol=atol, rtol=0)


def test_rows_of_mixed_adapters_are_split_across_both_ranks() -> None:
    """The scenario's run: both ranks decode rows of several copies, and job 1's samples are on both."""
    jobs = [
        SampleJob(tuple(p), m, SampleParams(max_tokens=t), num_samples=n)
        for p, m, n, t in zip(PROMPTS, ["a", "b", None, "a", "b"], [1, 5, 2, 2, 1], [10, 10, 10, 10, 6], strict=True)
    ]
    shares = assign_rows(jobs, WORLD)
    assert all(len({jobs[p.job].model_id for p in share}) >= 2 for share in shares), shares
    assert [{p.job for p in share} for share in shares] == [{0, 1}, {1, 2, 3, 4}], shares


def test_two_ranks_sample_what_one_rank_samples(runs: dict[str, Any]) -> None:
    two, one = runs["two"], runs["one"]
    assert all(s["sequences"] for s in one["whole"])
    assert len({tuple(s["tokens"]) for s in one["whole"][1]["sequences"]}) > 1  # seeded draws differ per sample
    _assert_same_samples(two["whole"], one["whole"])
    assert two["slices"][0] > 3  # the run went over several slices on the ranks too


def test_training_between_slices_changes_nothing_the_ranks_sample(runs: dict[str, Any]) -> None:
    two, one = runs["two"], runs["one"]
    assert two["trained_between"] >= 3
    _assert_same_samples(two["interleaved"], two["whole"])
    _assert_same_samples(two["interleaved"], one["interleaved"])


def test_sampled_logprobs_equal_the_trainers_forward(runs: dict[str, Any]) -> None:
    two = runs["two"]
    sampled = two["whole"][0]["sequences"][0]["logprobs"]
    forward = two["forward_logprobs"][-len(sampled) :]
    torch.testing.assert_close(torch.tensor(sampled), torch.tensor(forward), atol=1e-4, rtol=0)


def test_each_rank_decodes_on_a_whole_copy_sharing_the_training_banks(runs: dict[str, Any]) -> None:
    facts = runs["two"]["replica"]
    assert facts["shared_banks"]  # no copy of the adapters: the replica's LoRA layers read the training banks
    assert facts["base"] and not any(sharded for sharded, _ in facts["base"].values())
    assert all(sharded for sharded, _ in facts["training_base"].values())
    assert {n: s for n, (_, s) in facts["base"].items()} == {n: s for n, (_, s) in facts["training_base"].items()}
    print(f"\nscenario seconds: world 1 {runs['one']['seconds']:.2f}, world 2 {runs['two']['seconds']:.2f}")


def _refusing_scenario(group: RankGroup, settings: Settings, out: str) -> None:
    """Rank 1 has too little memory for its replica (a fraction no copy fits in); rank 0 would have enough."""
    if not group.is_leader:
        tight = settings.model_copy(update={"sampler_replica_fraction": 1e-12})
        run_store_follower(group, engine_spec(tight), store_spec(tight), tight)
        return
    engine = build_rank_engine(engine_spec(settings), group)
    store = store_spec(settings).build(engine, group.rank)
    leader = LeaderExecutor(PlanExecutor(engine, store, native_sampling(settings, engine, store, group)), group)
    create = Step(StepKind.CREATE, (_req("ca", "a", RequestKind.CREATE_ADAPTER, rank=4, alpha=8.0, seed=1),
                                    _req("cb", "b", RequestKind.CREATE_ADAPTER, rank=4, alpha=8.0, seed=2)))  # fmt: skip
    report: dict[str, Any] = {"create": [o.ok for o in leader.execute(BatchPlan((create,)))]}
    sample = _req("s", "sampler-1", RequestKind.SAMPLE, prompt=[3, 4, 5], max_tokens=4, sampler_copy=None)
    report["sample"] = leader.execute(BatchPlan((Step(StepKind.SAMPLE, (sample,)),)))
    report["train"] = [o.ok for o in leader.execute(_train_plan("after"))]  # the ranks are still in step
    leader.close()
    torch.save(report, Path(out) / "refused.pt")


def test_a_replica_refused_on_one_rank_turns_sampling_off_on_every_rank(tiny_dir: Path, tmp_path: Path) -> None:
    settings = _settings(tiny_dir, tmp_path / "home")
    context, _ = spawn_ranks(_refusing_scenario, (settings, str(tmp_path)), world_size=WORLD, ranks=range(WORLD),
                             device="cpu")  # fmt: skip
    started = time.monotonic()
    try:
        while not context.join(timeout=1.0):
            assert time.monotonic() - started < 120, "the ranks did not finish in 120 s"
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
    report = torch.load(tmp_path / "refused.pt", weights_only=False)
    (outcome,) = report["sample"]
    assert not outcome.ok and outcome.error_name == "NotSupportedError", outcome
    assert "LORAPLEX_SAMPLER_REPLICA_FRACTION" in (outcome.error or "")
    assert report["create"] == [True, True] and report["train"] == [True] * 4


def test_a_replicated_pool_samples_on_its_engines_what_one_rank_samples(
    runs: dict[str, Any], tiny_dir: Path, tmp_path: Path
) -> None:
    """pool_layout "replicate": no replica to build, the Sampler runs on each rank's (unsharded) engine."""
    settings = _settings(tiny_dir, tmp_path / "home").model_copy(update={"pool_layout": "replicate"})
    two = _spawn(settings, tmp_path)
    assert two["decodes_on_its_engine"]
    _assert_same_samples(two["whole"], runs["one"]["whole"])
    _assert_same_samples(two["interleaved"], runs["one"]["interleaved"])


def test_an_moe_pool_of_two_ranks_samples_what_one_rank_samples(tiny_moe_dir: Path, tmp_path: Path) -> None:
    """tiny-moe: the replica wraps the experts too (expert LoRA from the training banks)."""
    settings = _settings(tiny_moe_dir, tmp_path / "home2")
    two = _spawn(settings, tmp_path)
    assert two["replica"]["shared_banks"]
    one_settings = _settings(tiny_moe_dir, tmp_path / "home1").model_copy(update={"world_size": 1})
    engine = build_rank_engine(engine_spec(one_settings), None)
    assert any("experts" in name for name in engine.banks)
    store = store_spec(one_settings).build(engine, 0)
    one = _drive(PlanExecutor(engine, store, native_sampling(one_settings, engine, store, None)).execute,
                 str(tmp_path / "ckpt1"))  # fmt: skip
    # The adapters trained on 2 ranks differ from one rank's by the all-reduce's rounding; the routers amplify it.
    _assert_same_samples(two["whole"], one["whole"], atol=1e-4)
    _assert_same_samples(two["interleaved"], one["interleaved"], atol=1e-4)
