"""Base-model registry: a local Hugging Face folder, or a preset. Never downloads anything.

`tiny` is built once per cache folder under a file lock (build in a temp folder, then `os.replace`), so every process of a
pool loads byte-identical weights. Real-shape presets are built in place on the requested device (benchmarks only).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from loraplex.errors import InvalidRequestError
from loraplex.models.presets import SHAPE_PRESETS, TINY_SHAPES, build_from_config, build_preset_model, qwen3_config
from loraplex.models.tokenizer import train_tiny_tokenizer

# The `dtype` setting's names (settings.Settings.resolved_dtype) -> torch dtypes.
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise InvalidRequestError(f"unknown dtype {name!r}; one of {sorted(TORCH_DTYPES)}") from None


# The file every complete HF model folder has; the atomic rename guarantees the rest is there too.
_CONFIG = "config.json"


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build_tiny_folder(name: str, target: Path) -> None:
    """Train the tokenizer, build the seeded model in fp32 on CPU and save both into `target`."""
    tokenizer = train_tiny_tokenizer()
    config = qwen3_config(
        TINY_SHAPES[name],
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = build_from_config(config, torch.float32, "cpu")
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def _ensure_tiny(name: str, cache_dir: Path) -> Path:
    final = cache_dir / name
    if (final / _CONFIG).exists():
        return final
    with _file_lock(cache_dir / f".{name}.lock"):
        if (final / _CONFIG).exists():  # another process built it while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir))
        try:
            _build_tiny_folder(name, tmp)
            os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; other users' workers read the cache too
            if final.exists():  # a partial folder left by hand; the rename needs the path free
                shutil.rmtree(final)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def resolve(name: str, cache_dir: str | os.PathLike[str]) -> Path:
    """The local folder for `name`: an existing directory as is, or a folder preset built into `cache_dir/<name>`."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if name in TINY_SHAPES:
        return _ensure_tiny(name, Path(cache_dir).expanduser())
    if name in SHAPE_PRESETS:
        raise InvalidRequestError(f"preset {name!r} has no folder: it is built in place with build_preset_model()")
    known = sorted((*TINY_SHAPES, *SHAPE_PRESETS))
    raise InvalidRequestError(
        f"unknown base model {name!r}: not a local folder nor a preset {known} (nothing is downloaded)"
    )


def load_base_model(
    name_or_path: str,
    cache_dir: str | os.PathLike[str],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model in eval mode on `device`, tokenizer). Real-shape presets get random weights and the tiny tokenizer
    (its ids fit any vocabulary; good enough to feed benchmarks)."""
    if name_or_path in SHAPE_PRESETS and not Path(name_or_path).is_dir():
        tokenizer = AutoTokenizer.from_pretrained(resolve("tiny", cache_dir), local_files_only=True)
        return build_preset_model(name_or_path, dtype, device), tokenizer
    folder = resolve(name_or_path, cache_dir)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    # transformers wraps PreTrainedModel.to with functools.wraps, which mypy reads as an unbound function: the same
    # call, typed as torch.nn.Module.to.
    cast(torch.nn.Module, model).to(device)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model, tokenizer


def load_tokenizer(name_or_path: str, cache_dir: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """The base model's tokenizer (the tiny preset's for a real-shape preset, which has no folder)."""
    if name_or_path in SHAPE_PRESETS and not Path(name_or_path).is_dir():
        name_or_path = "tiny"
    return AutoTokenizer.from_pretrained(resolve(name_or_path, cache_dir), local_files_only=True)


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every tensor of the state dict (names sorted): equal digests mean identical weights."""
    digest = hashlib.sha256()
    for key, tensor in sorted(model.state_dict().items()):
        digest.update(key.encode())
        digest.update(tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
