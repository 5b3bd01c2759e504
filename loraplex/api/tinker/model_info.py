"""What Tinker's get_info says about the base model: the name of its tokenizer, which the SDK's `get_tokenizer()` loads
with `AutoTokenizer.from_pretrained` on the client's machine. A name, never a folder of this server (a tenant learns
nothing of its filesystem): the `tokenizer_id` setting when the operator set one, else the base model's name."""

from __future__ import annotations

import json
import re
from pathlib import Path

from loraplex.settings import Settings

# A Hugging Face hub id: "org/name" (or a bare "name"), no path tricks.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def tokenizer_id(settings: Settings, base_model: str) -> str:
    """The setting; else the base model's name as given (a preset such as `tiny`, or a hub id); for a local folder
    the hub id its config.json or tokenizer_config.json records (`_name_or_path`), else the folder's own name."""
    if settings.tokenizer_id:
        return settings.tokenizer_id
    if _HUB_ID.match(base_model) and not Path(base_model).is_absolute():
        return base_model
    folder = Path(base_model).expanduser()
    for name, key in (("config.json", "_name_or_path"), ("tokenizer_config.json", "name_or_path")):
        recorded = _read_key(folder / name, key)
        if recorded and _HUB_ID.match(recorded):
            return recorded
    return folder.name or "base-model"


def _read_key(path: Path, key: str) -> str | None:
    try:
        value = json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None
