"""benchmarks/bench_rl.py end to end on the CPU with the tiny model and small sizes: the embedded stack starts, two
tenants run RL iterations at once (a sampler copy, P x S samples, importance_sampling over them, optim_step), and the
JSON holds each tenant's split, every requested token sampled and trained, and the pool's sampler sizing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_rl_runs_an_iteration_for_one_and_two_tenants(tmp_path: Path) -> None:
    out = tmp_path / "rl.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_rl.py"), "--model", "tiny", "--device", "cpu",
           "--tenants", "1,2", "--prompts", "2", "--samples", "3", "--new-tokens", "5", "--prompt-len", "6",
           "--iterations", "1", "--warmup", "0", "--home", str(tmp_path / "home"), "--out", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "new tok/s" in done.stdout
    results = json.loads(out.read_text())
    assert any("32 rows (auto)" in line for line in results["sampler_sizing"])  # the CPU's ceiling, from memory
    for n in (1, 2):
        got = results[f"tenants/{n}"]
        assert len(got["per_tenant"]) == n and got["new_tok_s_all"] > 0
        for rows in got["iterations"]:
            (it,) = rows
            assert it["new_tokens"] == 2 * 3 * 5  # stop=[]: every sample runs its max_tokens
            assert it["train_tokens"] == 2 * 3 * (6 + 5 - 1)
            assert abs(it["sync_s"] + it["sample_s"] + it["train_s"] - it["wall_s"]) < 1e-6
