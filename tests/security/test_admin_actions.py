"""Every state-changing admin route takes POST only, behind the origin check. A GET of each action
(and of the logout) is a 405 that changes nothing, even with a valid admin session (a link or an <img> on another
site); a POST from a foreign Origin is a 403 that changes nothing; the pages' real buttons (POST forms) still work in
a real Chromium, as tests/e2e/test_admin.py drives them."""

from __future__ import annotations

import json
import shutil
from contextlib import closing
from typing import Any

import httpx
import pytest

from loraplex.admin.passwords import hash_password
from loraplex.client import AdamParams, Datum, ServiceClient
from loraplex.storage.db import make_db_engine, session_factory
from loraplex.storage.models import Adapter, ApiKey, Checkpoint, Pipeline, Tenant
from loraplex.storage.repositories import AdminRepository, unit_of_work
from tests.helpers.admin_pages import revoke_key_in_list
from tests.helpers.stack import create_tenants

PASSWORD = "correct horse battery staple"
CHROMIUM = shutil.which("chromium")


@pytest.fixture(scope="module")
def world(stack, tmp_path_factory) -> dict[str, Any]:
    """A tenant with a key, an adapter, a checkpoint and a queued pipeline (no Celery worker here: it waits)."""
    key = create_tenants(stack, "act-one")["act-one"]
    client = ServiceClient(stack.base_url, key)
    training = client.create_lora_training_client(rank=4, seed=3)
    training.forward_backward([Datum.for_next_token(list(range(10, 22)))])
    training.optim_step(AdamParams(learning_rate=1e-2)).result()
    training.save_state("kept").result()
    train = tmp_path_factory.mktemp("act-pipeline") / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"say {w}:", "completion": f" {w}"}) + "\n" for w in "abcd"))
    pipeline = client.submit_pipeline({"name": "queued", "dataset": {"train": str(train)}, "epochs": 1,
                                       "batch_size": 2, "lora": {"rank": 4}})["pipelines"][0]["id"]  # fmt: skip
    sessions = session_factory(make_db_engine(stack.settings.resolved_database_url))
    with unit_of_work(sessions) as db:
        AdminRepository(db).create("actions", hash_password(PASSWORD))
    with sessions() as db:
        tenant = db.query(Tenant).filter_by(name="act-one").one().id
        key_id = db.query(ApiKey).filter_by(tenant_id=tenant).one().id
        checkpoint = db.query(Checkpoint).filter_by(model_id=training.model_id, name="kept").one().id
    return {"sessions": sessions, "tenant": tenant, "key": key_id, "adapter": training.model_id,
            "checkpoint": checkpoint, "pipeline": pipeline}  # fmt: skip


def _state(world: dict[str, Any]) -> dict[str, Any]:
    """Everything an action could change."""
    with world["sessions"]() as db:
        return {
            "keys": sorted((k.id, k.revoked_at) for k in db.query(ApiKey).filter_by(tenant_id=world["tenant"])),
            "adapter": db.get(Adapter, world["adapter"]).status,
            "checkpoint": (lambda c: c and (c.id, c.expires_at))(db.get(Checkpoint, world["checkpoint"])),
            "pipeline": db.get(Pipeline, world["pipeline"]).state,
        }


def _admin_session(stack, address: str) -> httpx.Client:
    http = httpx.Client(base_url=stack.base_url, headers={"X-Forwarded-For": address}, follow_redirects=False)
    r = http.post("/admin/login", data={"username": "actions", "password": PASSWORD})
    assert r.status_code == 302, r.text[:300]
    return http  # the caller closes it


def _routes(world: dict[str, Any]) -> list[str]:
    return [
        f"/admin/tenant/action/issue-key?pks={world['tenant']}",
        f"/admin/api-key/action/revoke?pks={world['key']}",
        f"/admin/adapter/action/delete-adapter?pks={world['adapter']}",
        f"/admin/checkpoint/action/expire?pks={world['checkpoint']}",
        f"/admin/checkpoint/action/set-ttl?pks={world['checkpoint']}",
        f"/admin/pipeline/action/cancel-pipeline?pks={world['pipeline']}",
        "/admin/checkpoint-ttl",
        "/admin/logout",
    ]


def test_actions_answer_only_a_same_origin_post_and_change_nothing_else(stack, world) -> None:
    """With a valid admin session: a GET of each action (or of the logout) is a 405, a POST naming another site in
    its Origin or Referer a 403, and neither changes anything."""
    before = _state(world)
    http = _admin_session(stack, "10.6.0.1")
    with closing(http):
        for route in _routes(world):
            r = http.get(route)
            assert r.status_code == 405, (route, r.status_code)
            for header in ("Origin", "Referer"):
                r = http.post(route, headers={header: "https://evil.example/page"}, data={"ttl_seconds": "1"})
                assert r.status_code == 403, (route, header, r.status_code)
        assert _state(world) == before
        assert http.get("/admin/tenant/list").status_code == 200  # the session lives: the logout was not run either


def test_the_buttons_post_their_actions_in_a_real_browser(stack, world) -> None:
    if CHROMIUM is None:
        pytest.skip("needs Debian's chromium (scripts/ensure-services.sh installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_context(extra_http_headers={"X-Forwarded-For": "10.6.0.3"}).new_page()
        posts: list[str] = []
        page.on("request", lambda r: posts.append(r.url) if r.method == "POST" else None)
        page.goto(f"{stack.base_url}/admin/login")
        page.fill("input[name=username]", "actions")
        page.fill("input[name=password]", PASSWORD)
        with page.expect_navigation():
            page.click("button[type=submit]")
        # The list page's menu: select the key's row, pick Revoke, confirm.
        revoke_key_in_list(page, stack.base_url, world["key"])
        assert dict(_state(world)["keys"])[world["key"]] is not None  # revoked
        # The details page's button, then its confirmation.
        page.goto(f"{stack.base_url}/admin/pipeline/details/{world['pipeline']}")
        page.click("a[data-bs-target='#modal-confirmation-cancel-pipeline']")
        with page.expect_navigation():
            page.click("#modal-confirmation-cancel-pipeline a.btn-blue")
        assert _state(world)["pipeline"] == "cancelled"
        # The logout button.
        with page.expect_navigation():
            page.click("a:has-text('Logout')")
        page.goto(f"{stack.base_url}/admin/tenant/list")
        assert "/admin/login" in page.url
        assert any("/action/revoke" in u for u in posts) and any("/action/cancel-pipeline" in u for u in posts)
        assert any(u.endswith("/admin/logout") for u in posts)
        browser.close()
