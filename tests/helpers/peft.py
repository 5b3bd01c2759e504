"""An engine adapter's PEFT folder, the way the service writes one: the state saved as a checkpoint (the workers'
format), then exported from that folder by service/peft_export.py (the one export, torch-free)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from loraplex.service.peft_export import export_checkpoint
from loraplex.workers.state.checkpoint import CheckpointState, write_checkpoint


def export_peft(
    state: CheckpointState, out_dir: Path, *, base_model_path: str | None = None, tokenizer_dir: Path | None = None
) -> Path:
    """`state` as a PEFT folder in `out_dir` (returned); the checkpoint in between is removed."""
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_checkpoint(state, Path(tmp) / "checkpoint").directory
        return export_checkpoint(checkpoint, out_dir, base_model_path=base_model_path, tokenizer_dir=tokenizer_dir)
