"""The README's quick tour, run as written: the tour's first shell block (the embedded stack in the background, a tenant),
then its first Python block against that stack (the default port 8700), then the same with the Tinker SDK (its second
Python block, with TINKER_BASE_URL and TINKER_API_KEY as the README says), then the OpenAI client's block against
the sampler checkpoint the first block saved, then the stack stopped. The harness only
waits for the gateway between the two blocks, as a reader would."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_quick_tour_runs_as_written(tmp_path: Path) -> None:
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", 8700)) == 0:
            pytest.fail("port 8700 (the README's) is taken: stop whatever listens there")
    tour = (ROOT / "README.md").read_text().split("## A quick tour", 1)[1]  # not the make demo / make test block
    shell = re.findall(r"```sh\n(.*?)```", tour, flags=re.S)[0]
    python_blocks = re.findall(r"```python\n(.*?)```", tour, flags=re.S)  # ours, then the same with the Tinker SDK
    python = python_blocks[0]
    assert "loraplex serve --embedded" in shell and "make " not in shell
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")} | {"LORAPLEX_HOME": str(tmp_path)}
    log = tmp_path / "tour.log"
    script = f'{shell}\necho "TOUR_KEY=$KEY"\necho "TOUR_PID=$!"\n'
    with open(log, "w") as out:
        subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=120,
                       check=True)  # fmt: skip
    found = dict(re.findall(r"^(TOUR_KEY|TOUR_PID)=(\S+)$", log.read_text(), flags=re.M))
    pid = int(found["TOUR_PID"])
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get("http://127.0.0.1:8700/v1/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        done = subprocess.run([sys.executable, "-c", python], cwd=tmp_path, env=env | {"KEY": found["TOUR_KEY"]},
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr + log.read_text()[-3000:]
        assert "tinker://" in done.stdout  # the checkpoint listing printed at the end
        tinker_env = env | {"TINKER_BASE_URL": "http://127.0.0.1:8700", "TINKER_API_KEY": found["TOUR_KEY"]}
        sdk = subprocess.run([sys.executable, "-c", python_blocks[1]], cwd=tmp_path, env=tinker_env,
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        assert sdk.returncode == 0, sdk.stdout + sdk.stderr + log.read_text()[-3000:]
        assert "tinker://" in sdk.stdout  # the SDK's checkpoint listing
        oai = subprocess.run([sys.executable, "-c", python_blocks[2]], cwd=tmp_path, env=env | {"KEY": found["TOUR_KEY"]},
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        assert oai.returncode == 0, oai.stdout + oai.stderr + log.read_text()[-3000:]
    finally:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
