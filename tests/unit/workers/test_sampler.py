"""The native sampler (workers/sampling/sampler.py) on the tiny model, fp32 CPU: greedy decoding equals transformers + PEFT
`generate` on the exported adapter (and the bare base model); a mixed batch of adapters of different ranks and base rows
gives each row what it gets alone; seeded sampling is reproducible whatever else is in the batch; stops; prompt logprobs
equal the engine's forward; continuous batching with few rows gives the results of one big batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel

from loraplex.errors import InvalidRequestError, NotFoundError
from loraplex.models import load_base_model
from loraplex.workers.engine.engine import Engine
from loraplex.workers.sampling.jobs import SampleJob, SampleParams
from loraplex.workers.sampling.sampler import Sampler
from loraplex.workers.state.checkpoint_state import state_from_engine
from tests.helpers.datums import datums
from tests.helpers.peft import export_peft
from tests.helpers.sampling import (
    ADAPTERS,
    GREEDY,
    alone,
    assert_mixed_equals_each_alone,
    assert_same,
    hf_greedy,
    prompt,
)


# ---- 1. greedy == transformers + PEFT generate ----------------------------------------------------------------------
@pytest.mark.parametrize("model_id", [None, "r2", "r16", "attn"], ids=["base", "r2", "r16", "attn-subset"])
def test_greedy_equals_peft_generate(
    tiny_sampler_engine: tuple[Engine, Any], tiny_dir: Path, tmp_path: Path, model_id: str | None
) -> None:
    engine, tokenizer = tiny_sampler_engine
    base, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    if model_id is None:
        oracle: torch.nn.Module = base.eval()
    else:
        state = state_from_engine(engine, model_id, base_model="tiny", with_optimizer=False)
        oracle = PeftModel.from_pretrained(base, export_peft(state, tmp_path / "peft", base_model_path=str(tiny_dir)))
        oracle.eval()
    sampler = Sampler(engine, tokenizer)
    prompts = [prompt(1, 5), prompt(2, 17), prompt(3, 1)]
    ours = sampler.generate([SampleJob(p, model_id, GREEDY) for p in prompts])
    for p, out in zip(prompts, ours, strict=True):
        tokens, logprobs = hf_greedy(oracle, p, GREEDY.max_tokens, tokenizer)
        (seq,) = out.sequences
        assert seq.tokens == tokens
        assert seq.stop_reason == ("stop" if tokens[-1] == tokenizer.eos_token_id else "length")
        assert max(abs(x - y) for x, y in zip(seq.logprobs, logprobs, strict=True)) <= 1e-4
    if model_id is not None:  # the adapter matters: the base model's greedy tokens differ
        bare = sampler.generate([SampleJob(p, None, GREEDY) for p in prompts])
        assert any(b.sequences[0].tokens != o.sequences[0].tokens for b, o in zip(bare, ours, strict=True))


# ---- 2. a mixed batch gives each row what it gets alone ------------------------------------------------------------
def test_mixed_adapters_and_base_rows_equal_each_alone(tiny_sampler_engine: tuple[Engine, Any]) -> None:
    engine, tokenizer = tiny_sampler_engine
    sampler = Sampler(engine, tokenizer, max_rows=64)
    # Deliberately interleaved (the sampler orders rows per adapter itself), ragged prompts, base rows among them.
    order = ["r8", None, "r2", "r16", None, "r4", "r2", "r8", "r16", None, "r4"]
    jobs = [SampleJob(prompt(100 + i, 3 + (7 * i) % 13), m, GREEDY) for i, m in enumerate(order)]
    mixed = assert_mixed_equals_each_alone(sampler, jobs)
    # Every adapter (and the base) produced something of its own.
    assert len({tuple(out.sequences[0].tokens[:6]) for out in mixed[:6]}) == 6


def test_a_kept_decoder_samples_from_the_adapters_of_each_call(tiny_sampler_engine: tuple[Engine, Any]) -> None:
    """Two calls share the sampler's one decode batch (its decoder, cache and, on CUDA, its graphs): the second call's
    adapters are loaded into its LoRA groups, and each row still gets what it gets alone."""
    engine, tokenizer = tiny_sampler_engine
    sampler = Sampler(engine, tokenizer, max_rows=4)
    first = [SampleJob(prompt(200 + i, 6), m, GREEDY) for i, m in enumerate(["r2", "r4", None, "r2"])]
    second = [SampleJob(prompt(300 + i, 9), m, GREEDY) for i, m in enumerate(["r16", "attn", "attn", None])]
    sampler.generate(first)
    assert sampler._batch is not None
    kept = sampler._batch.decoder
    outs = sampler.generate(second)
    assert sampler._batch.decoder is kept  # the same decoder object served both calls
    for job, out in zip(second, outs, strict=True):
        assert_same(out.sequences[0], alone(Sampler(engine, tokenizer), job).sequences[0])


# ---- 3. sampling: seeds, temperature, top-k, top-p, stops -----------------------------------------------------------
def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(tiny_sampler_engine: tuple[Engine, Any]) -> None:
    engine, tokenizer = tiny_sampler_engine
    sampler = Sampler(engine, tokenizer, max_rows=64)
    params = SampleParams(max_tokens=10, temperature=1.0, top_k=50, top_p=0.95, seed=1234)
    job = SampleJob(prompt(7, 6), "r8", params, num_samples=3)
    first = alone(sampler, job)
    assert [s.tokens for s in alone(sampler, job).sequences] == [s.tokens for s in first.sequences]
    # Among other jobs (other adapters, base rows, other seeds), at another place in the batch, with fewer rows.
    others = [
        SampleJob(prompt(8, 9), "r2", SampleParams(max_tokens=4, temperature=0.7, seed=5), num_samples=2),
        SampleJob(prompt(9, 3), None, SampleParams(max_tokens=13, temperature=1.2)),
        SampleJob(prompt(10, 11), "r8", GREEDY),
    ]
    for batch, rows in [(others + [job], 64), ([others[1], job, others[0]], 3)]:
        out = Sampler(engine, tokenizer, max_rows=rows).generate(batch)[batch.index(job)]
        for a, b in zip(out.sequences, first.sequences, strict=True):
            assert_same(a, b)
    samples = [s.tokens for s in first.sequences]
    assert len({tuple(t) for t in samples}) == 3  # the samples of one job are independent draws
    other_seed = alone(sampler, SampleJob(job.prompt, "r8", SampleParams(**{**params.__dict__, "seed": 99}), 3))
    assert [s.tokens for s in other_seed.sequences] != samples
    greedy = alone(sampler, SampleJob(job.prompt, "r8", SampleParams(max_tokens=10, temperature=0.0)))
    assert all(s.tokens != greedy.sequences[0].tokens for s in first.sequences)  # temperature 1 really samples


def test_temperature_zero_and_top_k_one_are_greedy(tiny_sampler_engine: tuple[Engine, Any]) -> None:
    engine, tokenizer = tiny_sampler_engine
    sampler = Sampler(engine, tokenizer)
    for model_id in ("r4", None):
        p = prompt(21, 8)
        greedy = alone(sampler, SampleJob(p, model_id, SampleParams(max_tokens=10, temperature=0.0)))
        zero_seeded = alone(sampler, SampleJob(p, model_id, SampleParams(max_tokens=10, temperature=0.0, seed=3)))
        top1 = alone(sampler, SampleJob(p, model_id, SampleParams(max_tokens=10, temperature=1.5, top_k=1), 2))
        tiny_p = alone(sampler, SampleJob(p, model_id, SampleParams(max_tokens=10, temperature=1.0, top_p=1e-6)))
        for seq in [zero_seeded.sequences[0], *top1.sequences, tiny_p.sequences[0]]:
            assert_same(seq, greedy.sequences[0])  # 2 samples = 2 rows: logprobs to fp32 reduction order


def test_top_k_and_top_p_restrict_the_draws(tiny_sampler_engine: tuple[Engine, Any]) -> None:
    """Every sampled token is among the top k of the raw distribution (temperature 1: the same order), and within the
    top-p nucleus."""
    engine, tokenizer = tiny_sampler_engine
    sampler = Sampler(engine, tokenizer)
    p = prompt(31, 5)
    k3 = alone(sampler, SampleJob(p, "r16", SampleParams(max_tokens=12, top_k=3, seed=1), 4, topk_sample_logprobs=3))
    for seq in k3.sequences:
        assert seq.topk_logprobs is not None
        assert all(t in [i for i, _ in top] for t, top in zip(seq.tokens, seq.topk_logprobs, strict=True))
    nucleus = alone(
        sampler, SampleJob(p, "r16", SampleParams(max_tokens=12, top_p=0.5, seed=2), 4, topk_sample_logprobs=512)
    )
    for seq in nucleus.sequences:
        assert seq.topk_logprobs is not None
        for t, top in zip(seq.tokens, seq.topk_logprobs, strict=True):
            probs = torch.tensor([lp for _, lp in top]).exp()
            rank = [i for i, _ in top].index(t)
            assert probs[:rank].sum() < 0.5 + 1e-6  # the mass before the token is under top_p
    # Many draws: more than one distinct token somewhere (top-p 0.5 is not greedy here).
    assert len({tuple(s.tokens) for s in nucleus.sequences}) > 1


def test_stop_tokens_strings_eos_and_length(tiny_sampler_engine: tuple[Engine, Any]) -> None:
    engine, tokenizer = tiny_sampler_engine
    sampler = Sampler(engine, tokenizer)
    p = prompt(41, 7)
    full = alone(sampler, SampleJob(p, "r2", SampleParams(max_tokens=12, temperature=0.0))).sequences[0]
    assert full.stop_reason == "length" and len(full.tokens) == 12
    # A stop token: the first position whose token did not occur before.
    cut = next(i for i in range(2, 12) if full.tokens[i] not in full.tokens[:i])
    stop_tok = full.tokens[cut]
    unused = next(t for t in range(2, 512) if t not in full.tokens)
    by_token = alone(
        sampler, SampleJob(p, "r2", SampleParams(max_tokens=12, temperature=0.0, stop_token_ids=(unused, stop_tok)))
    ).sequences[0]
    assert by_token.stop_reason == "stop" and by_token.tokens == full.tokens[: cut + 1]
    assert by_token.logprobs == pytest.approx(full.logprobs[: cut + 1], abs=1e-6)
    # The same token as EOS (the sampler's eos_token_ids).
    eos = Sampler(engine, tokenizer, eos_token_ids=(stop_tok,))
    by_eos = alone(eos, SampleJob(p, "r2", SampleParams(max_tokens=12, temperature=0.0))).sequences[0]
    assert by_eos.stop_reason == "stop" and by_eos.tokens == full.tokens[: cut + 1]
    # A stop string: the decoded text of two tokens around `cut`; the sequence ends at the token completing it.
    text = tokenizer.decode(full.tokens, skip_special_tokens=False)
    start = len(tokenizer.decode(full.tokens[:cut], skip_special_tokens=False))
    stop_string = text[max(0, start - 2) : start + 2]
    assert stop_string
    expected = next(
        n for n in range(1, 13) if stop_string in tokenizer.decode(full.tokens[:n], skip_special_tokens=False)
    )
    by_string = alone(
        sampler,
        SampleJob(p, "r2", SampleParams(max_tokens=12, temperature=0.0, stop_strings=("\x00never", stop_string))),
    ).sequences[0]
    assert by_string.stop_reason == "stop" and by_string.tokens == full.tokens[:expected]
    # max_tokens
    short = alone(sampler, SampleJob(p, "r2", SampleParams(max_tokens=3, temperature=0.0))).sequences[0]
    assert short.stop_reason == "length" and short.tokens == full.tokens[:3]
    none = alone(sampler, SampleJob(p, "r2", SampleParams(max_tokens=0), prompt_logprobs=True))
    assert none.sequences[0].tokens == [] and none.sequences[0].stop_reason == "length"
    assert none.prompt_logprobs is not None and len(none.prompt_logprobs) == len(p)


# ---- 4. prompt logprobs == the engine's forward; top-k lists --------------------------------------------------------
def test_prompt_logprobs_equal_engine_forward_and_topk_lists(tiny_sampler_engine: tuple[Engine, Any]) -> None:
    engine, tokenizer = tiny_sampler_engine
    sampler = Sampler(engine, tokenizer)
    jobs = [
        SampleJob(prompt(50 + i, n), m, SampleParams(max_tokens=6, seed=i), 2, True, 5, 4)
        for i, (n, m) in enumerate([(9, "r4"), (16, None), (4, "r16"), (12, "attn"), (2, "r4")])
    ]
    outs = sampler.generate(jobs)
    for job, out in zip(jobs, outs, strict=True):
        datum = {"model_input": list(job.prompt[:-1]), "loss_fn_inputs": {"target_tokens": list(job.prompt[1:])}}
        if job.model_id is None:
            continue  # the engine's forward needs an adapter; the base rows are checked against HF below
        forward = engine.forward_backward([engine.prepare(job.model_id, datums([datum]), "cross_entropy", None, True)])[
            0
        ]
        expected = forward["loss_fn_outputs"][0]["logprobs"]
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        got = out.prompt_logprobs[1:]
        assert max(abs(float(a) - b) for a, b in zip(got, expected, strict=True) if a is not None) <= 1e-5
    base_job, base_out = jobs[1], outs[1]
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([base_job.prompt])).logits[0].float()
    lp = logits.log_softmax(-1)[:-1].gather(1, torch.tensor(base_job.prompt[1:])[:, None])[:, 0]
    assert base_out.prompt_logprobs is not None
    assert max(abs(float(a or 0.0) - b) for a, b in zip(base_out.prompt_logprobs[1:], lp.tolist(), strict=True)) <= 1e-5
    for job, out in zip(jobs, outs, strict=True):
        assert out.topk_prompt_logprobs is not None and out.topk_prompt_logprobs[0] is None
        assert out.prompt_logprobs is not None
        for t, actual, top in zip(job.prompt[1:], out.prompt_logprobs[1:], out.topk_prompt_logprobs[1:], strict=True):
            assert top is not None and len(top) == 5
            values = [v for _, v in top]
            assert values == sorted(values, reverse=True)
            assert actual is not None
            if actual > values[-1] + 1e-6:
                assert t in [i for i, _ in top]
            in_top = [v for i, v in top if i == t]
            assert not in_top or abs(in_top[0] - actual) <= 1e-6
        for seq in out.sequences:
            assert seq.topk_logprobs is not None and len(seq.topk_logprobs) == len(seq.tokens)
            for t, lp_t, top in zip(seq.tokens, seq.logprobs, seq.topk_logprobs, strict=True):
                values = [v for _, v in top]
                assert len(top) == 4 and values == sorted(values, reverse=True)
                if lp_t > values[-1] + 1e-6:
                    assert t in [i for i, _ in top]
                in_top = [v for i, v in top if i == t]
                assert not in_top or abs(in_top[0] - lp_t) <= 1e-6
    greedy = alone(sampler, SampleJob(prompt(60, 5), "r8", GREEDY, topk_sample_logprobs=1)).sequences[0]
    assert greedy.topk_logprobs is not None
    assert [top[0][0] for top in greedy.topk_logprobs] == greedy.tokens  # greedy: the sampled token is the top 1


# ---- 5. continuous batching ---------------------------------------------------------------------------------------
def test_more_jobs_than_rows_match_one_big_batch(tiny_sampler_engine: tuple[Engine, Any]) -> None:
    engine, tokenizer = tiny_sampler_engine
    models = ["r2", None, "r16", "r4", "attn", "r8", None, "r2", "r16", "r8"]
    jobs = []
    for i, m in enumerate(models):
        params = SampleParams(
            max_tokens=3 + (5 * i) % 11,  # rows finish at different steps
            temperature=0.0 if i % 3 == 0 else 0.9,
            top_k=-1 if i % 2 else 40,
            seed=1000 + i,
            stop_token_ids=tuple(range(3, 512, 9)) if i % 4 == 1 else (),  # about 1 in 9 tokens stops
        )
        jobs.append(SampleJob(prompt(200 + i, 2 + (3 * i) % 10), m, params, 3, prompt_logprobs=i % 2 == 0))
    small = Sampler(engine, tokenizer, max_rows=4)
    few = small.generate(jobs)
    stats = small.stats
    big = Sampler(engine, tokenizer, max_rows=64)
    many = big.generate(jobs)
    assert big.stats.prefill_forwards == 1 and big.stats.joined_live_batch == 0  # one batch: nobody waited
    assert stats.peak_rows == 4 and stats.rows_admitted == 30
    assert stats.joined_live_batch > 0  # rows joined a live batch: continuous, not waves
    reasons = {seq.stop_reason for out in few for seq in out.sequences}
    assert reasons == {"stop", "length"}
    for job, a, b in zip(jobs, few, many, strict=True):
        assert len(a.sequences) == 3
        for x, y in zip(a.sequences, b.sequences, strict=True):
            assert_same(x, y)
            assert len(x.tokens) <= job.params.max_tokens
        if job.prompt_logprobs:
            assert a.prompt_logprobs is not None and b.prompt_logprobs is not None
            assert (
                max(abs((u or 0.0) - (v or 0.0)) for u, v in zip(a.prompt_logprobs, b.prompt_logprobs, strict=True))
                <= 1e-5
            )
        else:
            assert a.prompt_logprobs is None


# ---- validation -----------------------------------------------------------------------------------------------------
def test_bad_jobs_are_refused_before_any_work(tiny_sampler_engine: tuple[Engine, Any]) -> None:
    engine, tokenizer = tiny_sampler_engine
    sampler = Sampler(engine, tokenizer)
    ok = SampleJob((1, 2, 3), "r2")
    bad = [
        SampleJob((), "r2"),
        SampleJob((1, 512), "r2"),
        SampleJob((1,), "r2", num_samples=0),
        SampleJob((1,), "r2", SampleParams(temperature=-1.0)),
        SampleJob((1,), "r2", SampleParams(top_k=0)),
        SampleJob((1,), "r2", SampleParams(top_p=0.0)),
        SampleJob((1,), "r2", SampleParams(max_tokens=-1)),
        SampleJob((1,), "r2", SampleParams(max_tokens=5000)),
        SampleJob((1,), "r2", topk_sample_logprobs=-2),
    ]
    for job in bad:
        with pytest.raises(InvalidRequestError):
            sampler.generate([ok, job])
    with pytest.raises(NotFoundError):
        sampler.generate([SampleJob((1,), "nope")])
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        Sampler(engine).generate([SampleJob((1,), None, SampleParams(stop_strings=("x",)))])
    assert sampler.generate([]) == []


def test_generate_leaves_the_engine_as_it_was(tiny_sampler_engine: tuple[Engine, Any]) -> None:
    engine, tokenizer = tiny_sampler_engine
    before = {m: engine.adapter_weights(m) for m in ADAPTERS}
    grads = engine.optimizer.grad.clone()
    Sampler(engine, tokenizer, max_rows=2).generate(
        [SampleJob(prompt(300 + i, 4), m, SampleParams(max_tokens=3, seed=i), 2) for i, m in enumerate(ADAPTERS)]
    )
    assert engine.context.routing is None and engine.context.banks is None
    assert torch.equal(engine.optimizer.grad, grads)
    for m, weights in before.items():
        after = engine.adapter_weights(m)
        assert all(torch.equal(after[n][i], weights[n][i]) for n in weights for i in (0, 1))
