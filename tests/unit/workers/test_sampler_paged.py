"""The native sampler's paged decode (Sampler(paged_kv=True), static_decoder.py's paged mode) on the tiny model, fp32
CPU: greedy tokens and logprobs equal the dense path's (which test_sampler.py compares with transformers + PEFT
generate) and transformers + PEFT generate itself, with mixed adapters, base rows and prompts of different lengths;
num_samples rows fork one prompt whose prefill and KV write ran once; continuous batching with few rows; every block is
back in the pool when a run ends or is abandoned."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel

from loraplex.errors import InvalidRequestError
from loraplex.models import load_base_model
from loraplex.workers.engine.engine import Engine
from loraplex.workers.sampling.jobs import SampleJob, SampleParams
from loraplex.workers.sampling.sampler import Sampler
from loraplex.workers.sampling.static_decoder import StaticDecoder
from loraplex.workers.state.checkpoint_state import state_from_engine
from tests.helpers.peft import export_peft
from tests.helpers.sampling import GREEDY, alone, assert_same, hf_greedy, prompt


def decoders(sampler: Sampler) -> list[StaticDecoder]:
    assert sampler._batch is not None and sampler._batch.decoder.paged
    return [sampler._batch.decoder]


def assert_blocks_back(sampler: Sampler) -> None:
    for decoder in decoders(sampler):
        assert decoder.blocks is not None
        assert decoder.blocks.free_blocks == decoder.blocks.num_blocks and decoder.blocks.committed == 0
        assert decoder.blocks.rows() == [] and not decoder.live_rows


def test_paged_greedy_equals_dense_and_peft_generate(
    tiny_sampler_engine: tuple[Engine, Any],
    tiny_dir: Path,
    tmp_path: Path,
) -> None:
    engine, tokenizer = tiny_sampler_engine
    base, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    state = state_from_engine(engine, "r8", base_model="tiny", with_optimizer=False)
    oracle = PeftModel.from_pretrained(base, export_peft(state, tmp_path / "peft", base_model_path=str(tiny_dir)))
    oracle.eval()
    paged = Sampler(engine, tokenizer, paged_kv=True)
    # Prompts shorter than, equal to and longer than a block (16 positions), so rows cross block boundaries.
    prompts = [prompt(1, 5), prompt(2, 17), prompt(3, 1), prompt(4, 16)]
    ours = paged.generate([SampleJob(p, "r8", GREEDY) for p in prompts])
    dense = Sampler(engine, tokenizer).generate([SampleJob(p, "r8", GREEDY) for p in prompts])
    for p, out, ref in zip(prompts, ours, dense, strict=True):
        (seq,) = out.sequences
        assert_same(seq, ref.sequences[0])
        tokens, logprobs = hf_greedy(oracle, p, GREEDY.max_tokens, tokenizer)
        assert seq.tokens == tokens
        assert max(abs(x - y) for x, y in zip(seq.logprobs, logprobs, strict=True)) <= 1e-4
    assert_blocks_back(paged)


def test_paged_mixed_adapters_ragged_prompts_and_forked_samples_equal_dense(
    tiny_sampler_engine: tuple[Engine, Any],
) -> None:
    engine, tokenizer = tiny_sampler_engine
    order = ["r8", None, "r2", "r16", None, "r4", "attn", "r8"]
    seeded = SampleParams(max_tokens=20, temperature=0.9, top_k=40, seed=5)
    jobs = [
        SampleJob(prompt(100 + i, 3 + (7 * i) % 29), m, GREEDY if i % 2 else seeded, num_samples=1 + i % 3)
        for i, m in enumerate(order)
    ]
    dense = Sampler(engine, tokenizer, max_rows=64).generate(jobs)
    paged = Sampler(engine, tokenizer, max_rows=64, paged_kv=True)
    ours = paged.generate(jobs)
    assert paged.stats.prefill_forwards == 1  # every job's prompt prefilled once, however many samples fork it
    for a, b in zip(ours, dense, strict=True):
        assert len(a.sequences) == len(b.sequences)
        for x, y in zip(a.sequences, b.sequences, strict=True):
            assert_same(x, y)
    # Greedy samples forked from one prompt are the same sequence; seeded ones differ from each other.
    assert all(len({tuple(s.tokens) for s in out.sequences}) == 1 for out in ours[1::2])
    assert len({tuple(s.tokens) for s in ours[2].sequences}) == 3
    assert_blocks_back(paged)


def test_paged_forked_samples_share_the_prompt_blocks(tiny_sampler_engine: tuple[Engine, Any]) -> None:
    """While 4 samples of a 40-token prompt decode, the prompt's 2 full blocks are held once (refcount 4), and each
    row copied the shared partial third block on its first write."""
    engine, tokenizer = tiny_sampler_engine
    job = SampleJob(prompt(7, 40), "r4", SampleParams(max_tokens=6, temperature=0.8, seed=3), num_samples=4)
    paged = Sampler(engine, tokenizer, paged_kv=True)
    run = paged.start([job])
    run.advance(0.0)  # the admission and one decode step
    run_state: Any = run._run
    decoder = run_state.decoder
    tables = [decoder.blocks.table(r) for r in sorted(decoder.live_rows)]
    assert len(tables) == 4
    assert len({t[0] for t in tables}) == 1 and len({t[1] for t in tables}) == 1
    assert decoder.blocks.refcount(tables[0][0]) == 4
    assert len({t[2] for t in tables}) == 4  # the partial block: one private copy each
    run.advance(None)
    assert run.done
    dense = Sampler(engine, tokenizer).generate([job])
    for x, y in zip(run.outputs[0].sequences, dense[0].sequences, strict=True):
        assert_same(x, y)
    assert_blocks_back(paged)


def test_paged_continuous_batching_and_abandoned_run_free_every_block(
    tiny_sampler_engine: tuple[Engine, Any],
) -> None:
    engine, tokenizer = tiny_sampler_engine
    models = ["r2", None, "r16", "r4", "attn", "r8"]
    jobs = [
        SampleJob(
            prompt(200 + i, 2 + (11 * i) % 30),
            m,
            SampleParams(max_tokens=3 + (5 * i) % 17, temperature=0.0 if i % 2 else 0.9, seed=1000 + i),
            3,
        )
        for i, m in enumerate(models)
    ]
    small = Sampler(engine, tokenizer, max_rows=4, paged_kv=True)
    few = small.generate(jobs)
    assert small.stats.peak_rows == 4 and small.stats.joined_live_batch > 0
    many = Sampler(engine, tokenizer, max_rows=64).generate(jobs)
    for a, b in zip(few, many, strict=True):
        for x, y in zip(a.sequences, b.sequences, strict=True):
            assert_same(x, y)
    assert_blocks_back(small)
    run = small.start(jobs)
    run.advance(0.0)
    assert not run.done
    run.close()  # abandoned mid-run
    assert_blocks_back(small)


@pytest.mark.parametrize("paged", [False, True])
def test_paged_decoder_refuses_rows_without_a_held_prompt(tiny_sampler_engine: tuple[Engine, Any], paged: bool) -> None:
    engine, _ = tiny_sampler_engine
    decoder = StaticDecoder(engine, rows=2, width=64, groups=0, paged=paged)
    kv = [(torch.zeros(decoder.kv_heads, 3, decoder.head_dim), torch.zeros(decoder.kv_heads, 3, decoder.head_dim))]
    kv = kv * len(decoder.body.layers)
    if paged:
        with pytest.raises(ValueError, match="held prompt"):
            decoder.set_row(0, None, 0.0, kv)
    else:
        decoder.set_row(0, None, 0.0, kv)  # the dense cache takes the KV itself


def test_paged_packed_prefill_gives_the_dense_prefills_prompt_logprobs(tiny_sampler_engine: tuple[Engine, Any]) -> None:
    """The paged prefill packs prompts of different lengths and adapters into one row without padding; each prompt's
    logprobs (and top-k) and first tokens equal the dense path's right-padded prefill."""
    engine, tokenizer = tiny_sampler_engine
    jobs = [
        SampleJob(prompt(300 + i, n), m, GREEDY, prompt_logprobs=True, topk_prompt_logprobs=3)
        for i, (n, m) in enumerate([(2, "r8"), (19, None), (33, "r4"), (5, "r8"), (16, "attn")])
    ]
    dense = Sampler(engine, tokenizer).generate(jobs)
    paged = Sampler(engine, tokenizer, paged_kv=True)
    ours = paged.generate(jobs)
    assert paged.stats.prefill_forwards == 1
    for a, b in zip(ours, dense, strict=True):
        assert a.prompt_logprobs is not None and b.prompt_logprobs is not None
        assert a.prompt_logprobs[0] is None
        torch.testing.assert_close(torch.tensor(a.prompt_logprobs[1:]), torch.tensor(b.prompt_logprobs[1:]))
        assert a.topk_prompt_logprobs is not None and b.topk_prompt_logprobs is not None
        for x, y in zip(a.topk_prompt_logprobs[1:], b.topk_prompt_logprobs[1:], strict=True):
            assert x is not None and y is not None
            assert [t for t, _ in x] == [t for t, _ in y]
        assert_same(a.sequences[0], b.sequences[0])
    assert_blocks_back(paged)


def test_runs_started_apart_decode_in_one_batch_and_each_gets_what_it_gets_alone(
    tiny_sampler_engine: tuple[Engine, Any],
) -> None:
    """Two runs of different adapters, the second started while the first is mid-decode: the second's rows join the
    first's decode batch (one step serves both), each run's samples equal the same jobs run alone, and every block
    and LoRA group is back once both have ended."""
    engine, tokenizer = tiny_sampler_engine
    seeded = SampleParams(max_tokens=12, temperature=0.9, seed=11)
    first = [SampleJob(prompt(400 + i, 5 + 3 * i), m, seeded, num_samples=2) for i, m in enumerate(["r8", None])]
    second = [SampleJob(prompt(500 + i, 9 + i), m, GREEDY) for i, m in enumerate(["r4", "attn", "r4"])]
    sampler = Sampler(engine, tokenizer, max_rows=16)
    a = sampler.start(first)
    assert not a.advance(0.0)  # one admission and one decode step
    b = sampler.start(second)
    assert b.advance(None)  # to its end; a's rows decode beside it
    assert b.stats.joined_live_batch == 3 and a.stats.decode_steps > 1
    assert a.advance(None)
    for jobs, run in ((first, a), (second, b)):
        for job, out in zip(jobs, run.outputs, strict=True):
            alone = Sampler(engine, tokenizer).generate([job])[0]
            for x, y in zip(out.sequences, alone.sequences, strict=True):
                assert_same(x, y)
    assert_blocks_back(sampler)
    batch = sampler._batch
    assert batch is not None and not batch.runs and len(batch.free_groups) == sampler.max_groups


def test_a_block_budget_smaller_than_the_rows_need_makes_samples_wait_not_fail(
    tiny_sampler_engine: tuple[Engine, Any],
) -> None:
    """With KV blocks for only a few rows at a time, samples wait for blocks as they wait for rows: every sample
    completes and equals the unconstrained run's, and all blocks are back. A sample that could never fit fails with
    a typed error naming the blocks it needs before it starts, and the sampler serves the next call."""
    engine, tokenizer = tiny_sampler_engine
    seeded = SampleParams(max_tokens=20, temperature=0.8, seed=3)
    jobs = [SampleJob(prompt(600 + i, 10 + i), m, seeded, num_samples=3) for i, m in enumerate(["r8", None, "r4"])]
    free = Sampler(engine, tokenizer, max_rows=16).generate(jobs)
    # 8 blocks of 16 positions: one job's holder (1 block) and its rows (2 blocks each at most) at a time
    tight = Sampler(engine, tokenizer, max_rows=16, kv_blocks=8)
    outs = tight.generate(jobs)
    assert tight.stats.peak_rows < 9  # never all 9 rows at once: the blocks held them back
    for a, b in zip(outs, free, strict=True):
        for x, y in zip(a.sequences, b.sequences, strict=True):
            assert_same(x, y)
    assert_blocks_back(tight)
    with pytest.raises(InvalidRequestError, match="needs 14 KV blocks .* has 8"):  # checked before it starts
        tight.generate([SampleJob(prompt(700, 100), None, SampleParams(max_tokens=100, temperature=0.0))])
    assert_blocks_back(tight)
    again = tight.generate(jobs[:1])
    for x, y in zip(again[0].sequences, free[0].sequences, strict=True):
        assert_same(x, y)


def test_new_rows_take_the_lowest_free_rows_so_small_runs_step_few_rows(
    tiny_sampler_engine: tuple[Engine, Any],
) -> None:
    """After a run of 12 rows ends, a run of 3 takes rows 0-2 (not the last rows freed), so its steps run 3 rows."""
    engine, tokenizer = tiny_sampler_engine
    sampler = Sampler(engine, tokenizer, max_rows=16)
    sampler.generate([SampleJob(prompt(800 + i, 6), None, GREEDY) for i in range(12)])
    run = sampler.start([SampleJob(prompt(900 + i, 6), "r4", GREEDY) for i in range(3)])
    assert not run.advance(0.0)
    assert sampler._batch is not None and sorted(sampler._batch.rows) == [0, 1, 2]
    assert run.advance(None)


def test_a_run_longer_than_the_batch_is_wide_waits_then_moves_to_a_wider_batch(
    tiny_sampler_engine: tuple[Engine, Any],
) -> None:
    """A run that needs more positions than the decoder holds waits while another run decodes, then the sampler builds a
    wider batch once the first is idle (the old cache freed) and the run ends there with the tokens it gets alone."""
    engine, tokenizer = tiny_sampler_engine
    sampler = Sampler(engine, tokenizer, max_rows=8)
    short = sampler.start([SampleJob(prompt(1000, 5), "r4", SampleParams(max_tokens=20, temperature=0.0))])
    assert not short.advance(0.0)
    first = sampler._batch
    assert first is not None and first.decoder.width == 64
    long_job = SampleJob(prompt(1001, 30), None, SampleParams(max_tokens=60, temperature=0.0))
    long = sampler.start([long_job])
    assert not long.advance(0.0)  # the first batch is busy with the short run: the long one waits
    assert sampler._batch is first
    assert short.advance(None)
    assert long.advance(None)
    assert sampler._batch is not first and sampler._batch.decoder.width == 128 and first.retired
    assert first.decoder.cache is None and not first.decoder.graphs  # freed before the wider one was built
    assert_same(long.outputs[0].sequences[0], Sampler(engine, tokenizer).generate([long_job])[0].sequences[0])
    assert_blocks_back(sampler)


@pytest.mark.parametrize("paged", [True, False])
def test_requests_for_the_same_prompt_share_one_prefill_and_its_blocks(
    tiny_sampler_engine: tuple[Engine, Any], paged: bool
) -> None:
    """Jobs of one run with the same adapter and prompt (several requests for one prompt) prefill it once and fork
    its blocks; every sample still gets what its job gets alone (its own seed), prompt logprobs included, and every
    block comes back. A different adapter or prompt is its own prefill."""
    engine, tokenizer = tiny_sampler_engine
    shared, other = prompt(11, 37), prompt(12, 9)
    params = [SampleParams(max_tokens=5, temperature=0.9, seed=s) for s in (1, 2, 3, 4)]
    jobs = [
        SampleJob(shared, "r4", params[0], num_samples=2, prompt_logprobs=True),
        SampleJob(other, "r4", params[1]),
        SampleJob(shared, "r4", params[2], num_samples=3, prompt_logprobs=True),
        SampleJob(shared, None, params[3]),  # the base model: other prompt KV
    ]
    sampler = Sampler(engine, tokenizer, paged_kv=paged)
    outputs = sampler.generate(jobs)
    assert sampler.stats.prefill_tokens == 2 * len(shared) + len(other)  # the r4 copy of `shared` once
    for job, out in zip(jobs, outputs, strict=True):
        own = alone(sampler, job)
        assert len(out.sequences) == job.num_samples
        for x, y in zip(out.sequences, own.sequences, strict=True):
            assert_same(x, y)
        if job.prompt_logprobs:
            assert out.prompt_logprobs is not None and own.prompt_logprobs is not None
            assert max(abs(a - b) for a, b in zip(out.prompt_logprobs[1:], own.prompt_logprobs[1:], strict=True)) < 1e-5
    if paged:
        assert_blocks_back(sampler)


def test_a_large_admission_prefills_one_chunk_between_two_decode_steps(
    tiny_sampler_engine: tuple[Engine, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows decoding while another run admits prompts worth several prefill chunks: the batch steps between every two
    of that run's prefill forwards (the rows already decoding wait one chunk, not all of them), and every sample is
    still what its job gets alone. The order is read by wrapping the two methods (they run as they are)."""
    from loraplex.workers.sampling import prefill as prefill_module
    from loraplex.workers.sampling import sampler as sampler_module

    engine, tokenizer = tiny_sampler_engine
    monkeypatch.setattr(engine, "microbatch_tokens", 64)
    events: list[str] = []
    step, chunk = sampler_module._Batch.decode_step, prefill_module.RunPrefill._chunk
    monkeypatch.setattr(sampler_module._Batch, "decode_step", lambda self: (events.append("step"), step(self))[1])
    monkeypatch.setattr(
        prefill_module.RunPrefill, "_chunk", lambda self, jobs: (events.append("prefill"), chunk(self, jobs))[1]
    )
    seeded = SampleParams(max_tokens=20, temperature=0.9, seed=5)
    decoding = [SampleJob(prompt(600, 7), "r8", seeded)]
    arriving = [
        SampleJob(prompt(610 + i, 40), m, seeded, num_samples=2) for i, m in enumerate(["r4", None, "r4", "attn"])
    ]
    sampler = Sampler(engine, tokenizer, max_rows=16)
    a = sampler.start(decoding)
    assert not a.advance(0.0)
    events.clear()
    b = sampler.start(arriving)
    assert b.advance(None)
    prefills = [i for i, e in enumerate(events) if e == "prefill"]
    assert len(prefills) == 4  # 4 prompts of 40 tokens, at most 64 a chunk: one each
    assert all(events[i + 1] == "step" for i in prefills)  # a step follows every chunk
    assert a.advance(None)
    for jobs, run in ((decoding, a), (arriving, b)):
        for job, out in zip(jobs, run.outputs, strict=True):
            own = Sampler(engine, tokenizer).generate([job])[0]
            for x, y in zip(out.sequences, own.sequences, strict=True):
                assert_same(x, y)
    assert_blocks_back(sampler)


def test_a_prompt_longer_than_a_chunk_is_prefilled_in_pieces_between_decode_steps(
    tiny_sampler_engine: tuple[Engine, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt of 53 tokens with 16-token prefill chunks: four pieces, each attending over the prompt's earlier
    positions in the cache, a decode step of the rows already decoding after each; its samples, prompt logprobs and
    top-k prompt logprobs equal the dense path's (the whole prompt in one forward), as do the decoding run's rows, and
    every block comes back."""
    from loraplex.workers.sampling import prefill as prefill_module
    from loraplex.workers.sampling import sampler as sampler_module

    engine, tokenizer = tiny_sampler_engine
    monkeypatch.setattr(engine, "microbatch_tokens", 16)
    events: list[str] = []
    step, piece = sampler_module._Batch.decode_step, prefill_module.RunPrefill._piece
    monkeypatch.setattr(sampler_module._Batch, "decode_step", lambda self: (events.append("step"), step(self))[1])
    monkeypatch.setattr(prefill_module.RunPrefill, "_piece", lambda self, j: (events.append("piece"), piece(self, j))[1])
    seeded = SampleParams(max_tokens=12, temperature=0.9, seed=8)
    # long enough that the batch it opens is as wide as the long prompt's run needs (6 + 60 >= 53 + 12)
    decoding = [SampleJob(prompt(700, 6), "r4", SampleParams(max_tokens=60, temperature=0.9, seed=9), num_samples=2)]
    long_jobs = [
        SampleJob(prompt(701, 53), "r8", seeded, num_samples=3, prompt_logprobs=True, topk_prompt_logprobs=2),
        SampleJob(prompt(702, 5), None, GREEDY),
    ]
    sampler = Sampler(engine, tokenizer, max_rows=16)
    a = sampler.start(decoding)
    assert not a.advance(0.0)
    events.clear()
    b = sampler.start(long_jobs)
    assert b.advance(None)
    pieces = [i for i, e in enumerate(events) if e == "piece"]
    assert len(pieces) == 4 and all(events[i + 1] == "step" for i in pieces)
    assert a.advance(None)
    dense = Sampler(engine, tokenizer, paged_kv=False)
    for jobs, run in ((decoding, a), (long_jobs, b)):
        for job, out in zip(jobs, run.outputs, strict=True):
            own = dense.generate([job])[0]
            for x, y in zip(out.sequences, own.sequences, strict=True):
                assert_same(x, y)
            if job.prompt_logprobs:
                assert out.prompt_logprobs is not None and own.prompt_logprobs is not None
                assert len(out.prompt_logprobs) == len(job.prompt)
                diffs = [abs(x - y) for x, y in zip(out.prompt_logprobs[1:], own.prompt_logprobs[1:], strict=True)]
                assert max(diffs) < 1e-5
                assert out.topk_prompt_logprobs is not None and own.topk_prompt_logprobs is not None
                for x, y in zip(out.topk_prompt_logprobs[1:], own.topk_prompt_logprobs[1:], strict=True):
                    assert x is not None and y is not None
                    assert [t for t, _ in x] == [t for t, _ in y]
    assert_blocks_back(sampler)


def test_a_long_prompt_alone_is_prefilled_in_pieces_and_equals_the_whole_forward(
    tiny_sampler_engine: tuple[Engine, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing else decoding: the pieces run one after another in the admission; greedy tokens and logprobs equal the
    dense path's, which prefills the whole prompt in one forward (fp32 CPU)."""
    engine, tokenizer = tiny_sampler_engine
    monkeypatch.setattr(engine, "microbatch_tokens", 8)
    job = SampleJob(prompt(710, 30), "attn", GREEDY, num_samples=2)
    paged = Sampler(engine, tokenizer)
    got = paged.generate([job])[0]
    assert paged.stats.prefill_forwards == 4 and paged.stats.prefill_tokens == 30
    want = Sampler(engine, tokenizer, paged_kv=False).generate([job])[0]
    for x, y in zip(got.sequences, want.sequences, strict=True):
        assert_same(x, y)
    assert_blocks_back(paged)
