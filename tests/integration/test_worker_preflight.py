"""`loraplex worker` as an operator starts it: without LORAPLEX_REDIS_URL it exits naming the variable (before: an
error that did not name it); on a database nobody migrated it brings the schema to head and starts (before: a SQL
traceback)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from loraplex.storage.db import current_revision


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    return env | {"LORAPLEX_HOME": str(home), "LORAPLEX_BASE_MODEL": "tiny", "LORAPLEX_POOL": f"pre-{home.name}"} | extra


def test_without_a_redis_url_the_worker_exits_naming_the_setting(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "loraplex.launch.cli", "worker"], env=_env(tmp_path), capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode != 0 and "LORAPLEX_REDIS_URL is not set" in done.stderr
    assert "Traceback" not in done.stderr


def test_on_an_unmigrated_database_the_worker_migrates_and_starts(tmp_path: Path, redis_url: str) -> None:
    database = tmp_path / "fresh.sqlite"
    env = _env(tmp_path, LORAPLEX_REDIS_URL=redis_url, LORAPLEX_DATABASE_URL=f"sqlite:///{database}")
    worker = subprocess.Popen([sys.executable, "-m", "loraplex.launch.cli", "worker"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        ready = tmp_path / f"pool-pre-{tmp_path.name}.ready"
        deadline = time.monotonic() + 120
        while not ready.exists() and worker.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ready.exists(), worker.stdout.read() if worker.poll() is not None else "not ready in 120 s"
        assert current_revision(f"sqlite:///{database}") is not None
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)
