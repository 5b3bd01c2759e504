"""The Triton RMSNorm, silu(gate) * up and rotary embedding (workers/kernels/triton_elementwise.py, installed by workers/kernels/fused_elementwise.py) on
CUDA against HF's eager modules, at Qwen3-4B's shapes in bf16, forward and backward: each within 2x the eager module's
own distance from an fp32 evaluation of the same maths (+ a bf16 ulp), so fusing adds no error beyond bf16 rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loraplex.workers.kernels.fused_elementwise import active, install, rms_norm

triton_elementwise = pytest.importorskip("loraplex.workers.kernels.triton_elementwise")

CUDA = torch.device("cuda")


def _close(fast: torch.Tensor, eager: torch.Tensor, exact: torch.Tensor) -> None:
    e_fast, e_eager = (fast.float() - exact).abs().max().item(), (eager.float() - exact).abs().max().item()
    assert e_fast <= 2 * e_eager + 2**-8 * exact.abs().max().item(), (e_fast, e_eager)


@pytest.mark.parametrize("shape", [(4096, 2560), (4096 * 32, 128), (300, 2560)])
def test_triton_rms_norm_matches_hf_eager(shape: tuple[int, int]) -> None:
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    g = torch.Generator(device="cuda").manual_seed(shape[0])
    norm = Qwen3RMSNorm(shape[1], eps=1e-6).to(CUDA, torch.bfloat16).requires_grad_(False)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(shape[1], device=CUDA, generator=g))
    x = torch.randn(shape, device=CUDA, dtype=torch.bfloat16, generator=g).requires_grad_()
    dy = torch.randn(shape, device=CUDA, dtype=torch.bfloat16, generator=g)
    out_fast, out_eager = triton_elementwise.rms_norm(x, norm.weight, 1e-6), norm(x)
    (dx_fast,) = torch.autograd.grad(out_fast, x, dy)
    (dx_eager,) = torch.autograd.grad(out_eager, x, dy)
    x32 = x.detach().float().requires_grad_()
    exact = rms_norm(x32, norm.weight.float(), 1e-6)
    (dx_exact,) = torch.autograd.grad(exact, x32, dy.float())
    _close(out_fast, out_eager, exact.detach())
    _close(dx_fast, dx_eager, dx_exact)


def test_triton_silu_mul_matches_eager_and_installs_on_a_model() -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    gate, up = (torch.randn(4096, 9728, device=CUDA, dtype=torch.bfloat16, generator=g).requires_grad_() for _ in "ab")
    dy = torch.randn(4096, 9728, device=CUDA, dtype=torch.bfloat16, generator=g)
    grads_fast = torch.autograd.grad(triton_elementwise.silu_mul(gate, up), (gate, up), dy)
    grads_eager = torch.autograd.grad(F.silu(gate) * up, (gate, up), dy)
    g32, u32 = (t.detach().float().requires_grad_() for t in (gate, up))
    grads_exact = torch.autograd.grad(F.silu(g32) * u32, (g32, u32), dy.float())
    for f, e, x in zip(grads_fast, grads_eager, grads_exact, strict=True):
        _close(f, e, x)

    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64)  # fmt: skip
    model = Qwen3ForCausalLM(config).to(CUDA, torch.bfloat16).requires_grad_(False)
    assert install(model) == 2 * 6 + 1  # per layer: 4 norms (input, post-attention, q, k), the MLP, the attention's
    # rotary embedding; the final norm
    ids = torch.randint(0, 512, (2, 48), device=CUDA, generator=g)
    with torch.no_grad():
        eager = model(ids).logits.float()
        with active():
            fused = model(ids).logits.float()
    assert (fused - eager).abs().max().item() <= 0.05 * eager.abs().max().item()


@pytest.mark.parametrize("tokens", [4096, 37])
def test_triton_rope_matches_hf_apply_rotary_pos_emb(tokens: int) -> None:
    """Qwen3-4B's heads (32 q, 8 kv, head dim 128) in HF's layout, forward and backward, against an fp32 evaluation
    as the other kernels (on the H200 a few elements differ from HF's eager ops by one bf16 ulp)."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    from loraplex.workers.kernels.fused_elementwise import _rope_dispatch

    g = torch.Generator(device="cuda").manual_seed(tokens)
    q = torch.randn(1, tokens, 32, 128, device=CUDA, dtype=torch.bfloat16, generator=g).transpose(1, 2).requires_grad_()
    k = torch.randn(1, tokens, 8, 128, device=CUDA, dtype=torch.bfloat16, generator=g).transpose(1, 2).requires_grad_()
    angles = 100 * torch.rand(1, tokens, 64, device=CUDA, generator=g)
    cos, sin = (f(torch.cat([angles, angles], -1)).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    want = apply_rotary_pos_emb(q, k, cos, sin)
    with active():
        got = _rope_dispatch(apply_rotary_pos_emb, triton_elementwise.rope)(q, k, cos, sin)
    q32, k32 = (t.detach().float().requires_grad_() for t in (q, k))
    exact = apply_rotary_pos_emb(q32, k32, cos.float(), sin.float())
    dys = [torch.randn(w.shape, device=CUDA, dtype=torch.bfloat16, generator=g) for w in want]
    grads_want = torch.autograd.grad(want, (q, k), dys)
    grads_got = torch.autograd.grad(got, (q, k), dys)
    grads_exact = torch.autograd.grad(exact, (q32, k32), [d.float() for d in dys])
    assert [t.stride() for t in got] == [t.stride() for t in want]  # HF's layout, which the attention reads
    for f, w, x in zip((*got, *grads_got), (*want, *grads_want), (*exact, *grads_exact), strict=True):
        _close(f, w, x.detach())


def test_triton_norm_and_silu_read_column_blocks_in_place() -> None:
    """The decode step's inputs without a gradient: q and k as [rows, heads, D] views of one q/k/v product's columns,
    gate and up as column blocks of one gate/up product. Read in place, the results equal the kernels' own on
    contiguous copies, bit for bit (the same maths per row; the copies are checked against HF above)."""
    g = torch.Generator(device="cuda").manual_seed(5)
    rows, heads, kv_heads, dim, inter = 37, 32, 8, 128, 9728
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, device=CUDA, dtype=torch.bfloat16, generator=g)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    weight = 1 + 0.1 * torch.randn(dim, device=CUDA, dtype=torch.bfloat16, generator=g)
    for block, h in ((q, heads), (k, kv_heads)):
        view = block.view(rows, h, dim)
        assert not view.is_contiguous()
        in_place = triton_elementwise.rms_norm(view, weight, 1e-6)
        assert torch.equal(in_place, triton_elementwise.rms_norm(view.contiguous(), weight, 1e-6))
    gate_up = torch.randn(rows, 2 * inter, device=CUDA, dtype=torch.bfloat16, generator=g)
    gate, up = gate_up.split([inter, inter], dim=1)
    in_place = triton_elementwise.silu_mul(gate, up)
    assert torch.equal(in_place, triton_elementwise.silu_mul(gate.contiguous(), up.contiguous()))
    assert in_place.is_contiguous() and in_place.shape == (rows, inter)
