"""Base-model registry: local Hugging Face folders and random-init presets (offline only)."""

from loraplex.models.presets import PRESETS, SHAPE_PRESETS, TINY_SHAPES, build_preset_model
from loraplex.models.registry import TORCH_DTYPES, load_base_model, load_tokenizer, resolve, torch_dtype, weights_digest

__all__ = [
    "PRESETS",
    "SHAPE_PRESETS",
    "TORCH_DTYPES",
    "TINY_SHAPES",
    "build_preset_model",
    "load_base_model",
    "load_tokenizer",
    "resolve",
    "torch_dtype",
    "weights_digest",
]
