"""`loraplex demo` (what `make demo` runs) as a user runs it: a separate process that must exit 0, write its report
with four falling losses, and leave no process behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def _processes_mentioning(text: str) -> list[str]:
    """Live processes whose command line or environment contains `text` (the demo's state folder)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            blob = (proc / "cmdline").read_bytes() + (proc / "environ").read_bytes()
            if text.encode() in blob and b"Z" not in (proc / "stat").read_bytes().split(b") ")[1][:1]:
                found.append(proc.name)
        except OSError:
            continue
    return found



def test_demo_trains_four_tenants_and_cleans_up(tmp_path):
    report = tmp_path / "report.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "loraplex.launch.cli", "demo", "--report", str(report), "--home", str(tmp_path / "home")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    tenants = json.loads(report.read_text())["tenants"]
    assert sorted(t["name"] for t in tenants) == ["alphabet", "arithmetic", "counting", "greetings"]
    assert len({t["model_id"] for t in tenants}) == 4
    for t in tenants:
        assert t["steps"] == 30 and t["last_loss"] < 0.5 * t["first_loss"], t
    # Nothing of the stack survives the demo: no redis-server, pool or gateway process left.
    assert not (tmp_path / "home" / "pool-default.ready").exists()
    assert _processes_mentioning(str(tmp_path / "home")) == []
