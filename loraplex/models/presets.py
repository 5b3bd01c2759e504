"""Random-init model presets: `tiny` (CPU tests, saved to a folder) and real Qwen3 shapes (GPU benchmarks, built in place).

Weights come from our own seeded init (not transformers' `_init_weights`), so they do not drift with transformers versions.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from loraplex.errors import InvalidRequestError

INIT_STD = 0.02
PRESET_SEED = 1234

# Small enough that a CPU step takes milliseconds, big enough that a rank-8 adapter memorises a few sentences fast.
TINY_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    # `tiny` with head_dim 32: the smallest head size vLLM's CPU attention serves (32, 64, 80, ...; 16 fails at the
    # first request), so a pool and a vLLM sampler (loraplex/samplers/vllm.py) can share one CPU base model.
    "tiny-vllm": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    # `tiny` as a mixture of experts: every layer's MLP is 4 experts, 2 per token (Qwen3-MoE).
    "tiny-moe": dict(
        hidden_size=64,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
}

# The published Qwen3 configs (vocab 151936, head_dim 128, rope theta 1e6, tied embeddings as those models ship).
SHAPE_PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b-shape": dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
    ),
    "qwen3-4b-shape": dict(
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
    ),
    # Qwen3-30B-A3B: 48 layers of 128 experts, 8 per token (the GPU benchmark's MoE shape).
    "qwen3-30b-a3b-shape": dict(
        vocab_size=151936,
        hidden_size=2048,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
    ),
}

PRESETS = (*TINY_SHAPES, *SHAPE_PRESETS)


def is_moe(shape: dict[str, Any]) -> bool:
    return "num_experts" in shape


def qwen3_config(shape: dict[str, Any], **extra: Any) -> Qwen3Config | Qwen3MoeConfig:
    """A Qwen3Config (Qwen3MoeConfig for a shape with experts) from a shape dict: no sliding window, rope theta 1e6 and
    rms eps 1e-6 as Qwen3 ships; an MoE's router logits are not output, so no auxiliary loss is computed (LoRA does
    not train the router)."""
    config_class: Any = Qwen3MoeConfig if is_moe(shape) else Qwen3Config
    moe = {"output_router_logits": False} if is_moe(shape) else {}
    return cast(
        Qwen3Config | Qwen3MoeConfig,
        config_class(
            **shape,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            use_cache=False,
            **moe,
            **extra,
        ),
    )


@torch.no_grad()
def seeded_init_(model: torch.nn.Module, seed: int = PRESET_SEED) -> None:
    """Matrices ~ N(0, 0.02) drawn in parameter order from one generator; vectors (norm gains) = 1.

    An untied output head is drawn with std 1/sqrt(hidden) instead, so the initial logits have unit scale: with a frozen
    0.02 head every logit stays within about +-1.3 and no adapter can fit anything (the tiny learning demo relies on it).
    `model.parameters()` deduplicates tied weights, so a tied embedding is drawn once (with 0.02)."""
    params = list(model.parameters())
    device = params[0].device
    get_head, get_embed = getattr(model, "get_output_embeddings", None), getattr(model, "get_input_embeddings", None)
    head = get_head() if get_head is not None else None
    embed = get_embed() if get_embed is not None else None
    untied_head = head.weight if head is not None and (embed is None or head.weight is not embed.weight) else None
    gen = torch.Generator(device=device if device.type != "meta" else "cpu").manual_seed(seed)
    for p in params:
        if p.dim() == 1:
            p.fill_(1.0)
        else:
            std = p.shape[1] ** -0.5 if p is untied_head else INIT_STD
            # Draw in fp32 then cast, so a bf16 model gets the same values as the fp32 one (rounded).
            p.copy_(torch.empty(p.shape, dtype=torch.float32, device=device).normal_(0.0, std, generator=gen))


def build_from_config(
    config: Qwen3Config | Qwen3MoeConfig, dtype: torch.dtype, device: str | torch.device, seed: int = PRESET_SEED
) -> Qwen3ForCausalLM | Qwen3MoeForCausalLM:
    """Instantiate directly on `device` in `dtype` (no CPU round trip for the 4B shape) and seed the weights."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = (
                Qwen3MoeForCausalLM(config) if isinstance(config, Qwen3MoeConfig) else Qwen3ForCausalLM(config)
            )
    finally:
        torch.set_default_dtype(previous)
    seeded_init_(model, seed)
    model.eval()  # no dropout anywhere; eval keeps HF from toggling training-only paths
    return model


def build_preset_model(
    name: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = PRESET_SEED
) -> Qwen3ForCausalLM | Qwen3MoeForCausalLM:
    """A real-shape preset (`qwen3-0.6b-shape`, `qwen3-4b-shape`) with random weights, built in place; never saved."""
    if name not in SHAPE_PRESETS:
        raise InvalidRequestError(f"unknown shape preset {name!r}; known: {sorted(SHAPE_PRESETS)}")
    return build_from_config(qwen3_config(SHAPE_PRESETS[name]), dtype, device, seed)
