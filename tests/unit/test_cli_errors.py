"""The CLI's start-up errors are one line naming the cause, with no traceback: a port in use at `serve`, a missing
LORAPLEX_REDIS_URL (the gateway alone, a pipelines worker, Celery's own command on the pipelines app), an invalid
setting. Each runs the real command as a subprocess (they fail before anything is started); `serve --help` documents
every option, and the banner names the pipelines worker and the web admin."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from loraplex.launch.cli import build_parser, serve_banner

ROOT = Path(__file__).resolve().parents[2]


def run(tmp_path: Path, *args: str, env: dict[str, str] | None = None, module: str = "loraplex.launch.cli"):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    full = clean | {"LORAPLEX_HOME": str(tmp_path), "PYTHONPATH": str(ROOT)} | (env or {})
    return subprocess.run([sys.executable, "-m", module, *args], env=full, cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def one_line(done: subprocess.CompletedProcess, code: int, *words: str) -> str:
    err = done.stderr.strip()
    assert done.returncode == code, done.stdout + done.stderr
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, err
    return err


def test_serve_on_a_port_in_use_says_so_in_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        one_line(run(tmp_path, "serve", "--embedded", "--port", port), 2, f"port {port}", "in use", "--port")
    assert not (tmp_path / "logs").exists()  # checked before anything started


def test_the_gateway_alone_without_a_redis_url_names_the_setting(tmp_path: Path) -> None:
    one_line(run(tmp_path, "serve", "--port", "1"), 2, "LORAPLEX_REDIS_URL", "--embedded")


def test_an_invalid_setting_is_one_line_naming_it(tmp_path: Path) -> None:
    one_line(run(tmp_path, "tenant", "list", env={"LORAPLEX_SLOTS": "many"}), 2, "LORAPLEX_SLOTS='many'")


def test_a_pipelines_worker_without_redis_names_the_settings_and_never_tries_amqp(tmp_path: Path) -> None:
    one_line(run(tmp_path, "pipelines", "worker"), 2, "LORAPLEX_REDIS_URL", "serve --embedded")
    celery = run(tmp_path, "-A", "loraplex.pipelines.app:celery_app", "worker", module="celery")
    err = one_line(celery, 1, "LORAPLEX_REDIS_URL")
    assert "amqp" not in (celery.stdout + err).lower()


def test_serve_help_documents_every_option() -> None:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    options = [a for a in serve._actions if a.option_strings and a.dest != "help"]
    assert {a.dest for a in options} == {"embedded", "base_model", "port"}
    assert all(a.help and len(a.help) > 40 for a in options), [a.dest for a in options if not a.help]


@pytest.mark.parametrize("worker", [True, False])
def test_the_banner_names_the_pipelines_worker_and_the_admin(tmp_path: Path, worker: bool) -> None:
    stack = SimpleNamespace(
        pools={"pool": {"LORAPLEX_BASE_MODEL": "tiny", "LORAPLEX_POOL": "default"}}, base_url="http://127.0.0.1:8700",
        settings=SimpleNamespace(redis_url="redis://127.0.0.1:1/0", pipeline_worker_concurrency=4),
        pipeline_worker=worker, log_dir=tmp_path / "logs",
    )  # fmt: skip
    banner = serve_banner(stack)
    assert "http://127.0.0.1:8700/admin" in banner and "loraplex admin create" in banner
    assert ("pipelines.log" in banner) if worker else ("loraplex pipelines worker" in banner)


def test_a_database_locked_by_another_process_is_one_line_and_the_next_run_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sqlite3

    from loraplex.launch.cli import main
    from loraplex.storage import db

    monkeypatch.setenv("LORAPLEX_HOME", str(tmp_path))
    monkeypatch.delenv("LORAPLEX_DATABASE_URL", raising=False)
    monkeypatch.setattr(db, "SQLITE_BUSY_TIMEOUT_S", 0.3)  # the real 30 s, shortened for the test
    assert main(["migrate"]) == 0
    holder = sqlite3.connect(tmp_path / "loraplex.db")
    holder.execute("BEGIN IMMEDIATE")  # another process's write transaction, held past the busy timeout
    capsys.readouterr()
    assert main(["tenant", "create", "locked-out"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "the database is unavailable (database is locked)" in err, err
    holder.rollback()
    assert main(["tenant", "create", "locked-out"]) == 0
