"""The LM head + log-softmax run in token chunks: no [N, V] logits tensor ever exists, in forward or backward, and the
chunked result and its gradients equal the unchunked computation.

Every tensor an aten op allocates is recorded through a TorchDispatchMode (it sees the ops that activation recomputation
re-runs during backward, too); the largest fresh (non-view) tensor that is vocabulary-wide must hold at most one chunk of rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from loraplex.models import load_base_model
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.lm_head import target_logprobs
from tests.helpers.datums import with_datums


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class VocabWideAllocations(TorchDispatchMode):
    """Records the row count of every newly allocated (not aliasing an input) floating tensor whose last dimension is the vocabulary size."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.rows: list[int] = []
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        inputs = {_storage(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if (
                isinstance(t, torch.Tensor)
                and t.is_floating_point()
                and t.dim() >= 2
                and t.shape[-1] == self.vocab
                and _storage(t) not in inputs  # a fresh allocation, not a view (e.g. the head weight's transpose)
            ):
                self.rows.append(t.numel() // self.vocab)
        return out

    @property
    def largest(self) -> int:
        return max(self.rows, default=0)


def unchunked(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (hidden @ weight.T).float().log_softmax(-1).gather(1, targets[:, None])[:, 0]


N, H, V, CHUNK = 3000, 32, 1000, 128  # N >> chunk, and not a multiple of it


def make_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H**0.5
    targets = torch.randint(0, V, (N,), generator=g)
    coeff = torch.randn(N, generator=g)  # a token-dependent upstream gradient
    return hidden, weight, targets, coeff


def test_the_detector_sees_full_logits_in_the_unchunked_computation() -> None:
    hidden, weight, targets, coeff = make_inputs()
    hidden.requires_grad_(True)
    with VocabWideAllocations(V) as rec:
        (unchunked(hidden, weight, targets) * coeff).sum().backward()
    assert rec.largest == N


@pytest.mark.parametrize("weight_grad", [False, True])
def test_chunked_head_never_allocates_full_logits_and_matches_unchunked(weight_grad: bool) -> None:
    hidden, weight, targets, coeff = make_inputs()
    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(weight_grad)
    with VocabWideAllocations(V) as rec:
        lp = target_logprobs(h1, w1, targets, chunk_tokens=CHUNK)
        forward_rows = rec.largest
        (lp * coeff).sum().backward()
    assert lp.shape == (N,) and lp.dtype == torch.float32
    assert 0 < forward_rows <= CHUNK  # forward: one chunk of logits at a time
    assert rec.largest <= CHUNK, rec.largest  # backward recomputes chunk by chunk: still never [N, V]

    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(weight_grad)
    ref = unchunked(h2, w2, targets)
    (ref * coeff).sum().backward()
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=1e-5)
    if weight_grad:
        torch.testing.assert_close(w1.grad, w2.grad, atol=1e-4, rtol=1e-5)


def test_chunked_head_without_grad_is_chunked_too() -> None:
    hidden, weight, targets, _ = make_inputs()
    with torch.no_grad(), VocabWideAllocations(V) as rec:
        lp = target_logprobs(hidden, weight, targets, chunk_tokens=CHUNK)
    assert 0 < rec.largest <= CHUNK
    torch.testing.assert_close(lp, unchunked(hidden, weight, targets), atol=1e-5, rtol=1e-5)


def test_chunked_head_handles_empty_and_rejects_a_zero_chunk() -> None:
    _, weight, _, _ = make_inputs()
    assert target_logprobs(torch.zeros(0, H), weight, torch.zeros(0, dtype=torch.int64)).shape == (0,)
    with pytest.raises(ValueError):
        target_logprobs(torch.zeros(2, H), weight, torch.zeros(2, dtype=torch.int64), chunk_tokens=0)


def test_engine_step_never_materialises_whole_batch_logits(tiny_dir: Path) -> None:
    """A real mixed forward_backward (two adapters, ~700 target tokens, RL and CE rows): the largest vocab-wide tensor
    holds one loss chunk, and the results equal an engine whose chunk covers the whole batch."""
    chunk = 24
    engines = []
    for chunk_tokens in (chunk, 1 << 20):
        model, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
        e = build_engine(model, EngineConfig(num_slots=2, max_rank=8, loss_chunk_tokens=chunk_tokens))
        e.create_adapter("a", 8, 16.0, seed=1)
        e.create_adapter("b", 4, 8.0, seed=2)
        for model_id in ("a", "b"):  # non-zero B so the adapters matter
            g = torch.Generator().manual_seed(ord(model_id))
            w = {n: (a, 0.05 * torch.randn(b.shape, generator=g)) for n, (a, b) in e.adapter_weights(model_id).items()}
            e.load_adapter_weights(model_id, w)
        engines.append(e)
    vocab = engines[0].vocab_size
    g = torch.Generator().manual_seed(3)
    data = []
    for n in (180, 250, 90, 170):
        ids = torch.randint(0, vocab, (n + 1,), generator=g).tolist()
        data.append({"model_input": ids[:-1], "loss_fn_inputs": {"target_tokens": ids[1:]}})
    rl = [
        {**d, "loss_fn_inputs": {**d["loss_fn_inputs"], "logprobs": [-6.0] * len(d["model_input"]), "advantages": [0.5] * len(d["model_input"])}}
        for d in data[2:]
    ]  # fmt: skip
    items = [("a", data[:2], "cross_entropy", None, False), ("b", rl, "ppo", None, False)]
    with VocabWideAllocations(vocab) as rec:
        chunked = engines[0].forward_backward([engines[0].prepare(*with_datums(it)) for it in items])
    assert rec.ops > 0 and 0 < rec.largest <= chunk, rec.largest
    with VocabWideAllocations(vocab) as rec_whole:
        whole = engines[1].forward_backward([engines[1].prepare(*with_datums(it)) for it in items])
    assert rec_whole.largest == sum(len(d["model_input"]) for d in data)  # the detector would catch whole-batch logits
    for x, y in zip(chunked, whole, strict=True):
        assert x["metrics"]["loss:sum"] == pytest.approx(y["metrics"]["loss:sum"], rel=1e-5)
        for dx, dy in zip(x["loss_fn_outputs"], y["loss_fn_outputs"], strict=True):
            torch.testing.assert_close(torch.tensor(dx["logprobs"]), torch.tensor(dy["logprobs"]), atol=1e-5, rtol=0)
    for model_id in ("a", "b"):
        g1, g2 = engines[0].adapter_grads(model_id), engines[1].adapter_grads(model_id)
        for name in g1:
            for t1, t2 in zip(g1[name], g2[name], strict=True):
                torch.testing.assert_close(t1, t2, atol=1e-5, rtol=1e-4)


def test_the_fused_head_flag_is_the_eager_chunks_on_the_cpu() -> None:
    """fused=True needs CUDA and triton (tests/gpu/test_triton_lm_head_cuda.py); elsewhere it is the eager path."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 8, generator=g, requires_grad=True)
    weight = torch.randn(50, 8, generator=g)
    targets = torch.randint(0, 50, (10,), generator=g)
    a, b = target_logprobs(hidden, weight, targets, 4, fused=True), target_logprobs(hidden, weight, targets, 4)
    assert torch.equal(a, b)
