"""The native sampler on a mixture-of-experts base (`tiny-moe`: Qwen3-MoE, 4 experts, 2 per token, LoRA on attention
and on every expert's gate / up / down), fp32 CPU: greedy decoding equals transformers + PEFT `generate` on the
exported adapter (and the bare base model); a mixed batch of adapters and base rows gives each row what it gets alone;
sampled logprobs equal the engine's training forward over the sampled sequence; the decode step's batched MoE MLP
(workers/sampling/moe_decode.py) equals its plain reference and the training op (`lora/experts.experts_reference`) on
random inputs, its one-group-at-a-time form too."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel

from loraplex.models import load_base_model
from loraplex.workers.engine.engine import Engine
from loraplex.workers.lora.expert_bank import SlotBankExperts
from loraplex.workers.lora.experts import ExpertBanks, experts_reference
from loraplex.workers.lora.routing import Routing
from loraplex.workers.sampling.jobs import SampleJob, SampleParams
from loraplex.workers.sampling.moe_decode import MoeDecodeMlp, moe_batched, moe_reference, rows_of
from loraplex.workers.sampling.sampler import Sampler
from loraplex.workers.sampling.static_decoder import StaticDecoder
from loraplex.workers.state.checkpoint_state import state_from_engine
from tests.helpers.datums import datums
from tests.helpers.peft import export_peft
from tests.helpers.sampling import assert_mixed_equals_each_alone, assert_same, engine_with_adapters, hf_greedy, prompt

# model_id: (rank, alpha, seed, target_modules); ranks share the rank-8 banks by zero padding.
ADAPTERS: dict[str, tuple[int, float, int, tuple[str, ...] | None]] = {
    "r2": (2, 4.0, 21, None),
    "r8": (8, 16.0, 22, None),
    "experts": (4, 8.0, 23, ("gate_proj", "up_proj", "down_proj")),  # the experts only, no attention LoRA
    "down": (4, 8.0, 24, ("q_proj", "down_proj")),  # one expert projection of three
}
GREEDY = SampleParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def setup(tiny_moe_dir: Path) -> tuple[Engine, Any]:
    """Four adapters whose B is far from zero (each changes the model's tokens), experts included."""
    return engine_with_adapters(tiny_moe_dir, ADAPTERS, num_slots=5, max_rank=8, seed=8)


def forward_logprobs(engine: Engine, model_id: str, tokens: list[int]) -> list[float]:
    """The training forward's logprob of each token given the ones before (tokens[1:])."""
    datum = {"model_input": tokens[:-1], "loss_fn_inputs": {"target_tokens": tokens[1:]}}
    (out,) = engine.forward_backward([engine.prepare(model_id, datums([datum]), "cross_entropy", None, True)])
    return [float(v) for v in out["loss_fn_outputs"][0]["logprobs"]]


# ---- greedy == transformers + PEFT generate (the model's own forward, argmax step by step) --------------------------
@pytest.mark.parametrize("model_id", [None, "r2", "r8", "experts", "down"])
def test_greedy_equals_peft_generate(
    setup: tuple[Engine, Any], tiny_moe_dir: Path, tmp_path: Path, model_id: str | None
) -> None:
    engine, tokenizer = setup
    base, _ = load_base_model(str(tiny_moe_dir), tiny_moe_dir.parent)
    if model_id is None:
        oracle: torch.nn.Module = base.eval()
    else:
        state = state_from_engine(engine, model_id, base_model="tiny-moe", with_optimizer=False)
        folder = export_peft(state, tmp_path / "peft", base_model_path=str(tiny_moe_dir))
        oracle = PeftModel.from_pretrained(base, str(folder)).eval()
    sampler = Sampler(engine, tokenizer)
    prompts = [prompt(1, 5), prompt(2, 17), prompt(3, 1)]
    ours = sampler.generate([SampleJob(p, model_id, GREEDY) for p in prompts])
    for p, out in zip(prompts, ours, strict=True):
        tokens, logprobs = hf_greedy(oracle, p, GREEDY.max_tokens, tokenizer)
        (seq,) = out.sequences
        assert seq.tokens == tokens
        assert max(abs(x - y) for x, y in zip(seq.logprobs, logprobs, strict=True)) <= 1e-4
        if model_id is not None:  # and the training forward's logprobs of the same sequence
            assert max(map(abs, torch.tensor(seq.logprobs) - torch.tensor(
                forward_logprobs(engine, model_id, [*p, *seq.tokens])[len(p) - 1 :]))) <= 1e-5  # fmt: skip
    if model_id is not None:  # the adapter matters: the base model's greedy tokens differ
        bare = sampler.generate([SampleJob(p, None, GREEDY) for p in prompts])
        assert any(b.sequences[0].tokens != o.sequences[0].tokens for b, o in zip(bare, ours, strict=True))


# ---- a mixed batch gives each row what it gets alone ----------------------------------------------------------------
def test_mixed_adapters_and_base_rows_equal_each_alone(setup: tuple[Engine, Any]) -> None:
    engine, tokenizer = setup
    sampler = Sampler(engine, tokenizer, max_rows=16)
    order = ["r8", None, "experts", "r2", None, "down", "r2", "r8", "experts", None, "down"]
    jobs = [SampleJob(prompt(100 + i, 3 + (7 * i) % 13), m, GREEDY) for i, m in enumerate(order)]
    mixed = assert_mixed_equals_each_alone(sampler, jobs)
    paged = Sampler(engine, tokenizer, max_rows=16, paged_kv=True).generate(jobs)  # the paged KV cache: the same
    for a, b in zip(paged, mixed, strict=True):
        assert_same(a.sequences[0], b.sequences[0])
    same = sampler.generate([SampleJob(prompt(7, 6), m, GREEDY) for m in [None, *ADAPTERS]])
    assert len({tuple(out.sequences[0].tokens) for out in same}) == 5  # each adapter (and the base) its own tokens


# ---- sampled logprobs == the trainer's forward ----------------------------------------------------------------------
def test_sampled_logprobs_equal_the_training_forward(setup: tuple[Engine, Any]) -> None:
    """Temperature 1, seeded, several samples per job in one mixed batch with few rows (continuous batching): each
    sampled token's logprob equals the engine's forward over prompt + sample (what an RL loss compares)."""
    engine, tokenizer = setup
    sampler = Sampler(engine, tokenizer, max_rows=4)
    jobs = [
        SampleJob(
            prompt(40 + i, 2 + 5 * i), m, SampleParams(max_tokens=4 + 3 * i, temperature=1.0, seed=i), num_samples=2
        )
        for i, m in enumerate(["r8", "experts", "r2", "down"])
    ]
    outs = sampler.generate(jobs)
    assert sampler.stats.joined_live_batch > 0
    for job, out in zip(jobs, outs, strict=True):
        assert job.model_id is not None
        for seq in out.sequences:
            expected = forward_logprobs(engine, job.model_id, [*job.prompt, *seq.tokens])[len(job.prompt) - 1 :]
            assert len(expected) == len(seq.logprobs)
            assert max(abs(a - b) for a, b in zip(seq.logprobs, expected, strict=True)) <= 1e-5
    assert len({tuple(s.tokens) for out in outs for s in out.sequences}) == 8  # real draws


# ---- the batched MoE MLP == its reference == the training op, on random inputs -------------------------------------
def _mixed_rows(rows: int, groups: list[tuple[int, float]], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A row mask [rows, G * r] as the decoder sets it (row's scale on its group's block) for random rows, some base."""
    g = torch.Generator().manual_seed(seed)
    choice = torch.randint(-1, len(groups), (rows,), generator=g)
    mask = torch.zeros(rows, len(groups), 8)
    for row, c in enumerate(choice.tolist()):
        if c >= 0:
            mask[row, c] = groups[c][1]
    return choice, mask.view(rows, -1)


@pytest.mark.parametrize("layer", [0, 1])
def test_batched_moe_mlp_equals_the_reference_and_the_training_op(setup: tuple[Engine, Any], layer: int) -> None:
    engine, _ = setup
    mlp: Any = engine.body.layers[layer].mlp
    assert isinstance(mlp.experts, SlotBankExperts)
    names = list(ADAPTERS)
    adapters = [engine.adapter(m) for m in names]
    slots = torch.tensor([a.slot for a in adapters])
    moe = MoeDecodeMlp(mlp, lambda x, m: [], lambda x, m: [], len(names), 8, torch.float32, torch.device("cpu"))
    moe.load(slots)
    gen = torch.Generator().manual_seed(layer)
    for rows in (1, 7, 33):
        x = torch.randn(rows, 64, generator=gen)
        choice, mask = _mixed_rows(rows, [(a.rank, a.scale) for a in adapters], seed=rows + 10 * layer)
        row_group, row_scale = rows_of(mask, rows, len(names), 8, x.device)
        with torch.no_grad():
            reference = moe_reference(x, mlp, moe.stacks, row_group, row_scale)
            batched = moe_batched(x, mlp, moe.stacks, row_group, row_scale)
            one_at_a_time = moe_batched(x, mlp, moe.stacks, row_group, row_scale, max_groups=1)
            torch.testing.assert_close(batched, reference, atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(one_at_a_time, reference, atol=1e-6, rtol=1e-5)
            # The training op on the same rows, laid out contiguous per adapter (base rows: a group of scale 0).
            order = torch.argsort(choice, stable=True)
            present = [c for c in range(-1, len(names)) if (choice == c).any()]
            routing = Routing.build(
                [0 if c < 0 else adapters[c].slot for c in present],
                [1 if c < 0 else adapters[c].rank for c in present],
                [0.0 if c < 0 else adapters[c].scale for c in present],
                [int((choice == c).sum()) for c in present],
            )
            _, weights, idx = mlp.gate(x[order])
            banks = mlp.experts.projection_banks()
            pairs = [(banks[n].lora_A, banks[n].lora_B) if n in banks else (None, None)
                     for n in ("gate_proj", "up_proj", "down_proj")]  # fmt: skip
            trained = experts_reference(
                x[order], idx, weights, mlp.experts.base.gate_up_proj, mlp.experts.base.down_proj,
                ExpertBanks(*(t for pair in pairs for t in pair)), routing, mlp.experts.base.act_fn,
            )  # fmt: skip
            torch.testing.assert_close(batched[order], trained, atol=1e-6, rtol=1e-5)
            if (choice >= 0).any():  # the expert LoRA matters on adapter rows
                assert (batched - moe_reference(x, mlp, moe.stacks, row_group, 0 * row_scale)).abs().max() > 1e-3


def test_decode_step_timing_plain_and_batched(setup: tuple[Engine, Any], capsys: pytest.CaptureFixture[str]) -> None:
    """Both forms inside the whole decode step give the same logits; prints the CPU time of one step (eager)."""
    engine, _ = setup
    names = list(ADAPTERS)
    timings = {}
    logits = {}
    for batched in (False, True):
        decoder = StaticDecoder(engine, rows=32, width=64, groups=len(names))
        for moe in decoder.moe:
            assert moe is not None
            moe.batched = batched
        decoder.load([engine.adapter(m).slot for m in names])
        kv = [(torch.zeros(2, 3, 16), torch.zeros(2, 3, 16))] * 2
        for row in range(32):
            group = None if row % 5 == 4 else row % 4
            decoder.set_row(row, group, 0.0 if group is None else engine.adapter(names[group]).scale, kv)
        tokens, positions = [(7 * r) % 500 for r in range(32)], [3] * 32
        with torch.inference_mode():
            logits[batched] = decoder.step(tokens, positions).clone()
            start = time.perf_counter()
            for _ in range(10):
                decoder.step(tokens, positions)
            timings[batched] = (time.perf_counter() - start) / 10
    torch.testing.assert_close(logits[True], logits[False], atol=1e-5, rtol=1e-5)
    with capsys.disabled():
        print(f"\ntiny-moe decode step, 32 rows, 4 adapters + base, CPU eager: plain {timings[False] * 1e3:.2f} ms, "
              f"batched {timings[True] * 1e3:.2f} ms")  # fmt: skip
