"""workers/fused_elementwise.py on the CPU: its plain-torch functions are HF's maths (bit for bit in fp32), and installed
on a model the kernels run only inside `active()` (the Triton kernels are CUDA's: tests/gpu/test_fused_elementwise_cuda.py)."""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from loraplex.workers import fused_elementwise
from loraplex.workers.fused_elementwise import active, install


def _model() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip
    return Qwen3ForCausalLM(config).eval()


def test_the_fused_forwards_are_hf_bit_for_bit_and_only_while_active() -> None:
    model = _model()
    ids = torch.randint(0, 128, (2, 12))
    want = model(ids).logits
    calls = {"norm": 0, "mlp": 0}
    real_norm, real_mlp = fused_elementwise.rms_norm, fused_elementwise.silu_mul

    def counted(name, f):  # type: ignore[no-untyped-def]
        def run(*a):  # type: ignore[no-untyped-def]
            calls[name] += 1
            return f(*a)

        return run

    model.requires_grad_(False)  # a frozen base, as the engine's
    assert install(model, kernels=(counted("norm", real_norm), counted("mlp", real_mlp))) == 11
    assert torch.equal(model(ids).logits, want) and calls == {"norm": 0, "mlp": 0}  # inactive: the eager modules
    with active():
        got = model(ids).logits
    assert torch.equal(got, want)
    assert calls == {"norm": 2 * 4 + 1, "mlp": 2}
