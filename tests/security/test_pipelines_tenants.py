"""Pipelines shared fairly between tenants, and answering no server paths. A real
embedded stack (redis-server, SQLite, the gateway, a CPU pool on the tiny model) and a real Celery worker (threads,
two slots: `celery -A loraplex.pipelines.app:celery_app worker`), with a cap of one running pipeline per tenant.

A tenant's sweep queued first must not take every worker slot (one FIFO Celery queue) while another tenant's one-step
pipeline waited for whole pipelines to end. Now each tenant trains at most `max_running_pipelines_per_tenant` at
once (its others wait without holding a slot), and may have at most `max_pipelines_per_tenant` queued or running.
`tokenizer` is a registered model or a folder under the
tokenizer root, else a 400 that reads the same whether the path exists or not.
`export_path` is the API path the tenant downloads the export from, never a folder of the workers."""

from __future__ import annotations

import contextlib
import os
import stat
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from loraplex.client import ServiceClient
from loraplex.errors import CapacityError, ConflictError, InvalidRequestError
from tests.helpers.celery_workers import CeleryWorker
from tests.security.harness import running_stack, tenant_key

MAX_PIPELINES = 6
WORDS = ["apple", "river", "stone", "cloud", "maple", "tiger", "lemon", "piano"]


def records(n: int) -> list[dict]:
    return [{"prompt": f"reverse {WORDS[i % 8]}:", "completion": f" {WORDS[i % 8][::-1]}"} for i in range(n)]


def submission(name: str, n_records: int, epochs: int, **extra) -> dict:
    config = {"name": name, "dataset": {"max_tokens": 32}, "seed": 1, "epochs": epochs, "batch_size": 1,
              "lora": {"rank": 4}, "checkpoint_every": 0, "export": False, **extra}  # fmt: skip
    return {"config": config, "train": records(n_records)}


@pytest.fixture(scope="module")
def pipe_stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("pipelines"), max_pipelines_per_tenant=MAX_PIPELINES) as stack:
        env = stack.child_env()
        env.update({"LORAPLEX_MAX_RUNNING_PIPELINES_PER_TENANT": "1", "LORAPLEX_PIPELINE_SLOT_WAIT_SECONDS": "0.5",
                    "LORAPLEX_PIPELINE_LEASE_SECONDS": "3", "LORAPLEX_PIPELINE_STEP_TIMEOUT_SECONDS": "120",
                    "PYTHONPATH": str(Path(__file__).resolve().parents[2])})  # fmt: skip
        worker = CeleryWorker("fair", env, stack.log_dir, concurrency=2).start()
        try:
            yield stack
        finally:
            worker.stop()


def submit(client: ServiceClient, body: dict) -> dict:
    """POST /v1/pipelines with the records inline (what client.submit_pipeline sends after reading the files)."""
    return client._transport.request("POST", "/v1/pipelines", json=body)


def stamp(value: str) -> float:
    return datetime.fromisoformat(value).timestamp()


def test_a_sweep_does_not_hold_back_another_tenants_pipeline(pipe_stack) -> None:
    """Tenant B's one-step pipeline alone, then again right after tenant A queued a 4-point sweep of 200 steps per
    point (two worker slots: without the per-tenant cap A's points would take both and B's task would wait behind A's others): B's
    pipeline ends before any of A's points, within 2x its time alone (+1 s of queue polling)."""
    a = ServiceClient(pipe_stack.base_url, tenant_key(pipe_stack, "sweeper"))
    b = ServiceClient(pipe_stack.base_url, tenant_key(pipe_stack, "small"))
    one_step = submission("one-step", 1, 1, tokenizer="tiny")  # a registered model name is a tokenizer

    def b_run() -> tuple[float, dict]:
        start = time.monotonic()
        pid = submit(b, one_step)["pipelines"][0]["id"]
        done = b.pipelines.wait(pid, timeout=120, poll_s=0.1)
        return time.monotonic() - start, done

    b_run()  # warms the worker (imports, the tokenizer)
    alone = [b_run()[0] for _ in range(2)]
    sweep = submit(a, submission("sweep", 40, 5, sweep={"grid": {"seed": [1, 2, 3, 4]}}))
    assert len(sweep["pipelines"]) == 4
    try:
        during, done = b_run()
        assert done["state"] == "succeeded", done["error"]
        points = [a.pipelines.get(p["id"]) for p in sweep["pipelines"]]
        print(f"B's one-step pipeline: alone {statistics.median(alone):.2f} s, beside A's sweep {during:.2f} s; "
              f"A's points: {[p['state'] + ' ' + str(p['step']) for p in points]}")  # fmt: skip
        assert all(not p["finished_at"] or stamp(p["finished_at"]) > stamp(done["finished_at"]) for p in points)
        assert sum(p["state"] == "running" for p in points) <= 1  # the cap: one of A's at a time
        assert during <= 2 * statistics.median(alone) + 1.0, (during, alone)
    finally:
        for p in sweep["pipelines"]:
            with contextlib.suppress(ConflictError):  # one that ended meanwhile
                a.pipelines.cancel(p["id"])


def test_pipelines_past_the_tenants_quota_are_429(pipe_stack) -> None:
    """MAX_PIPELINES queued or running per tenant: a sweep that would pass it is a 429 naming
    LORAPLEX_MAX_PIPELINES_PER_TENANT, nothing of it queued; another tenant is not held to this one's count."""
    a = ServiceClient(pipe_stack.base_url, tenant_key(pipe_stack, "many"))
    first = submit(a, submission("first", 40, 5, sweep={"grid": {"seed": [1, 2, 3, 4]}}))
    try:
        with pytest.raises(CapacityError, match="LORAPLEX_MAX_PIPELINES_PER_TENANT"):
            submit(a, submission("more", 40, 5, sweep={"grid": {"seed": [5, 6, 7]}}))  # 4 + 3 > 6
        assert a.pipelines.list()["total_count"] == 4
        other = ServiceClient(pipe_stack.base_url, tenant_key(pipe_stack, "other"))
        more = submit(other, submission("others", 40, 5, sweep={"grid": {"seed": [5, 6, 7]}}))
        for p in more["pipelines"]:
            with contextlib.suppress(ConflictError):
                other.pipelines.cancel(p["id"])
    finally:
        for p in first["pipelines"]:
            with contextlib.suppress(ConflictError):
                a.pipelines.cancel(p["id"])
    assert submit(a, submission("after-cancel", 40, 5, sweep={"grid": {"seed": [5, 6, 7]}}))  # room again
    for p in a.pipelines.list()["pipelines"]:
        with contextlib.suppress(ConflictError):
            a.pipelines.cancel(p["id"])


def test_tokenizer_must_be_a_model_or_under_the_root_with_one_answer(pipe_stack) -> None:
    """Paths outside the tokenizer root are a 400 before anything is queued, and the answer is the same for a folder
    that exists and one that does not (no existence oracle); a folder under the root that is missing fails the
    pipeline with a message naming the config's value, not the server's path."""
    client = ServiceClient(pipe_stack.base_url, tenant_key(pipe_stack, "prober"))
    answers = {}
    for value in ("/etc", "/no/such/folder", "../../etc", "~/x", "/tmp"):
        with pytest.raises(InvalidRequestError) as caught:
            submit(client, submission("probe", 1, 1, tokenizer=value))
        answers[value] = caught.value.message.replace(repr(value), "VALUE")
    assert len(set(answers.values())) == 1, answers
    assert "LORAPLEX_PIPELINE_TOKENIZER_ROOT" in answers["/etc"]
    assert client.pipelines.list()["total_count"] == 0  # nothing was queued
    pid = submit(client, submission("missing", 1, 1, tokenizer="missing-folder"))["pipelines"][0]["id"]
    failed = client.pipelines.wait(pid, timeout=60, poll_s=0.1)
    assert failed["state"] == "failed" and "'missing-folder' is not a tokenizer folder" in failed["error"]
    assert str(pipe_stack.settings.home) not in failed["error"]


def test_answers_name_no_server_path_and_the_export_downloads(pipe_stack, tmp_path) -> None:
    """A succeeded pipeline's answer (the client's, `loraplex pipelines status ID`) holds no path of the server; its
    export_path is the API path its PEFT export downloads from (the client and `loraplex pipelines export`); on the
    server the export and the dataset are owner-only files."""
    key = tenant_key(pipe_stack, "exporter")
    client = ServiceClient(pipe_stack.base_url, key)
    pid = submit(client, submission("exported", 2, 1, export=True))["pipelines"][0]["id"]
    done = client.pipelines.wait(pid, timeout=120, poll_s=0.1)
    assert done["state"] == "succeeded", done["error"]
    home = str(pipe_stack.settings.home)
    raw = client._transport._sync.get(f"/v1/pipelines/{pid}").text
    assert home not in raw and done["export_path"] == f"/v1/pipelines/{pid}/export", done["export_path"]
    folder = client.pipelines.download_export(pid, tmp_path / "peft")
    assert (folder / "adapter_model.safetensors").is_file() and (folder / "adapter_config.json").is_file()
    env = {**os.environ, "LORAPLEX_BASE_URL": pipe_stack.base_url, "LORAPLEX_API_KEY": key, "COLUMNS": "200"}
    status = subprocess.run([sys.executable, "-m", "loraplex.launch.cli", "pipelines", "status", pid], env=env,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert status.returncode == 0 and "export:" in status.stdout and home not in status.stdout, status.stderr
    out = subprocess.run([sys.executable, "-m", "loraplex.launch.cli", "pipelines", "export", pid, "--out",
                          str(tmp_path / "cli")], env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0 and (tmp_path / "cli" / "adapter_model.safetensors").is_file(), out.stderr
    server = [p for p in (Path(home) / "pipelines").rglob("*") if p.is_file()]
    server += [p for p in Path(pipe_stack.settings.resolved_blob_root).rglob("train.jsonl")]
    assert server and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in server), [
        (p.name, oct(stat.S_IMODE(p.stat().st_mode))) for p in server
    ]


def test_the_gateways_preset_names_are_the_registrys() -> None:
    """The gateway names the model presets without importing torch; they are the registry's."""
    from loraplex.models.presets import SHAPE_PRESETS, TINY_SHAPES
    from loraplex.service.pipeline_tokenizer import PRESET_NAMES

    assert frozenset({*TINY_SHAPES, *SHAPE_PRESETS}) == PRESET_NAMES
