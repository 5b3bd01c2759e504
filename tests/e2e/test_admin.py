"""The web admin on the embedded stack, in a real headless Chromium (Playwright driving Debian's `chromium`):
an admin account made with the CLI logs in; every view opens (search, filter, sort); each action does what it says
in the database (issue a key shown once that then authenticates, revoke a key that then gets 401, set a
checkpoint's TTL, expire a checkpoint with its files, delete an adapter through the queue until the pool frees it);
the dashboard shows live data (a screenshot is written for a person to look at). A tenant's API key never opens
/admin, a wrong password gets no session, repeated wrong passwords lock the account (the CLI unlocks it), and a
cross-site POST is refused."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from loraplex.client import AdamParams, Datum
from loraplex.storage.blobs import BlobStore
from loraplex.storage.db import make_db_engine, session_factory
from loraplex.storage.models import Adapter, ApiKey, Checkpoint, Pipeline, Residency, Tenant
from loraplex.storage.types import utcnow
from tests.helpers.admin_pages import revoke_key_in_list
from tests.helpers.stack import create_tenants

CHROMIUM = shutil.which("chromium")
PASSWORD = "correct horse battery staple"
# Where the dashboard screenshot goes (to look at after a run); a temp folder otherwise.
SHOTS = os.environ.get("LORAPLEX_TEST_SCREENSHOTS")


def _cli(stack, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **stack.child_env()}
    return subprocess.run([sys.executable, "-m", "loraplex.launch.cli", *args], input=stdin, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


@pytest.fixture(scope="module")
def world(stack, tmp_path_factory) -> dict[str, Any]:
    """Two tenants, a trained adapter with checkpoints, a queued pipeline (no Celery worker here: it waits), and two
    admin accounts made through the CLI."""
    from loraplex.client import ServiceClient

    keys = create_tenants(stack, "adm-one", "adm-two")
    one = ServiceClient(stack.base_url, keys["adm-one"])
    training = one.create_lora_training_client(rank=4, seed=3)
    data = [Datum.for_next_token([(5 + 3 * i + j) % 150 + 10 for j in range(12)]) for i in range(2)]
    for _ in range(3):
        training.forward_backward(data)
        training.optim_step(AdamParams(learning_rate=1e-2)).result()
    training.save_state("keep").result()
    training.save_state("drop").result()
    doomed = one.create_lora_training_client(rank=4, seed=4)
    doomed.forward_backward(data).result()
    train = tmp_path_factory.mktemp("admin-pipeline") / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"say {w}:", "completion": f" {w}"}) + "\n"
                             for w in ("one", "two", "three", "four")))  # fmt: skip
    pipeline = one.submit_pipeline({"name": "waiting", "dataset": {"train": str(train)}, "epochs": 1,
                                    "batch_size": 2, "lora": {"rank": 4}})["pipelines"][0]["id"]  # fmt: skip
    for name in ("ops", "locky"):
        done = _cli(stack, "admin", "create", name, "--password-stdin", stdin=PASSWORD + "\n")
        assert done.returncode == 0, done.stderr
    return {"keys": keys, "adapter": training.model_id, "doomed": doomed.model_id, "pipeline": pipeline,
            "sessions": session_factory(make_db_engine(stack.settings.resolved_database_url))}  # fmt: skip


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if CHROMIUM is None:
        pytest.skip("needs Debian's chromium (apt-get install chromium; scripts/ensure-services.sh does)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


_clients = itertools.count(1)


def _login(browser, stack, username: str = "ops", password: str = PASSWORD) -> Any:
    """A fresh browser logging in. Each one comes from its own address (X-Forwarded-For, which the gateway trusts from
    127.0.0.1 as from a proxy on the host), so the logins of this file stay within the per-client attempt limit."""
    context = browser.new_context(viewport={"width": 1280, "height": 900},
                                  extra_http_headers={"X-Forwarded-For": f"10.77.0.{next(_clients)}"})  # fmt: skip
    page = context.new_page()
    page.goto(f"{stack.base_url}/admin/login")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", password)
    page.click("button[type=submit]")
    page.wait_for_load_state()
    return page


def _logged_in(page, stack) -> bool:
    page.goto(f"{stack.base_url}/admin/adapter/list")
    return "/admin/login" not in page.url


def test_a_tenant_key_and_a_wrong_password_open_nothing(stack, world, browser) -> None:
    key = world["keys"]["adm-one"]
    for headers in ({"X-API-Key": key}, {"Authorization": f"Bearer {key}"}):
        r = httpx.get(f"{stack.base_url}/admin/adapter/list", headers=headers, follow_redirects=False)
        assert r.status_code in (302, 303, 307) and "/admin/login" in r.headers["location"]
    page = _login(browser, stack, password="not the password at all")
    assert "/admin/login" in page.url
    assert not _logged_in(page, stack)
    assert not any(c["name"] == "loraplex_admin" and "admin" in c["value"] for c in page.context.cookies())
    r = httpx.post(f"{stack.base_url}/admin/login", data={"username": "ops", "password": PASSWORD},
                   headers={"Origin": "http://evil.example"})  # fmt: skip
    assert r.status_code == 403  # a cross-site form post never reaches the login


def test_repeated_wrong_passwords_lock_the_account_until_unlocked(stack, world, browser) -> None:
    for _ in range(stack.settings.admin_max_failed_logins):
        assert not _logged_in(_login(browser, stack, "locky", "wrong password, again"), stack)
    assert not _logged_in(_login(browser, stack, "locky"), stack)  # the right password, but locked
    assert _cli(stack, "admin", "unlock", "locky").returncode == 0
    assert _logged_in(_login(browser, stack, "locky"), stack)


def test_every_view_opens_with_search_filter_and_sort(stack, world, browser) -> None:
    page = _login(browser, stack)
    adapter = world["adapter"]
    for identity, expect in (("tenant", "adm-one"), ("api-key", "tml-"), ("adapter", adapter), ("checkpoint", "keep"),
                             ("residency", adapter), ("pool", stack.settings.pool), ("usage", "forward_backward"),
                             ("pipeline", "waiting")):  # fmt: skip
        page.goto(f"{stack.base_url}/admin/{identity}/list")
        assert page.locator("table").count() >= 1, identity
        assert expect in page.content(), identity
    page.goto(f"{stack.base_url}/admin/adapter/list?search={adapter}")
    assert adapter in page.content() and world["doomed"] not in page.content()
    page.goto(f"{stack.base_url}/admin/checkpoint/list?search={adapter}&sortBy=created_at&sort=asc")
    body = page.content()
    assert body.index(">keep<") < body.index(">drop<")  # oldest first
    page.goto(f"{stack.base_url}/admin/usage/list?kind=optim_step")
    assert "optim_step" in page.content() and ">forward_backward<" not in page.content()
    page.goto(f"{stack.base_url}/admin/adapter/details/{adapter}")
    assert adapter in page.content()


def _row(world, model, **where) -> Any:
    with world["sessions"]() as db:
        return db.query(model).filter_by(**where).one_or_none()


def _confirm_on_details(page, stack, identity: str, pk: str, action: str) -> None:
    """The details page's button for `action`, then Yes in its confirmation."""
    page.goto(f"{stack.base_url}/admin/{identity}/details/{pk}")
    page.click(f"a[data-bs-target='#modal-confirmation-{action}']")
    with page.expect_navigation():
        page.click(f"#modal-confirmation-{action} a.btn-blue")


def _issue_key(page, stack, tenant_id: str, name: str) -> str:
    """The tenant page's "Issue an API key", its name typed in the form; the key read from the page it is shown on."""
    page.goto(f"{stack.base_url}/admin/tenant/details/{tenant_id}")
    with page.expect_navigation():
        page.click("a.btn:has-text('Issue an API key')")
    page.fill("#name", name)
    with page.expect_navigation():
        page.click("#apply-control")
    assert "shown only this once" in page.inner_text("#new-api-key-warning")
    key = page.inner_text("#new-api-key").strip()
    assert key.startswith("tml-")
    return key


def test_actions_change_the_database_through_the_service(stack, world, browser) -> None:
    page = _login(browser, stack)
    sessions = world["sessions"]
    with sessions() as db:
        tenant_id = db.query(Tenant).filter_by(name="adm-two").one().id
        keep = db.query(Checkpoint).filter_by(model_id=world["adapter"], name="keep").one().id
        drop = db.query(Checkpoint).filter_by(model_id=world["adapter"], name="drop").one()
    # Every action through its button (a POST form: a GET of an action is a 405). Issue a key from the tenant's
    # page: shown once, and it authenticates.
    new_key = _issue_key(page, stack, tenant_id, "revoked soon")
    assert httpx.get(f"{stack.base_url}/v1/adapters", headers={"X-API-Key": new_key}).status_code == 200
    # Revoke it through the list page's action menu (select the row, pick the action, confirm).
    with sessions() as db:
        key_id = db.query(ApiKey).filter_by(tenant_id=tenant_id, prefix=new_key[:8]).one().id
    revoke_key_in_list(page, stack.base_url, key_id, f"?search={new_key[:8]}")
    assert _row(world, ApiKey, id=key_id).revoked_at is not None
    deadline = time.monotonic() + 10  # the gateway trusts a checked key for auth_cache_seconds
    while httpx.get(f"{stack.base_url}/v1/adapters", headers={"X-API-Key": new_key}).status_code != 401:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    # A checkpoint's TTL through the list's action menu, then the form.
    page.goto(f"{stack.base_url}/admin/checkpoint/list?search={world['adapter']}")
    page.locator(f"tr:has(input[type=hidden][value='{keep}']) input.select-box").check()
    page.click("#dropdownMenuButton")
    with page.expect_navigation():
        page.click("#action-custom-set-ttl")
    page.fill("#ttl_seconds", "3600")
    page.click("#apply-ttl")
    page.wait_for_load_state()
    expires = _row(world, Checkpoint, id=keep).expires_at
    assert expires is not None and abs((expires - utcnow()) - timedelta(seconds=3600)) < timedelta(seconds=60)
    # Expire another now: row and files gone.
    blobs = BlobStore(stack.settings.resolved_blob_root)
    folder = blobs.path(blobs.key_for_uri(drop.blob_uri))
    assert folder.exists()
    _confirm_on_details(page, stack, "checkpoint", drop.id, "expire")
    assert _row(world, Checkpoint, id=drop.id) is None
    assert not folder.exists()
    # Cancel a pipeline through the service: its state says so.
    _confirm_on_details(page, stack, "pipeline", world["pipeline"], "cancel-pipeline")
    assert _row(world, Pipeline, id=world["pipeline"]).state == "cancelled"
    # Delete an adapter: through the queue, until its pool has freed it.
    _confirm_on_details(page, stack, "adapter", world["doomed"], "delete-adapter")
    deadline = time.monotonic() + 30
    while _row(world, Adapter, model_id=world["doomed"]).status != "deleted" or _row(
        world, Residency, model_id=world["doomed"], pool=stack.settings.pool, rank=0
    ):
        assert time.monotonic() < deadline, _row(world, Adapter, model_id=world["doomed"]).status
        time.sleep(0.3)


def test_the_dashboard_draws_live_data(stack, world, browser, tmp_path) -> None:
    page = _login(browser, stack)
    page.goto(f"{stack.base_url}/admin/dashboard")
    for panel in ("tokens", "queued", "latency", "adapters", "slots", "tiers", "plans", "layouts", "swaps", "pipelines"):
        assert page.locator(f"#panel-{panel} svg").count() >= 1, panel
    assert page.locator("#panel-tokens polyline.series").count() >= 1  # adm-one trained within the window
    assert page.locator("#panel-slots rect.bar").count() >= 1
    assert "adm-one" in page.inner_text("#panel-tokens")
    assert page.locator("#panel-layouts rect.bar").count() >= 1  # from the pool's published metrics
    assert "waiting" in page.inner_text("#panel-pipelines")
    shot = Path(SHOTS or tmp_path) / "admin-dashboard.png"
    shot.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000


SCREENS = ((1366, 768), (1920, 1080))
LIST_PAGES = ("tenant", "api-key", "adapter", "checkpoint", "usage", "pipeline", "admin-audit-entry")


def _shoot(page, folder: Path, name: str) -> None:
    for width, height in SCREENS:
        page.set_viewport_size({"width": width, "height": height})
        page.screenshot(path=str(folder / f"admin-{name}-{width}.png"))


def _fits(page) -> bool:
    """No horizontal scrolling: neither the page nor a table's scroll box is wider than what shows."""
    return page.evaluate("""() => document.documentElement.scrollWidth <= window.innerWidth &&
        [...document.querySelectorAll('.table-responsive')].every(b => b.scrollWidth <= b.clientWidth + 1)""")


def test_operator_controls_in_the_browser(stack, world, browser, tmp_path) -> None:
    """Issue a named key (read from the page and used), suspend the tenant while its training is queued (403 naming
    the reason; the queued steps finish after the resume), edit its weight and quotas, and find each action in
    the audit log; every list and the tenant's page fit 1366 px (screenshots at 1366x768 and 1920x1080)."""
    from loraplex.client import ServiceClient

    page = _login(browser, stack)
    sessions = world["sessions"]
    keys = create_tenants(stack, "adm-ctl")
    with sessions() as db:
        tenant_id = db.query(Tenant).filter_by(name="adm-ctl").one().id
    key = _issue_key(page, stack, tenant_id, "notebook")
    colours = page.evaluate("""() => { const s = getComputedStyle(document.getElementById('new-api-key'));
                                       return [s.color, s.backgroundColor]; }""")
    assert colours[0] != colours[1] and colours[0] in ("rgb(24, 36, 51)",), colours  # dark text on its light box
    folder = Path(SHOTS or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    _shoot(page, folder, "new-key")
    client = ServiceClient(stack.base_url, key)
    training = client.create_lora_training_client(rank=4, seed=5)
    data = [Datum.for_next_token([(7 + 5 * i + j) % 150 + 10 for j in range(12)]) for i in range(2)]
    futures = [training.forward_backward(data) for _ in range(3)] + [training.optim_step(AdamParams(learning_rate=1e-2))]

    page.goto(f"{stack.base_url}/admin/tenant/details/{tenant_id}")
    with page.expect_navigation():
        page.click("a.btn:has-text('Suspend')")
    page.fill("#reason", "browser test: unpaid invoice")
    with page.expect_navigation():
        page.click("#apply-control")
    refused = httpx.get(f"{stack.base_url}/v1/adapters", headers={"X-API-Key": key})
    assert refused.status_code == 403 and "unpaid invoice" in refused.text  # the admin's own gateway: at once
    assert httpx.get(f"{stack.base_url}/v1/adapters", headers={"X-API-Key": keys["adm-ctl"]}).status_code == 403
    assert "suspend" in page.inner_text("#tenant-audit") and "suspended" in page.inner_text("table")
    _confirm_on_details(page, stack, "tenant", tenant_id, "resume")
    assert httpx.get(f"{stack.base_url}/v1/adapters", headers={"X-API-Key": key}).status_code == 200
    assert all(f.result(timeout=60) is not None for f in futures)  # nothing queued was lost

    page.goto(f"{stack.base_url}/admin/tenant/details/{tenant_id}")
    with page.expect_navigation():
        page.click("a.btn:has-text('Edit weight and quotas')")
    page.fill("#weight", "3")
    page.fill("#max_adapters", "5")
    page.fill("#max_queued_requests", "")
    with page.expect_navigation():
        page.click("#apply-control")
    row = _row(world, Tenant, id=tenant_id)
    assert (row.weight, row.max_adapters, row.max_queued_requests, row.state) == (3.0, 5, None, "active")
    body = page.inner_text("body")
    assert "notebook" in page.inner_text("#tenant-keys") and training.model_id[:16] in page.inner_text("#tenant-adapters")
    assert "forward_backward" in page.inner_text("#tenant-usage") and "default (" in body
    _shoot(page, folder, "tenant")

    page.goto(f"{stack.base_url}/admin/admin-audit-entry/list?search=adm-ctl")
    audit = page.inner_text("table")
    for what in ("issue key", "suspend", "resume", "set limits"):
        assert what in audit, what
    assert "ops" in audit and "browser test: unpaid invoice" in audit
    wide = []
    for identity in LIST_PAGES:
        page.goto(f"{stack.base_url}/admin/{identity}/list")
        _shoot(page, folder, f"list-{identity}")
        page.set_viewport_size({"width": 1366, "height": 768})
        if not _fits(page):
            wide.append(identity)
        assert tenant_id not in page.inner_text("table"), identity  # ids cut (the whole one on hover)
    assert not wide, f"wider than 1366 px: {wide}"
    page.goto(f"{stack.base_url}/admin/adapter/list?search=adm-ctl")
    assert "adm-ctl" in page.inner_text("table")
    assert not re.search(r"\d\d:\d\d:\d\d\.\d", page.inner_text("table"))  # times to the second
    _shoot(page, folder, "adapters")
    for identity in ("api-key", "checkpoint", "usage", "admin-audit-entry"):
        page.goto(f"{stack.base_url}/admin/{identity}/list")
        _shoot(page, folder, identity)
    page.goto(f"{stack.base_url}/admin/adapter/details/{world['adapter']}")
    assert "keep" in page.inner_text("#adapter-checkpoints") and "KiB" in page.inner_text("#adapter-checkpoints")
    _shoot(page, folder, "adapter")
