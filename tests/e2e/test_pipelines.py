"""Offline fine-tuning pipelines end to end: the session's embedded stack (redis, SQLite, gateway, one CPU pool on the
tiny model), real Celery worker processes (`celery -A loraplex.pipelines.app:celery_app worker`, threads pool) on
the stack's Redis, pipelines submitted through the client and the CLI. The workers run with a short visibility
timeout and lease (seconds, not the production hour and half-minute) so a killed worker's pipeline is taken over
within the test."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import redis
from safetensors.torch import load_file

from loraplex.client import ServiceClient
from loraplex.errors import ForbiddenError, InvalidRequestError, NotFoundError
from loraplex.queue import keys
from loraplex.storage.db import make_db_engine, session_factory
from loraplex.storage.models import Pipeline
from loraplex.storage.repositories import unit_of_work
from tests.helpers.celery_workers import CeleryBeat, CeleryWorker
from tests.helpers.stack import create_tenants, tenant_clients

WORDS = ["apple", "river", "stone", "cloud", "maple", "tiger", "lemon", "piano", "ocean", "candle", "forest", "silver"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")  # fmt: skip


def prompt_completion(n: int) -> list[dict]:
    return [{"prompt": f"reverse {WORDS[i % len(WORDS)]}:", "completion": f" {WORDS[i % len(WORDS)][::-1]}"}
            for i in range(n)]  # fmt: skip


def chat(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"spell {w}"}, {"role": "assistant", "content": " ".join(w)}]}
            for w in (WORDS[i % len(WORDS)] for i in range(n))]  # fmt: skip


def write_jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def config(train: str, **overrides) -> dict:
    base = {"name": "p", "dataset": {"train": train, "eval_fraction": 0.25, "max_tokens": 64}, "seed": 7, "epochs": 2,
            "batch_size": 3, "lora": {"rank": 4}, "eval_every": 2, "checkpoint_every": 2,
            "optimizer": {"learning_rate": 5e-3, "warmup_steps": 1, "schedule": "cosine"}}  # fmt: skip
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return base


@pytest.fixture(scope="module")
def worker_env(stack) -> dict[str, str]:
    env = stack.child_env()
    env.update({"LORAPLEX_CELERY_VISIBILITY_TIMEOUT_SECONDS": "4", "LORAPLEX_CELERY_RESTORE_INTERVAL_SECONDS": "1",
                "LORAPLEX_PIPELINE_LEASE_SECONDS": "3", "LORAPLEX_PIPELINE_STEP_TIMEOUT_SECONDS": "120",
                "LORAPLEX_MAX_RUNNING_PIPELINES_PER_TENANT": "4",  # the 2x2 sweep below runs all at once
                "LORAPLEX_PIPELINE_SLOT_WAIT_SECONDS": "1",  # a suspended tenant's pipeline looks again every second
                "PYTHONPATH": str(Path(__file__).resolve().parents[2])})  # fmt: skip
    return env


@pytest.fixture(scope="module")
def workers(stack, worker_env):
    running = [CeleryWorker(f"w{i}", worker_env, stack.log_dir) for i in (1, 2)]
    try:
        for worker in running:
            worker.start()
        yield running
    finally:
        for worker in running:
            worker.stop()


@pytest.fixture(scope="module")
def tokenizer_with_chat_template(stack) -> str:
    """The tiny preset's tokenizer (which has no chat template) with one added, for chat records: a folder under the
    pipelines' tokenizer root (home/tokenizers), named relative to it."""
    src = stack.settings.resolved_model_cache / "tiny"
    out = stack.settings.home / "tokenizers" / "chat"
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).exists():
            (out / name).write_bytes((src / name).read_bytes())
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return "chat"


def wait_for(predicate, timeout: float, what: str, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def kill_past_a_checkpoint(stack, pipeline_id: str, total: int, kill) -> tuple[int, int]:
    """Call `kill(pid)` with the pid of the process running the pipeline (its lease names it) as soon as the pipeline
    is past one of its checkpoints and not past half of its steps; returns (step, last checkpoint step) seen then.
    The row is read straight from SQLite every millisecond: an unloaded CPU runs a tiny-model step in ~10 ms, too
    fast for HTTP polling to catch a window of a few steps."""
    lease = redis.Redis.from_url(stack.settings.redis_url)
    holder = wait_for(lambda: lease.get(keys.pipeline_runner(pipeline_id)), 60, "the pipeline's lease", poll=0.001)
    pid = int(holder.decode().split(":")[1])
    db = sqlite3.connect(f"file:{stack.settings.home / 'loraplex.db'}?mode=ro", uri=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            step, checkpoint = db.execute(
                "SELECT step, last_checkpoint_step FROM pipelines WHERE id = ?", (pipeline_id,)
            ).fetchone()
            if checkpoint and checkpoint < step <= total // 2:
                kill(pid)
                return step, checkpoint
            if step > total // 2:
                raise AssertionError(f"the pipeline ran past step {total // 2} unseen (step {step})")
            time.sleep(0.001)
    finally:
        db.close()
    raise AssertionError("the pipeline never got past a checkpoint")


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loraplex.launch.cli", *args], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def cli_env(stack, key: str) -> dict[str, str]:
    return {**os.environ, "LORAPLEX_BASE_URL": stack.base_url, "LORAPLEX_API_KEY": key, "COLUMNS": "160"}


def tenant_clients_for(stack, key: str) -> ServiceClient:
    return ServiceClient(stack.base_url, key)


def exported_weights(client: ServiceClient, pipeline: dict, tmp_path: Path) -> dict:
    """The pipeline's export, downloaded through the API (its `export_path`)."""
    folder = client.pipelines.download_export(pipeline["id"], tmp_path / f"export-{pipeline['id']}")
    return load_file(str(folder / "adapter_model.safetensors"))


def test_three_tenants_pipelines_run_to_their_end(stack, workers, tmp_path, tokenizer_with_chat_template):
    """Three tenants' pipelines at once (prompt/completion with a held-out split, chat records through a chat template,
    an eval file with a linear schedule), through the client and `loraplex finetune`: each succeeds with every step,
    its eval losses on the cadence, falling, and a PEFT export; `loraplex pipelines status` shows them."""
    keys_ = create_tenants(stack, "pl-ana", "pl-ben", "pl-cy")
    clients = {name: tenant_clients_for(stack, key) for name, key in keys_.items()}
    a = config(write_jsonl(tmp_path / "a.jsonl", prompt_completion(12)), name="ana")
    b = config(write_jsonl(tmp_path / "b.jsonl", chat(12)), name="ben", tokenizer=tokenizer_with_chat_template)
    c = config(
        write_jsonl(tmp_path / "c.jsonl", prompt_completion(8)),
        name="cy",
        eval_every=3,
        optimizer={"schedule": "linear", "warmup_steps": 0},
        dataset={"eval": write_jsonl(tmp_path / "c-eval.jsonl", prompt_completion(4)), "eval_fraction": 0.0},
    )
    (tmp_path / "cy.yaml").write_text(json.dumps(c))  # JSON is YAML
    ids = {
        "pl-ana": clients["pl-ana"].submit_pipeline(a)["pipelines"][0]["id"],
        "pl-ben": clients["pl-ben"].submit_pipeline(b)["pipelines"][0]["id"],
    }
    out = cli(cli_env(stack, keys_["pl-cy"]), "finetune", str(tmp_path / "cy.yaml"))
    assert out.returncode == 0, out.stderr
    ids["pl-cy"] = out.stdout.split("pipeline ", 1)[1].split()[0]
    done = {name: clients[name].pipelines.wait(ids[name], timeout=150) for name in ids}
    for name, p in done.items():
        assert p["state"] == "succeeded", (name, p["error"])
        assert p["step"] == p["total_steps"] and p["attempt"] == 1
        assert [t[0] for t in p["train_losses"]] == list(range(1, p["total_steps"] + 1))
        assert p["export_path"] == f"/v1/pipelines/{p['id']}/export"  # no server path
        assert (clients[name].pipelines.download_export(p["id"], tmp_path / name) / "adapter_config.json").is_file()
        assert p["final_checkpoint"].endswith("/sampler_weights/final")
    assert done["pl-ana"]["total_steps"] == 2 * 3 and [e[0] for e in done["pl-ana"]["eval_losses"]] == [2, 4, 6]
    assert [e[0] for e in done["pl-cy"]["eval_losses"]] == [3, 6]  # every 3 steps; 6 is also the last
    for p in done.values():
        assert p["eval_losses"][-1][1] < p["eval_losses"][0][1]
    status = cli(cli_env(stack, keys_["pl-ana"]), "pipelines", "status")
    assert status.returncode == 0 and "ana" in status.stdout and "succeeded" in status.stdout and "6/6" in status.stdout
    detail = cli(cli_env(stack, keys_["pl-ana"]), "pipelines", "status", ids["pl-ana"])
    assert "export:" in detail.stdout and "━" in detail.stdout  # the progress bar
    with pytest.raises(NotFoundError):
        clients["pl-ben"].pipelines.get(ids["pl-ana"])  # another tenant's pipeline: a 404 like a made-up id


def test_killed_worker_resumes_from_checkpoint_with_the_same_weights(stack, workers, worker_env, tmp_path):
    """One run of a config to its end; then the same config again, and the Celery worker running it is SIGKILLed
    past one of its checkpoints (every 3 steps) and before half of its 24 steps. A restarted worker takes the task
    over (unacked, handed out again past the visibility timeout, once the lease lapsed), creates an adapter from the
    checkpoint and finishes: its train and eval losses and exported weights equal the uninterrupted run's bit for bit. (The two run one after the other: run at once, their steps
    would share plans, and a different packing changes fp32 sums in the last bits on CPU.)"""
    client = tenant_clients(stack, "pl-dee")["pl-dee"]
    cfg = config(
        write_jsonl(tmp_path / "d.jsonl", prompt_completion(32)), batch_size=2, checkpoint_every=3, eval_every=3
    )  # 24 train records / 2 = 12 steps an epoch, 24 in all
    reference = client.submit_pipeline({**cfg, "name": "reference"})["pipelines"][0]["id"]
    ref = client.pipelines.wait(reference, timeout=120)
    victim = client.submit_pipeline({**cfg, "name": "victim"})["pipelines"][0]["id"]
    by_pid = {w.pid: w for w in workers}
    killed: list[CeleryWorker] = []
    kill_past_a_checkpoint(stack, victim, 24, lambda pid: (killed.append(by_pid[pid]), by_pid[pid].kill()))
    workers.append(CeleryWorker(f"{killed[0].name}r", worker_env, stack.log_dir).start())  # a restarted worker
    resumed = client.pipelines.wait(victim, timeout=120)
    assert ref["state"] == resumed["state"] == "succeeded", (ref["error"], resumed["error"])
    assert ref["attempt"] == 1 and resumed["attempt"] == 2
    assert resumed["model_id"].endswith("-2") and resumed["final_checkpoint"].startswith(
        f"tinker://{resumed['model_id']}"
    )
    assert [t[0] for t in resumed["train_losses"]] == list(range(1, 25))
    assert resumed["eval_losses"] == ref["eval_losses"] and [e[0] for e in ref["eval_losses"]] == list(range(3, 25, 3))
    assert resumed["train_losses"] == ref["train_losses"]
    a, b = exported_weights(client, ref, tmp_path), exported_weights(client, resumed, tmp_path)
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
    assert client.get_run(f"pipeline-{victim}-1")["status"] == "deleted"  # the interrupted run's adapter


def test_sweep_2x2_runs_concurrently_and_writes_its_report(stack, workers, tmp_path):
    """A 2x2 grid (ranks x learning rates): four pipelines run at once; when the last ends the report is written:
    a markdown and a CSV table with a row per point, and an SVG plot with one eval-loss line per point."""
    key = create_tenants(stack, "pl-eve")["pl-eve"]
    client = tenant_clients_for(stack, key)
    cfg = config(
        write_jsonl(tmp_path / "e.jsonl", prompt_completion(12)),
        name="grid",
        checkpoint_every=0,
        sweep={"grid": {"lora.rank": [4, 8], "optimizer.learning_rate": [1e-3, 1e-2]}},
    )
    submitted = client.submit_pipeline(cfg)
    sweep_id = submitted["sweep_id"]
    assert len(submitted["pipelines"]) == 4
    points = [client.pipelines.wait(p["id"], timeout=150) for p in submitted["pipelines"]]
    assert all(p["state"] == "succeeded" for p in points)
    assert {(p["config"]["lora"]["rank"], p["config"]["optimizer"]["learning_rate"]) for p in points} == {
        (4, 1e-3), (4, 1e-2), (8, 1e-3), (8, 1e-2)}  # fmt: skip
    started, ended = max(p["started_at"] for p in points), min(p["finished_at"] for p in points)
    assert started < ended  # all four were running at once
    out = tmp_path / "report"
    wait_for(lambda: cli(cli_env(stack, key), "pipelines", "report", sweep_id, "--out", str(out)).returncode == 0,
             30, "the sweep's report")  # fmt: skip
    rows = list(csv.DictReader(io.StringIO((out / "report.csv").read_text())))
    assert len(rows) == 4 and all(float(r["final_eval_loss"]) > 0 for r in rows)
    assert {(r["lora.rank"], r["optimizer.learning_rate"]) for r in rows} == {
        ("4", "0.001"),
        ("4", "0.01"),
        ("8", "0.001"),
        ("8", "0.01"),
    }
    md = (out / "report.md").read_text()
    assert md.count("\n| ") == 5 and "Best final eval loss" in md
    svg = ET.fromstring((out / "eval_loss.svg").read_text())
    assert len(svg.findall("{http://www.w3.org/2000/svg}polyline")) == 4


def test_cancel_stops_a_running_pipeline(stack, workers, tmp_path):
    """`loraplex pipelines cancel` on a running pipeline: CANCELLED at once, no step after the one in flight, the
    adapter deleted, its checkpoints kept; a second cancel answers the same; a finished pipeline cannot be."""
    key = create_tenants(stack, "pl-fay")["pl-fay"]
    client = tenant_clients_for(stack, key)
    cfg = config(write_jsonl(tmp_path / "f.jsonl", prompt_completion(40)), epochs=20, batch_size=2)
    pid = client.submit_pipeline(cfg)["pipelines"][0]["id"]
    wait_for(lambda: client.pipelines.get(pid)["step"] >= 3, 60, "three steps")
    out = cli(cli_env(stack, key), "pipelines", "cancel", pid)
    assert out.returncode == 0 and "cancelled" in out.stdout, out.stderr
    model_id = client.pipelines.get(pid)["model_id"]
    wait_for(lambda: client.get_run(model_id)["status"] == "deleted", 30, "the adapter deleted")
    stopped = client.pipelines.get(pid)
    time.sleep(1.0)
    assert client.pipelines.get(pid)["step"] == stopped["step"] < stopped["total_steps"]
    assert stopped["state"] == "cancelled" and client.pipelines.cancel(pid)["state"] == "cancelled"
    assert client.list_checkpoints(model_id)  # its checkpoints stay


def test_a_suspended_tenants_pipeline_waits_and_goes_on_after_the_resume(stack, workers, tmp_path):
    """An operator suspends a tenant mid-pipeline: its steps stop (its requests would be refused) without failing the
    pipeline; after the resume it goes on from its last checkpoint to its end."""
    from loraplex.service import tenant_controls
    from loraplex.service.build import build_services
    from loraplex.storage.repositories import PipelineRepository, TenantRepository

    key = create_tenants(stack, "pl-sus")["pl-sus"]
    client = tenant_clients_for(stack, key)
    cfg = config(write_jsonl(tmp_path / "s.jsonl", prompt_completion(40)), epochs=3, batch_size=2)
    pid = client.submit_pipeline(cfg)["pipelines"][0]["id"]
    wait_for(lambda: client.pipelines.get(pid)["step"] >= 3, 60, "three steps")
    services = build_services(stack.settings)
    with services.sessions() as db:
        tenant_id = TenantRepository(db).get_by_name("pl-sus").id

    def row() -> tuple[int, str]:
        with services.sessions() as db:
            got = PipelineRepository(db, tenant_id).get(pid)
            return got.step, str(got.state)

    tenant_controls.suspend_tenant(services, "ops", tenant_id, "maintenance window")
    time.sleep(2.0)  # the step in flight ends; the next is refused
    paused = row()
    time.sleep(2.0)
    assert row() == paused and paused[1] not in ("failed", "cancelled"), paused
    with pytest.raises(ForbiddenError, match="maintenance window"):  # the tenant's own calls meanwhile
        client.pipelines.get(pid)
    tenant_controls.resume_tenant(services, "ops", tenant_id)
    time.sleep(stack.settings.auth_cache_seconds + 0.5)  # the gateway's cached "suspended" expires
    wait_for(lambda: client.pipelines.get(pid)["state"] in ("succeeded", "failed"), 120, "the end")
    final = client.pipelines.get(pid)
    assert final["state"] == "succeeded" and final["step"] == final["total_steps"], final


def test_bad_configs_are_clear_errors(stack, workers, tmp_path):
    """What a config gets wrong is a typed error naming the field (a 4xx), from the client and as one line from the
    CLI (exit 2, no traceback); a tokenizer the workers cannot find fails the pipeline with a message."""
    key = create_tenants(stack, "pl-gus")["pl-gus"]
    client = tenant_clients_for(stack, key)
    train = write_jsonl(tmp_path / "g.jsonl", prompt_completion(6))
    cases = {
        "lora.bogus": config(train, lora={"bogus": 1}),
        "exceeds this pool's maximum rank": config(train, lora={"rank": 64}),
        "batch_size": config(train, batch_size=0),
        "schedule": config(train, optimizer={"schedule": "exponential"}),
        "cannot be swept": config(train, sweep={"grid": {"dataset.train": ["x"]}}),
        "eval_every needs an eval split": config(train, dataset={"eval_fraction": 0.0}),
    }
    for expected, cfg in cases.items():
        with pytest.raises(InvalidRequestError, match=expected.replace(".", r"\.")):
            client.submit_pipeline(cfg)
    bad_record = write_jsonl(tmp_path / "bad.jsonl", [*prompt_completion(3), {"prompt": "no completion"}])
    with pytest.raises(InvalidRequestError, match=r"train\[3\]\.completion"):
        client.submit_pipeline(config(bad_record))
    (tmp_path / "bad.yaml").write_text("name: x\nlora: {rank: [1\n")
    for path in (tmp_path / "bad.yaml", tmp_path / "missing.yaml"):
        out = cli(cli_env(stack, key), "finetune", str(path))
        assert out.returncode == 2 and out.stderr.startswith("loraplex: ") and "Traceback" not in out.stderr
    (tmp_path / "rank.yaml").write_text(json.dumps(config(train, lora={"rank": 64})))
    out = cli(cli_env(stack, key), "finetune", str(tmp_path / "rank.yaml"))
    assert out.returncode == 2 and "maximum rank" in out.stderr and "Traceback" not in out.stderr
    with pytest.raises(InvalidRequestError, match="LORAPLEX_PIPELINE_TOKENIZER_ROOT"):
        client.submit_pipeline(config(train, tokenizer=str(tmp_path / "nowhere")))  # no path outside the root
    pid = client.submit_pipeline(config(train, tokenizer="nowhere"))["pipelines"][0]["id"]
    failed = client.pipelines.wait(pid, timeout=60)
    assert failed["state"] == "failed" and "is not a tokenizer folder" in failed["error"]
    assert "Traceback" not in failed["error"]


def test_beat_deletes_expired_checkpoints_and_writes_missed_exports(stack, workers, worker_env, tmp_path):
    """`celery beat` with one-second intervals: a pipeline's intermediate checkpoints (checkpoint_ttl_seconds=1) are
    deleted by the retention task, its final sampler weights stay; an export that went missing (row cleared, folder
    gone) is written again by the export task."""
    beat = CeleryBeat("beat", {**worker_env, "LORAPLEX_RETENTION_INTERVAL_SECONDS": "1",
                               "LORAPLEX_EXPORT_INTERVAL_SECONDS": "1"}, stack.log_dir).start()  # fmt: skip
    try:
        client = tenant_clients(stack, "pl-hal")["pl-hal"]
        cfg = config(write_jsonl(tmp_path / "h.jsonl", prompt_completion(8)), checkpoint_every=1,
                     checkpoint_ttl_seconds=1)  # fmt: skip
        done = client.pipelines.wait(client.submit_pipeline(cfg)["pipelines"][0]["id"], timeout=60)
        assert done["state"] == "succeeded" and done["last_checkpoint_step"] == 3
        names = lambda: {c["checkpoint_id"] for c in client.list_checkpoints(done["model_id"])}  # noqa: E731
        wait_for(lambda: names() == {"sampler_weights/final"}, 30, "the expired checkpoints deleted")
        with unit_of_work(session_factory(make_db_engine(stack.settings.resolved_database_url))) as db:
            row = db.get(Pipeline, done["id"])
            shutil.rmtree(row.export_path)
            row.export_path = None
        again = wait_for(lambda: (p := client.pipelines.get(done["id"]))["export_path"] and p, 30, "the export again")
        assert (client.pipelines.download_export(again["id"], tmp_path / "again") / "adapter_model.safetensors").is_file()
    finally:
        beat.stop()


def test_a_killed_prefork_child_is_handed_out_again_at_once(stack, workers, worker_env, tmp_path):
    """The default pool: a prefork worker (one child) whose child is SIGKILLed mid-pipeline. reject_on_worker_lost
    puts the task back at once (the visibility timeout here is 10 minutes, so nothing else could); the worker's new
    child finds the dead child's lease, waits it out, and resumes from the checkpoint. Runs last: it stops the
    module's thread-pool workers so the prefork one gets the task."""
    for worker in workers:
        worker.stop()
    env = {**worker_env, "LORAPLEX_CELERY_VISIBILITY_TIMEOUT_SECONDS": "600"}
    prefork = CeleryWorker("prefork", env, stack.log_dir, concurrency=1, pool="prefork").start()
    workers.append(prefork)
    client = tenant_clients(stack, "pl-ivy")["pl-ivy"]
    cfg = config(write_jsonl(tmp_path / "i.jsonl", prompt_completion(32)), batch_size=2, checkpoint_every=3)
    pid = client.submit_pipeline(cfg)["pipelines"][0]["id"]
    children: list[int] = []
    kill_past_a_checkpoint(stack, pid, 24, lambda child: (children.append(child), os.kill(child, signal.SIGKILL)))
    assert children[0] != prefork.pid  # the task ran in the pool's child
    done = client.pipelines.wait(pid, timeout=90)
    assert done["state"] == "succeeded" and done["attempt"] == 2, done["error"]
    assert [t[0] for t in done["train_losses"]] == list(range(1, 25))
    assert prefork.proc is not None and prefork.proc.poll() is None  # the same worker, a new child
