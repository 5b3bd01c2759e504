"""Finding a pool's processes from /proc (Linux)."""

from __future__ import annotations

from pathlib import Path


def rank_processes(parent: int) -> list[int]:
    """Live (non-zombie) children of `parent` started by multiprocessing (the spawned ranks)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_bytes().split(b") ")[1].split()
            if int(stat[1]) == parent and stat[0] != b"Z" and b"spawn_main" in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit is reaped by whoever adopted it, init maybe, and maybe late)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False
