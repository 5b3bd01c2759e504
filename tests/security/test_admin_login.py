"""Admin login against the real embedded stack (gateway, SQLite, pool, Victim tenant):

- 16 clients posting wrong passwords get 429 (Retry-After, the message on the login page) past the per-client
  limit, a write transaction completes quickly while passwords are being hashed (no scrypt inside the write lock),
  and the Victim's steps stay under 2x alone.
- an unknown user, a locked account and a wrong password take comparable time and read the same; a browser
  that logged in to an account before keeps logging in while guessers have it locked (the rule against locking
  anyone out), a fresh client with the right password does not.
- a failed login's log lines never carry the typed username.
- the cookies are Secure when the request came over HTTPS (X-Forwarded-Proto from a trusted proxy).

The gateway trusts X-Forwarded-For from 127.0.0.1 (uvicorn's proxy headers, --forwarded-allow-ips): tests stand for
distinct client addresses that way, as a reverse proxy on the host would report them."""

from __future__ import annotations

import re
import statistics
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from loraplex.admin.passwords import hash_password
from loraplex.storage.db import make_db_engine, session_factory
from loraplex.storage.models import AdminAccount
from loraplex.storage.repositories import AdminRepository, unit_of_work
from loraplex.storage.types import utcnow
from tests.security.harness import check_victim, run_attackers

PASSWORD = "correct horse battery staple"
ERROR_RE = re.compile(r'<div class="invalid-feedback">([^<]*)</div>')


@pytest.fixture(scope="module")
def sessions(stack) -> Any:
    return session_factory(make_db_engine(stack.settings.resolved_database_url))


def make_admin(sessions: Any, name: str) -> str:
    with unit_of_work(sessions) as db:
        return AdminRepository(db).create(name, hash_password(PASSWORD)).id


def login(base: str, username: str, password: str, client: str | None = None,
          http: httpx.Client | None = None, **headers: str) -> httpx.Response:  # fmt: skip
    if client:
        headers["X-Forwarded-For"] = client
    post = (http or httpx).post
    return post(f"{base}/admin/login", data={"username": username, "password": password},
                headers=headers, follow_redirects=False, timeout=30)  # fmt: skip


def error_of(response: httpx.Response) -> str:
    found = ERROR_RE.search(response.text)
    assert found, response.text[:500]
    return found.group(1).strip()


class WriteProbe:
    """Times short write transactions (BEGIN IMMEDIATE, as every unit of work on SQLite) on the stack's database in a
    thread: a login holding the write lock across a password hash shows as a slow one."""

    def __init__(self, sessions: Any) -> None:
        self.sessions, self.seconds, self._stop = sessions, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            with unit_of_work(self.sessions) as db:
                db.execute(text("UPDATE admin_accounts SET failed_logins = failed_logins WHERE username = 'probe'"))
            self.seconds.append(time.perf_counter() - start)
            time.sleep(0.005)

    def __enter__(self) -> WriteProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


@pytest.fixture
def attack_clients() -> Iterator[list[httpx.Client]]:
    clients = [httpx.Client(timeout=30) for _ in range(16)]
    yield clients
    for c in clients:
        c.close()


def test_a_flood_of_wrong_passwords_gets_429_holds_no_write_lock_and_spares_the_victim(
    stack, victim, sessions, attack_clients
) -> None:
    base, settings = stack.base_url, stack.settings
    make_admin(sessions, "flooded")
    # Hashes in flight with a writer beside them: attempts from ten addresses (each within its own limit) at once.
    with WriteProbe(sessions) as probe:
        threads = [threading.Thread(target=login, args=(base, f"guess-{i}", "wrong", f"10.1.0.{i}")) for i in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    print(f"write probe while hashing: {len(probe.seconds)} writes, max {1000 * max(probe.seconds):.1f} ms")
    assert max(probe.seconds) < 0.1, probe.seconds  # never queued behind a hash (~30 ms each, ten of them)

    victim.alone(5)  # the pool's first steps after start are slower than its steady state
    alone = victim.alone(10)
    statuses: list[int] = []
    refused: list[httpx.Response] = []
    stop = threading.Event()

    def attacker(http: httpx.Client) -> None:
        while not stop.is_set():
            r = login(base, "flooded", "not the password", http=http)  # all from one address, 127.0.0.1
            statuses.append(r.status_code)
            if r.status_code == 429:
                refused.append(r)

    with victim.training(min_steps=20) as during:
        run_attackers(attacker, [(c,) for c in attack_clients], 4.0, stop)
    check_victim(alone, during, label="admin login flood", alone_after=victim.alone(10))
    limit = settings.admin_login_attempts_per_client
    assert statuses.count(400) <= limit and statuses.count(429) >= 16, statuses  # the rest were refused before a hash
    assert set(statuses) <= {400, 429}, statuses  # never a 5xx
    r = refused[0]
    assert int(r.headers["Retry-After"]) >= 1
    assert "admin_login_attempts_per_client" in error_of(r) and "Traceback" not in r.text


def _timed(base: str, username: str, password: str, client: str) -> tuple[float, int, str]:
    start = time.perf_counter()
    r = login(base, username, password, client)
    return time.perf_counter() - start, r.status_code, error_of(r)


def test_unknown_locked_and_wrong_take_the_same_time_and_read_the_same(stack, sessions) -> None:
    base = stack.base_url
    make_admin(sessions, "timing-wrong")
    make_admin(sessions, "timing-locked")
    with unit_of_work(sessions) as db:
        db.query(AdminAccount).filter_by(username="timing-locked").update({"locked_until": utcnow() + timedelta(hours=1)})
    cases = {"unknown": ("timing-nobody", "a wrong password"), "locked": ("timing-locked", PASSWORD),
             "wrong": ("timing-wrong", "a wrong password")}  # fmt: skip
    seconds: dict[str, list[float]] = {k: [] for k in cases}
    answers: set[tuple[int, str]] = set()
    for i in range(7):  # interleaved, each try from its own address (within every limit)
        for kind, (name, password) in cases.items():
            took, status, message = _timed(base, name, password, f"10.2.{i}.{len(seconds[kind])}{kind[0]}"[:15])
            seconds[kind].append(took)
            answers.add((status, message))
    medians = {k: statistics.median(v) for k, v in seconds.items()}
    print("login medians (ms): " + ", ".join(f"{k} {1000 * v:.1f}" for k, v in medians.items()))
    assert len(answers) == 1 and next(iter(answers))[0] == 400, answers  # one status, one message for all three
    assert max(medians.values()) < 1.5 * min(medians.values()), medians


def test_guessers_cannot_lock_out_a_browser_that_logged_in_before(stack, sessions) -> None:
    base = stack.base_url
    account_id = make_admin(sessions, "steady")
    with httpx.Client() as admin_browser:
        assert login(base, "steady", PASSWORD, "10.3.0.1", http=admin_browser).status_code == 302
        admin_browser.cookies.delete("loraplex_admin")  # logged out: only the trusted-device cookie stays
        # Guessers from many addresses: the account locks, then its per-account limit refuses them outright.
        for i in range(12):  # past the lockout (5) and the per-account limit (10)
            assert login(base, "steady", "guess", f"10.3.1.{i}").status_code in (400, 429)
        with sessions() as db:
            assert AdminRepository.locked(db.get(AdminAccount, account_id))
        assert login(base, "steady", PASSWORD, "10.3.2.1").status_code in (400, 429)  # a new client: refused
        r = login(base, "steady", PASSWORD, "10.3.0.1", http=admin_browser)
        assert r.status_code == 302, error_of(r)  # its own browser: in
        assert admin_browser.get(f"{base}/admin/tenant/list").status_code == 200


def test_failed_logins_never_log_the_typed_username(stack, sessions) -> None:
    make_admin(sessions, "logged")
    typed = ["Secret-Looking-Name-1", "logged"]
    for i, name in enumerate(typed):
        assert login(stack.base_url, name, "hunter2-but-longer", f"10.4.0.{i}").status_code == 400
    time.sleep(0.5)
    log = (stack.log_dir / "api.log").read_text()
    for name in typed:
        assert f"'{name}'" not in log and f" {name}" not in log and "hunter2" not in log
    assert "admin login from 10.4.0.0 refused" in log and "admin login from 10.4.0.1 refused" in log


def test_cookies_are_secure_over_https_and_not_over_http(stack, sessions) -> None:
    make_admin(sessions, "cookie")
    plain = login(stack.base_url, "cookie", PASSWORD, "10.5.0.1")
    proxied = login(stack.base_url, "cookie", PASSWORD, "10.5.0.2", **{"X-Forwarded-Proto": "https"})
    assert plain.status_code == proxied.status_code == 302
    for r, secure in ((proxied, True), (plain, False)):
        cookies = sorted(r.headers.get_list("set-cookie"))  # the session cookie first, then the trusted-device one
        for cookie in cookies:
            attributes = [a.strip().lower() for a in cookie.split(";")[1:]]
            assert ("secure" in attributes) is secure, cookie
            assert "httponly" in attributes and "samesite=strict" in attributes, cookie
        assert [c.split("=")[0] for c in cookies] == ["loraplex_admin", "loraplex_admin_device"], cookies
