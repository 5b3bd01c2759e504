"""Which tokenizer a pipeline config may name: a registered model name (this service's base model, or a preset of
loraplex/models) or a folder under the operator's tokenizer root (`pipeline_tokenizer_root`, default
home/tokenizers), named relative to it. Nothing else on the workers is reachable, and the gateway decides from the
text alone (it looks at no file), so its answer cannot tell a tenant whether a path exists on the server."""

from __future__ import annotations

import re
from pathlib import Path

from loraplex.errors import InvalidRequestError
from loraplex.settings import Settings

# The presets of loraplex/models/presets.py (TINY_SHAPES, SHAPE_PRESETS), named here because the gateway imports no
# torch; tests/security/test_pipelines_tenants.py checks the two agree.
PRESET_NAMES = frozenset({"tiny", "tiny-vllm", "tiny-moe", "qwen3-0.6b-shape", "qwen3-4b-shape", "qwen3-30b-a3b-shape"})
_SEGMENT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")  # no leading dot: no '.', '..' or hidden folders
MAX_SEGMENTS = 8


def tokenizer_root(settings: Settings) -> Path:
    return settings.pipeline_tokenizer_root or settings.home / "tokenizers"


def model_names(settings: Settings) -> frozenset[str]:
    return PRESET_NAMES | {settings.base_model}


def check_tokenizer(settings: Settings, value: str | None) -> None:
    """InvalidRequestError (400) unless `value` is empty, a registered model name, or a relative folder name under
    the tokenizer root; the message is the same for any other value (existing or not)."""
    if value is None or value in model_names(settings):
        return
    parts = value.split("/")
    if len(parts) <= MAX_SEGMENTS and all(_SEGMENT.fullmatch(p) for p in parts):
        return
    names = ", ".join(sorted(PRESET_NAMES | ({settings.base_model} if "/" not in settings.base_model else set())))
    raise InvalidRequestError(
        f"tokenizer {value[:200]!r}: name a registered model ({names}) or a folder under the pipelines' tokenizer "
        "root (LORAPLEX_PIPELINE_TOKENIZER_ROOT), relative to it (e.g. 'my-tokenizer'); no other path is reachable"
    )


def tokenizer_source(settings: Settings, value: str) -> tuple[str, str]:
    """("model", name) or ("folder", its path under the root) for a value `check_tokenizer` accepts (checked again:
    a config stored before the rule is held to it too)."""
    check_tokenizer(settings, value)
    if value in model_names(settings):
        return "model", value
    return "folder", str(tokenizer_root(settings) / value)
