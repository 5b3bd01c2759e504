"""Checkpoint files on disk: the format, atomic replacement, tampered / truncated files refused with nothing loaded, a
real write failure (file size limit: EFBIG) leaving the previous checkpoint intact, and checkpoint names."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
import torch

from loraplex.errors import InvalidRequestError, NotFoundError
from loraplex.models import load_base_model
from loraplex.protocol.checkpoint_files import manifest_digest
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.engine import Engine
from loraplex.workers.state.checkpoint import (
    CHECKPOINT_FORMAT_VERSION,
    MANIFEST_FILE,
    OPTIMIZER_FILE,
    WEIGHTS_FILE,
    CheckpointState,
    read_checkpoint,
    validate_checkpoint_name,
    write_checkpoint,
)
from loraplex.workers.state.checkpoint_state import load_into_engine, state_from_engine
from tests.helpers.datums import datums

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Engine:
    model, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    engine = build_engine(model, EngineConfig(num_slots=2, max_rank=8))
    engine.create_adapter("a", 4, 8.0, seed=3)
    data = [{"model_input": list(range(5, 17)), "loss_fn_inputs": {"target_tokens": list(range(6, 18))}}]
    for _ in range(2):
        engine.forward_backward([engine.prepare("a", datums(data), "cross_entropy", None, False)])
        engine.optim_step([("a", {"learning_rate": 1e-2})])
    return engine


@pytest.fixture(scope="module")
def state(engine: Engine) -> CheckpointState:
    return state_from_engine(
        engine, "a", base_model="tiny", with_optimizer=True, user_metadata={"run": "r1", "note": [1, 2]}
    )


@pytest.fixture(scope="module")
def saved(state: CheckpointState, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("saved") / "ckpt"
    write_checkpoint(state, directory)
    return directory


def assert_equal_states(a: CheckpointState, b: CheckpointState) -> None:
    for f in ("model_id", "rank", "alpha", "seed", "step", "base_model", "target_modules", "modules", "kind"):
        assert getattr(a, f) == getattr(b, f), f
    assert a.user_metadata == b.user_metadata
    for name in b.modules:
        assert all(torch.equal(x, y) for x, y in zip(a.weights[name], b.weights[name], strict=True))
        if b.optimizer is not None:
            assert a.optimizer is not None
            assert all(torch.equal(x, y) for x, y in zip(a.optimizer[name], b.optimizer[name], strict=True))


def test_format_on_disk(state: CheckpointState, tmp_path: Path) -> None:
    files = write_checkpoint(state, tmp_path / "ckpt")
    directory = tmp_path / "ckpt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary left
    assert sorted(p.name for p in directory.iterdir()) == sorted([WEIGHTS_FILE, OPTIMIZER_FILE, MANIFEST_FILE])
    for name, (size, digest) in files.files.items():
        data = (directory / name).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (size, digest)
    assert files.total_size == sum(p.stat().st_size for p in directory.iterdir())
    assert files.sha256 == hashlib.sha256((directory / MANIFEST_FILE).read_bytes()).hexdigest()

    manifest = json.loads((directory / MANIFEST_FILE).read_text())
    assert manifest["format_version"] == CHECKPOINT_FORMAT_VERSION == 1
    assert manifest["kind"] == "state" and manifest["step"] == 2 and manifest["base_model"] == "tiny"
    assert manifest["hparams"] == {"rank": 4, "alpha": 8.0, "seed": 3}
    assert manifest["signature"]["max_rank"] == 8
    assert set(manifest["signature"]["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"}  # fmt: skip
    assert manifest["signature"]["modules"] == list(state.modules) and len(state.modules) == 14
    assert manifest["user_metadata"] == {"run": "r1", "note": [1, 2]}
    assert manifest["created_at"].endswith("+00:00")
    assert set(manifest["files"]) == {WEIGHTS_FILE, OPTIMIZER_FILE}
    assert manifest["files"][WEIGHTS_FILE] == dict(zip(("size", "sha256"), files.files[WEIGHTS_FILE], strict=True))

    weights = safetensors.torch.load_file(directory / WEIGHTS_FILE)  # PEFT's names and layout
    name = "model.layers.1.mlp.down_proj"
    assert weights[f"base_model.model.{name}.lora_A.weight"].shape == (4, 128)
    assert weights[f"base_model.model.{name}.lora_B.weight"].shape == (64, 4)
    assert len(weights) == 28 and all(t.dtype == torch.float32 for t in weights.values())
    moments = safetensors.torch.load_file(directory / OPTIMIZER_FILE)
    assert moments[f"base_model.model.{name}.lora_A.exp_avg_sq"].shape == (4, 128)
    assert moments[f"base_model.model.{name}.lora_B.exp_avg"].shape == (64, 4)
    assert len(moments) == 56

    assert_equal_states(read_checkpoint(directory), state)


def test_overwrite_replaces_whole_directory(state: CheckpointState, tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    write_checkpoint(state, directory)
    (directory / "stray.txt").write_text("from the old one")
    sampler = dataclasses.replace(state, kind="sampler", optimizer=None, step=9)
    write_checkpoint(sampler, directory)
    assert sorted(p.name for p in directory.iterdir()) == [WEIGHTS_FILE, MANIFEST_FILE]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    back = read_checkpoint(directory)
    assert back.kind == "sampler" and back.step == 9 and back.optimizer is None


def test_overwrite_without_rename_exchange(
    state: CheckpointState, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where renameat2(RENAME_EXCHANGE) is unavailable: two renames, and a failed second one puts the old one back."""
    from loraplex.runtime import fsutil as checkpoint  # write_checkpoint's folder swap lives in fsutil

    monkeypatch.setattr(checkpoint, "_exchange", lambda a, b: False)
    directory = tmp_path / "ckpt"
    write_checkpoint(state, directory)
    write_checkpoint(dataclasses.replace(state, step=5), directory)
    assert read_checkpoint(directory).step == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]

    real_rename = os.rename

    def failing_rename(src: object, dst: object) -> None:
        if Path(str(src)).name.startswith(".ckpt.tmp-"):
            raise OSError(28, "No space left on device")
        real_rename(src, dst)

    monkeypatch.setattr(checkpoint.os, "rename", failing_rename)
    with pytest.raises(OSError, match="No space left"):
        write_checkpoint(dataclasses.replace(state, step=6), directory)
    assert read_checkpoint(directory).step == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


# ---- bad input: nothing loaded --------------------------------------------------------------------------------------
def flip_byte(path: Path, offset: int = -5) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def edit_manifest(change: Callable[[dict], None], *, fix_hash: bool = False) -> Callable[[Path], None]:
    def edit(directory: Path) -> None:
        path = directory / MANIFEST_FILE
        manifest = json.loads(path.read_text())
        change(manifest)
        if fix_hash:
            manifest["manifest_sha256"] = manifest_digest(manifest)
        path.write_text(json.dumps(manifest))

    return edit


def set_in(key: str, sub: str, value: object) -> Callable[[dict], None]:
    return lambda m: m[key].__setitem__(sub, value)


CORRUPTIONS: dict[str, tuple[Callable[[Path], None], str]] = {
    "flip weights byte": (lambda d: flip_byte(d / WEIGHTS_FILE), "sha256 mismatch"),
    "flip optimizer byte": (lambda d: flip_byte(d / OPTIMIZER_FILE, 4000), "sha256 mismatch"),
    "flip header byte": (lambda d: flip_byte(d / WEIGHTS_FILE, 20), "sha256 mismatch"),
    "truncate weights": (lambda d: truncate(d / WEIGHTS_FILE), "truncated"),
    "truncate optimizer": (lambda d: truncate(d / OPTIMIZER_FILE), "truncated"),
    "truncate manifest": (lambda d: truncate(d / MANIFEST_FILE), "not valid JSON"),
    "delete optimizer": (lambda d: (d / OPTIMIZER_FILE).unlink(), "missing"),
    "edit alpha": (edit_manifest(set_in("hparams", "alpha", 16.0)), "modified after it was written"),
    "edit rank": (edit_manifest(set_in("hparams", "rank", 2)), "modified after it was written"),
    "edit step": (edit_manifest(lambda m: m.__setitem__("step", 0)), "modified after it was written"),
    "edit user_metadata": (edit_manifest(set_in("user_metadata", "run", "x")), "modified after it was written"),
    "edit alpha, fix manifest hash": (
        edit_manifest(set_in("hparams", "alpha", 16.0), fix_hash=True),
        r"disagrees with adapter_model.safetensors on \['hparams'\]",
    ),
    "edit file hash": (
        edit_manifest(lambda m: m["files"][WEIGHTS_FILE].__setitem__("sha256", "0" * 64), fix_hash=True),
        "sha256 mismatch",
    ),
    "path trick in files": (
        edit_manifest(lambda m: m["files"].__setitem__("../x", {"size": 1, "sha256": "0"}), fix_hash=True),
        "unexpected files",
    ),
    "sampler with optimizer": (
        edit_manifest(lambda m: m.__setitem__("kind", "sampler"), fix_hash=True),
        "must not carry optimizer",
    ),
    "future version": (
        edit_manifest(lambda m: m.__setitem__("format_version", 2), fix_hash=True),
        "format version 2 is not supported",
    ),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupted_checkpoint_is_refused_nothing_loaded(case: str, saved: Path, tiny_dir: Path, tmp_path: Path) -> None:
    corrupt, message = CORRUPTIONS[case]
    directory = tmp_path / "ckpt"
    shutil.copytree(saved, directory)
    corrupt(directory)
    model, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    fresh = build_engine(model, EngineConfig(num_slots=2, max_rank=8))
    with pytest.raises(InvalidRequestError, match=message):
        load_into_engine(fresh, read_checkpoint(directory), "b", with_optimizer=True, existing=False)
    assert fresh.adapters == {} and fresh.free_slots == 2
    assert fresh.optimizer.data.abs().sum() == 0 and fresh.optimizer.exp_avg_flat.abs().sum() == 0


def test_missing_checkpoint_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError):
        read_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotFoundError):
        read_checkpoint(tmp_path / "empty")


def test_inconsistent_state_is_not_written(state: CheckpointState, tmp_path: Path) -> None:
    bad = {
        "sampler with optimizer": dataclasses.replace(state, kind="sampler"),
        "rank vs shapes": dataclasses.replace(state, rank=3),
        "alpha": dataclasses.replace(state, alpha=float("nan")),
        "metadata": dataclasses.replace(state, user_metadata={"x": object()}),
        "missing module": dataclasses.replace(state, weights=dict(list(state.weights.items())[1:])),
    }
    for case, s in bad.items():
        with pytest.raises(InvalidRequestError):
            write_checkpoint(s, tmp_path / "ckpt")
        assert not any(tmp_path.iterdir()), case


# ---- disk full during save -------------------------------------------------------------------------------------------
SAVE_UNDER_LIMIT = """
import dataclasses, errno, resource, signal, sys
from pathlib import Path
from loraplex.workers.state.checkpoint import read_checkpoint, write_checkpoint

directory = Path(sys.argv[1])
state = read_checkpoint(directory)
newer = dataclasses.replace(
    state, step=state.step + 1, weights={k: (a + 1, b + 1) for k, (a, b) in state.weights.items()}
)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    write_checkpoint(newer, directory)
except OSError as exc:
    print("OSError", type(exc).__name__, errno.errorcode.get(exc.errno))
    sys.exit(3)
print("written")
"""


def test_write_failure_leaves_previous_checkpoint_intact(state: CheckpointState, tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    write_checkpoint(state, directory)
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    assert len(before[WEIGHTS_FILE]) > 4096
    proc = subprocess.run(
        [sys.executable, "-c", SAVE_UNDER_LIMIT, str(directory)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "OSError" in proc.stdout and "EFBIG" in proc.stdout, proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary directory left behind
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
    assert_equal_states(read_checkpoint(directory), state)


# ---- names -------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["final", "000020", "step-3_a.b", "A" * 128, "...", ".hidden", "a..b"])
def test_valid_names(name: str) -> None:
    assert validate_checkpoint_name(name) == name


@pytest.mark.parametrize(
    "name",
    ["", ".", "..", "../x", "a/b", "/abs", "a\\b", "..\\x", "x" * 129, "a b", "é", "a\x00b", "a\nb", "~root", None, 7],
)
def test_path_tricks_rejected(name: object) -> None:
    with pytest.raises(InvalidRequestError, match="invalid checkpoint name"):
        validate_checkpoint_name(name)
