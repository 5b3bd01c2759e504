"""Several gateway worker processes of one server (uvicorn --workers) share their counts: with the folder
`multiprocess_env` gives them, a scrape of any worker answers the sum over all of them (api/metrics.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from loraplex.api.metrics import MULTIPROC_ENV, multiprocess_env

ROOT = Path(__file__).resolve().parents[3]

COUNT = """
from loraplex.api.metrics import LATENCY, REQUESTS
for _ in range({n}):
    REQUESTS.labels("/v1/adapters/{{model_id}}/forward_backward", "POST", "202").inc()
    LATENCY.labels("/v1/adapters/{{model_id}}/forward_backward", "POST").observe(0.01)
"""
SCRAPE = "import sys; from loraplex.api.metrics import exposition; sys.stdout.write(exposition().decode())"


def _python(code: str, env: dict[str, str]) -> str:
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_worker_processes_share_their_counts(tmp_path: Path) -> None:
    folder = tmp_path / "gateway-metrics"
    (folder).mkdir()
    (folder / "stale.db").write_bytes(b"left by an earlier run")
    extra = multiprocess_env(folder, workers=2)
    assert extra == {MULTIPROC_ENV: str(folder)} and not (folder / "stale.db").exists()  # emptied
    assert multiprocess_env(tmp_path / "single", workers=1) == {}  # one worker counts in process
    env = {**os.environ, **extra, "PYTHONPATH": str(ROOT)}
    _python(COUNT.format(n=3), env)  # two "workers", one after the other (their files stay)
    _python(COUNT.format(n=4), env)
    samples = {
        (s.name, s.labels.get("status")): s.value
        for family in text_string_to_metric_families(_python(SCRAPE, env))
        for s in family.samples
    }
    assert samples[("loraplex_gateway_requests_total", "202")] == 7
    assert samples[("loraplex_gateway_request_seconds_count", None)] == 7
