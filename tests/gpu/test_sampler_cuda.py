"""The native sampler on CUDA: the decode step replayed as a captured graph gives what the same step gives eagerly
(fp32 with exact matmuls: identical greedy tokens, logprobs within 1e-4; bf16: identical greedy tokens on a model whose
adapters change them), a mixed batch of adapters and base rows gives each row what it gets alone, greedy equals
transformers + PEFT generate on the exported adapter, and a kept graph replays a later call's adapters.

Run on the GPU machine: `python -m pytest -q -m gpu tests/gpu -s`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel

from loraplex.models import load_base_model
from loraplex.workers.engine.engine import Engine
from loraplex.workers.sampling.jobs import SampledSequence, SampleJob, SampleParams
from loraplex.workers.sampling.sampler import Sampler
from loraplex.workers.state.checkpoint_state import state_from_engine
from tests.helpers.peft import export_peft
from tests.helpers.sampling import engine_with_adapters

pytestmark = [pytest.mark.usefixtures("exact_fp32_matmul")]
GREEDY = SampleParams(max_tokens=16, temperature=0.0)
ADAPTERS = {"r4": (4, 8.0, 1), "r16": (16, 16.0, 2), "r8": (8, 16.0, 3)}


def build(tiny_dir: Path, dtype: torch.dtype) -> tuple[Engine, Any]:
    return engine_with_adapters(tiny_dir, ADAPTERS, num_slots=4, max_rank=16, seed=5, dtype=dtype, device="cuda")


def prompts(n: int) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(9)
    return [tuple(torch.randint(2, 512, (3 + (5 * i) % 19,), generator=g).tolist()) for i in range(n)]


def jobs() -> list[SampleJob]:
    order = ["r8", None, "r4", "r16", None, "r4", "r8", "r16", "r4"]
    return [SampleJob(p, m, GREEDY) for p, m in zip(prompts(len(order)), order, strict=True)]


# Two bf16 paths that order and round their sums differently (the Triton expand, torch's matmuls) may give a logit
# one bf16 step apart: 2**-5 = 0.031 for logits in [4, 8), and a logprob moves with its logit. Two steps of slack.
# (One path against itself, a graph replay against eager, holds 2e-2.)
BF16_PATHS_TOL = 2 * 2**-5


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_equals_eager_and_mixed_equals_alone(tiny_dir: Path, dtype: torch.dtype) -> None:
    engine, tokenizer = build(tiny_dir, dtype)
    graphs, eager = Sampler(engine, tokenizer, max_rows=16), Sampler(engine, tokenizer, max_rows=16, cuda_graphs=False)
    with_graph = graphs.generate(jobs())
    assert graphs.stats.graph_captures >= 1  # one per row bucket the run stepped (rows end at different lengths)
    without = eager.generate(jobs())
    assert eager.stats.graph_captures == 0
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for a, b in zip(with_graph, without, strict=True):
        assert a.sequences[0].tokens == b.sequences[0].tokens
        assert max_diff(a.sequences[0].logprobs, b.sequences[0].logprobs) <= tol
    if dtype == torch.float32:  # alone = its own call (another shape, another graph)
        for job, out in zip(jobs(), with_graph, strict=True):
            single = graphs.generate([job])[0].sequences[0]
            assert single.tokens == out.sequences[0].tokens
            assert max_diff(single.logprobs, out.sequences[0].logprobs) <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_expand_kernel_samples_what_the_plain_path_samples(tiny_dir: Path, dtype: torch.dtype) -> None:
    """`Sampler(expand_kernel=True)`: the LoRA expand as the Triton kernel in captured decode steps, mixed adapters
    and base rows; the same greedy tokens as the plain-torch path up to a near tie, logprobs within the dtype's
    tolerance."""
    engine, tokenizer = build(tiny_dir, dtype)
    kernel = Sampler(engine, tokenizer, max_rows=16, expand_kernel=True).generate(jobs())
    plain = Sampler(engine, tokenizer, max_rows=16).generate(jobs())
    tol = 1e-4 if dtype == torch.float32 else BF16_PATHS_TOL
    for a, b in zip(kernel, plain, strict=True):
        same_up_to_a_near_tie(a.sequences[0], b.sequences[0], tol)


def same_up_to_a_near_tie(a: SampledSequence, b: SampledSequence, tol: float) -> None:
    """Greedy tokens equal and logprobs within `tol` up to where the two paths may part: a token where they differ
    must be one both chose at logprobs within `tol` (a near tie that rounding decided), and past it the sequences
    continue from different prefixes, so nothing after it is compared."""
    parted = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=True)) if x != y), len(a.tokens))
    assert max_diff(a.logprobs[: parted + 1], b.logprobs[: parted + 1]) <= tol, (parted, a.logprobs, b.logprobs)


def test_graph_greedy_equals_peft_generate_and_a_kept_graph_takes_new_adapters(tiny_dir: Path, tmp_path: Path) -> None:
    engine, tokenizer = build(tiny_dir, torch.float32)
    sampler = Sampler(engine, tokenizer, max_rows=4)
    ps = prompts(4)
    for model_id in ("r16", "r4"):  # the second call replays the first call's graph with other adapter weights
        ours = sampler.generate([SampleJob(p, model_id, GREEDY) for p in ps])
        assert sampler.stats.graph_captures == (1 if model_id == "r16" else 0)  # 4 rows: one bucket
        base, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
        state = state_from_engine(engine, model_id, base_model="tiny", with_optimizer=False)
        oracle: Any = PeftModel.from_pretrained(
            base, export_peft(state, tmp_path / model_id, base_model_path=str(tiny_dir))
        )
        oracle = oracle.to("cuda").eval()
        for p, out in zip(ps, ours, strict=True):
            hf: Any = oracle.generate(
                input_ids=torch.tensor([p], device="cuda"),
                attention_mask=torch.ones(1, len(p), dtype=torch.int64, device="cuda"),
                max_new_tokens=GREEDY.max_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            tokens = hf.sequences[0, len(p) :].tolist()
            logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(hf.logits, tokens, strict=False)]
            assert out.sequences[0].tokens == tokens
            assert max_diff(out.sequences[0].logprobs, logprobs) <= 1e-4


def test_graphs_capture_while_another_thread_copies_to_host(tiny_dir: Path) -> None:
    """The pool's background writers copy adapter rows to host (PinnedStaging.to_host) while the main thread samples:
    every decode-step capture meanwhile succeeds, and so does every copy (in torch's default capture mode the copy's
    event waits invalidated the capture and failed the copy)."""
    import threading

    from loraplex.workers.engine.pinned_staging import PinnedStaging

    engine, tokenizer = build(tiny_dir, torch.float32)
    staging = PinnedStaging(engine.device, chunk_bytes=1 << 20)
    src = torch.randn(8 << 20, device=engine.device)
    expected = src.cpu()
    stop, errors, copies = threading.Event(), [], [0]

    def copy_loop() -> None:
        try:
            while not stop.is_set():
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(engine.device))
                assert torch.equal(staging.to_host(src, ready), expected)
                copies[0] += 1
        except Exception as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    thread = threading.Thread(target=copy_loop)
    thread.start()
    try:
        for rows in (3, 9, 17, 33):  # new row buckets: a capture each
            sampler = Sampler(engine, tokenizer, max_rows=rows)
            sampler.generate([SampleJob(p, None, GREEDY) for p in prompts(rows)])
            assert sampler.stats.graph_captures >= 1
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    assert copies[0] > 0
