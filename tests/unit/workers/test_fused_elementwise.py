"""workers/kernels/fused_elementwise.py on the CPU: its plain-torch functions are HF's maths (bit for bit in fp32), and installed
on a model the kernels run only inside `active()` (the Triton kernels are CUDA's: tests/gpu/test_fused_elementwise_cuda.py)."""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from loraplex.workers.kernels import fused_elementwise
from loraplex.workers.kernels.fused_elementwise import active, install


def _model() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip
    return Qwen3ForCausalLM(config).eval()


def test_the_fused_forwards_are_hf_bit_for_bit_and_only_while_active() -> None:
    model = _model()
    ids = torch.randint(0, 128, (2, 12))
    want = model(ids).logits
    calls = {"norm": 0, "mlp": 0, "rope": 0}
    real = fused_elementwise.rms_norm, fused_elementwise.silu_mul, fused_elementwise.rope

    def counted(name, f):  # type: ignore[no-untyped-def]
        def run(*a):  # type: ignore[no-untyped-def]
            calls[name] += 1
            return f(*a)

        return run

    model.requires_grad_(False)  # a frozen base, as the engine's
    kernels = tuple(counted(name, f) for name, f in zip(calls, real, strict=True))
    assert (
        install(model, kernels=kernels) == 2 * 6 + 1
    )  # per layer 4 norms, the MLP, the attention's rotary; final norm
    assert torch.equal(model(ids).logits, want) and calls == {"norm": 0, "mlp": 0, "rope": 0}  # inactive: eager
    with active():
        got = model(ids).logits
    assert torch.equal(got, want)
    assert calls == {"norm": 2 * 4 + 1, "mlp": 2, "rope": 2}
    # installed again (a second engine on the model, or on another model of its class): each dispatch wraps HF's own
    # code, not the earlier dispatch
    install(model, kernels=kernels)
    wrapped = [m for m in model.modules() if hasattr(m, "_loraplex_eager_forward")]
    assert len(wrapped) == 2 * 5 + 1 and all(m._loraplex_eager_forward.__func__ is type(m).forward for m in wrapped)
    with active():
        assert torch.equal(model(ids).logits, want)
    assert calls == {"norm": 2 * (2 * 4 + 1), "mlp": 4, "rope": 4}
    assert torch.equal(model(ids).logits, want) and calls["norm"] == 2 * (2 * 4 + 1)  # inactive again: eager


def test_the_plain_rope_is_hf_apply_rotary_pos_emb_bit_for_bit_forward_and_backward() -> None:
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    torch.manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(2, 7, 6, 16, dtype=dtype).transpose(1, 2).requires_grad_()  # HF's layout: [B, H, T, D] views
        k = torch.randn(2, 7, 2, 16, dtype=dtype).transpose(1, 2).requires_grad_()
        angles = torch.randn(2, 7, 8)
        cos, sin = (f(torch.cat([angles, angles], -1)).to(dtype) for f in (torch.cos, torch.sin))
        want = apply_rotary_pos_emb(q, k, cos, sin)
        with active():
            got = fused_elementwise._rope_dispatch(apply_rotary_pos_emb, fused_elementwise.rope)(q, k, cos, sin)
        grads = [torch.randn_like(w) for w in want]
        for w, g in zip(want, got, strict=True):
            assert torch.equal(w, g) and w.stride() == g.stride()
        for w, g in zip(torch.autograd.grad(want, (q, k), grads), torch.autograd.grad(got, (q, k), grads), strict=True):
            assert torch.equal(w, g)
