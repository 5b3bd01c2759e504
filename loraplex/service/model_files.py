"""Files of the pool's base model the gateway reads without torch: its tokenizer folder (the Tinker SDK's
`tokenizer_id`; the OpenAI endpoint's tokenizer)."""

from __future__ import annotations

from pathlib import Path

from loraplex.settings import Settings


def tokenizer_folder(settings: Settings, base_model: str) -> str | None:
    """A local folder the SDK's `get_tokenizer()` loads offline: the base model's own folder, else the folder the
    pool built the preset in (real-shape presets use the tiny preset's tokenizer)."""
    for folder in (Path(base_model).expanduser(), settings.resolved_model_cache / base_model,
                   settings.resolved_model_cache / "tiny"):  # fmt: skip
        if (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file():
            return str(folder.resolve())
    return None
