"""The pool's ready file: `HOME/pool-<name>.ready`, holding the pool process's pid, written once its model is loaded
and its dispatcher reads (the embedded stack waits for it), removed only by the process whose pid it holds."""

from __future__ import annotations

import os
from pathlib import Path

from loraplex.settings import Settings


def ready_file(settings: Settings) -> Path:
    return settings.home / f"pool-{settings.pool}.ready"


def write_ready_file(ready: Path) -> None:
    ready.write_text(str(os.getpid()))


def clear_stale_ready_file(ready: Path) -> None:
    """The pool's new lease holder, before it loads anything: a ready file now is a dead holder's (a SIGKILL leaves
    it behind), and a healthcheck reading it would call this pool ready while it loads."""
    ready.unlink(missing_ok=True)


def remove_ready_file(ready: Path) -> None:
    """Remove the ready file if it holds this process's pid (another pool process's file is left alone)."""
    try:
        if ready.read_text().strip() == str(os.getpid()):
            ready.unlink(missing_ok=True)
    except FileNotFoundError:
        pass
