"""The token choice on CUDA: the draws equal the CPU's and Python's (exact integer maths), every row's token equals the
row-by-row reference's for the same uniform (ties from bf16 logits included), a row's tokens do not depend on the
rows around it, and one step moves one transfer each way (parameters in, tokens + logprobs + top-k out).

Run on the GPU machine: `python -m pytest -q -m gpu tests/gpu/test_choice_cuda.py`."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.workers.sampling import choice
from loraplex.workers.sampling.choice import choose_tokens, choose_tokens_reference, stream_key, uniform

pytestmark = pytest.mark.gpu


def test_draws_on_cuda_equal_the_cpu_and_python() -> None:
    rng = random.Random(2)
    seeds = [rng.randint(-(2**70), 2**70) for _ in range(5000)]
    samples = [rng.randint(0, 4096) for _ in seeds]
    steps = [rng.randint(0, 2**20) for _ in seeds]
    args = [torch.tensor([choice.as_int64(s) for s in seeds]), torch.tensor(samples), torch.tensor(steps)]
    cpu = choice.draw_uniforms(choice.stream_keys(args[0], args[1]), args[2])
    cuda = choice.draw_uniforms(choice.stream_keys(args[0].cuda(), args[1].cuda()), args[2].cuda())
    assert torch.equal(cuda.cpu(), cpu)
    assert cpu[:200].tolist() == [
        uniform(a, b, c) for a, b, c in zip(seeds[:200], samples[:200], steps[:200], strict=True)
    ]


def random_batch(
    rows: int, vocab: int, seed: int
) -> tuple[torch.Tensor, list[float], list[int], list[float], list[int]]:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(rows, vocab, generator=g) * 3).bfloat16().float()
    temps = [rng.choice([0.0, 1.0, 1.0, 0.7]) for _ in range(rows)]
    ks = [rng.choice([-1, -1, 1, 20, 2000]) for _ in range(rows)]
    ps = [rng.choice([1.0, 1.0, 0.9, 0.5]) for _ in range(rows)]
    counts = [rng.choice([0, 0, 5]) for _ in range(rows)]
    return z, temps, ks, ps, counts


def test_every_row_on_cuda_equals_the_reference() -> None:
    z, temps, ks, ps, counts = random_batch(256, 8192, 3)
    streams = [stream_key(9, i) for i in range(256)]
    got = choose_tokens(z.cuda(), temps, ks, ps, streams=streams, steps=[4] * 256, topk_logprobs=counts)
    uniforms = [uniform(9, i, 4) if t else None for i, t in enumerate(temps)]
    want = choose_tokens_reference(z, temps, ks, ps, uniforms, counts)
    assert got.tokens.cpu().tolist() == want.tokens.tolist()
    torch.testing.assert_close(got.logprobs.cpu(), want.logprobs, atol=1e-5, rtol=0)
    g, w = got.to_host(), want.to_host()
    assert [None if t is None else [i for i, _ in t] for t in g.top] == [
        None if t is None else [i for i, _ in t] for t in w.top
    ]


def test_a_rows_tokens_on_cuda_do_not_depend_on_the_batch() -> None:
    z, temps, ks, ps, counts = random_batch(256, 151_936, 4)
    streams = [stream_key(1, i) for i in range(256)]
    whole = choose_tokens(z.cuda(), temps, ks, ps, streams=streams, steps=[0] * 256, topk_logprobs=counts).to_host()
    order = list(range(256))
    random.Random(5).shuffle(order)
    part = order[:37]
    sub = choose_tokens(
        z[part].cuda(), [temps[i] for i in part], [ks[i] for i in part], [ps[i] for i in part],
        streams=[streams[i] for i in part], steps=[0] * 37, topk_logprobs=[counts[i] for i in part],
    ).to_host()  # fmt: skip
    assert sub.tokens == [whole.tokens[i] for i in part]
    assert sub.logprobs == pytest.approx([whole.logprobs[i] for i in part], abs=1e-6)


def test_one_transfer_each_way_per_step() -> None:
    z, temps, ks, ps, counts = random_batch(256, 151_936, 6)
    logits = z.cuda()
    streams = [stream_key(2, i) for i in range(256)]

    def step() -> None:
        choose_tokens(logits, temps, ks, ps, streams=streams, steps=[1] * 256, topk_logprobs=counts).to_host()

    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert sum("Memcpy DtoH" in n for n in names) == 1, sorted(set(names))
    assert sum("Memcpy HtoD" in n for n in names) == 1, sorted(set(names))
