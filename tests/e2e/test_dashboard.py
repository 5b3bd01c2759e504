"""The live dashboard and the per-adapter view on the embedded stack, in headless Chromium: three tenants train a few
quick steps after the page has loaded and their tokens, adapters and latency appear without a reload (the page polls
its JSON); the page fits 1366 px; the legend hides a line; the adapter's page shows its numbers and its trace
downloads as valid trace-event JSON with one span per request and its four stages. Screenshots at 1366x768 and
1920x1080 go to LORAPLEX_TEST_SCREENSHOTS (a temp folder otherwise) for a person to look at."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker

from loraplex.client import AdamParams, Datum, ServiceClient
from loraplex.launch.embedded import Stack
from loraplex.runtime.netutil import free_port
from loraplex.settings import Settings
from tests.helpers.stack import create_tenants

CHROMIUM = shutil.which("chromium")
PASSWORD = "a dashboard password of some length"
SHOTS = os.environ.get("LORAPLEX_TEST_SCREENSHOTS")
TENANTS = ("dash-alpha", "dash-beta", "dash-gamma")


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    """A stack of this file's own: the dashboard is the operator's view of every tenant, so adapters other test files
    trained on the shared stack within the page's range would take the adapters panel's places."""
    settings = Settings(home=tmp_path_factory.mktemp("dashboard"), slots=4, max_rank=16,
                        pool_metrics_publish_seconds=0.5)  # fmt: skip
    with Stack(settings, api_port=free_port()) as running:
        yield running


@pytest.fixture(scope="module")
def keys(stack) -> dict[str, str]:
    env = {**os.environ, **stack.child_env()}
    done = subprocess.run([sys.executable, "-m", "loraplex.launch.cli", "admin", "create", "dash-ops", "--password-stdin"],
                          input=PASSWORD + "\n", env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return create_tenants(stack, *TENANTS)


@pytest.fixture(scope="module")
def page(stack, keys) -> Iterator[Any]:
    if CHROMIUM is None:
        pytest.skip("needs Debian's chromium (apt-get install chromium; scripts/ensure-services.sh does)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        context = browser.new_context(viewport={"width": 1366, "height": 768},
                                      extra_http_headers={"X-Forwarded-For": "10.78.0.1"})  # fmt: skip
        page = context.new_page()
        page.goto(f"{stack.base_url}/admin/login")
        page.fill("input[name=username]", "dash-ops")
        page.fill("input[name=password]", PASSWORD)
        page.click("button[type=submit]")
        page.wait_for_load_state()
        yield page
        browser.close()


def _train(stack, key: str, steps: int) -> str:
    training = ServiceClient(stack.base_url, key).create_lora_training_client(rank=4, seed=5)
    data = [Datum.for_next_token([(7 + 3 * i + j) % 150 + 10 for j in range(12)]) for i in range(2)]
    for _ in range(steps):
        training.forward_backward(data)
        training.optim_step(AdamParams(learning_rate=1e-2)).result()
    return training.model_id


def _shoot(page, name: str, width: int, height: int) -> Path:
    page.set_viewport_size({"width": width, "height": height})
    shot = Path(SHOTS or "/tmp/loraplex-dashboard-shots") / name
    shot.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    return shot


def test_training_appears_without_a_reload_and_the_page_fits_1366(stack, keys, page) -> None:
    page.goto(f"{stack.base_url}/admin/dashboard?range=5m")
    assert page.locator("#panel-health").count() == 1 and "Redis" in page.inner_text("#health")
    page.evaluate("window.__sameDocument = true")
    models: dict[str, str] = {}
    threads = [threading.Thread(target=lambda t=t: models.update({t: _train(stack, keys[t], 4)})) for t in TENANTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(models) == 3
    for tenant in TENANTS:  # drawn by the poll: the page never reloaded
        page.wait_for_function(f"document.querySelector('#panel-tokens').innerText.includes('{tenant}')",
                               timeout=20_000)  # fmt: skip
    page.wait_for_function("document.querySelectorAll('#panel-adapters .multiple').length >= 3", timeout=20_000)
    assert page.evaluate("window.__sameDocument") is True
    assert int(page.get_attribute("#dashboard", "data-updates") or 0) >= 1
    assert page.locator("#panel-tokens .multiple").count() >= 3  # one small chart per tenant: no line hides another
    assert page.locator("#panel-latency polyline.series").count() == 4
    assert "dash-alpha/" in page.inner_text("#panel-adapters")
    assert page.evaluate("document.documentElement.scrollWidth") <= 1366
    # a legend click hides its line, and it stays hidden across the next update
    page.locator("#panel-latency .legend-item").first.click()
    hidden = "document.querySelector('#panel-latency .series-group').style.display === 'none'"
    assert page.evaluate(hidden)
    updates = int(page.get_attribute("#dashboard", "data-updates") or 0)
    page.wait_for_function(f"Number(document.querySelector('#dashboard').dataset.updates) > {updates}", timeout=10_000)
    assert page.evaluate(hidden)
    _shoot(page, "dashboard-1366x768.png", 1366, 768)
    _shoot(page, "dashboard-1920x1080.png", 1920, 1080)
    page.set_viewport_size({"width": 1366, "height": 768})

    # the adapter's own page and its trace, downloaded through the admin and, for its tenant, the API
    model_id = models["dash-beta"]
    page.goto(f"{stack.base_url}/admin/dashboard/adapter/{model_id}")
    figures = page.inner_text("#requests-view")
    assert "training utilization" in figures and "dash-beta" in figures
    assert page.locator("#panel-columns rect.bar").count() >= 8
    _shoot(page, "adapter-1366x768.png", 1366, 768)
    trace = page.request.get(f"{stack.base_url}/admin/dashboard/adapter/{model_id}/trace.json").json()
    _check_trace(trace, steps=8)
    api = httpx.get(f"{stack.base_url}/v1/adapters/{model_id}/trace", headers={"X-API-Key": keys["dash-beta"]})
    assert api.status_code == 200
    _check_trace(api.json(), steps=8)
    other = httpx.get(f"{stack.base_url}/v1/adapters/{model_id}/trace", headers={"X-API-Key": keys["dash-alpha"]})
    assert other.status_code == 404

    # A Tinker SDK adapter (it has a session): its row's page links to its requests, and those to its session's
    sdk = tinker.ServiceClient(base_url=stack.base_url, api_key=keys["dash-gamma"])
    trainer = sdk.create_lora_training_client(base_model=stack.settings.base_model, rank=4).result()
    datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints([11, 12, 13]),
                               loss_fn_inputs={"target_tokens": [12, 13, 14]})  # fmt: skip
    trainer.forward_backward([datum], "cross_entropy").result()
    page.goto(f"{stack.base_url}/admin/adapter/details/{trainer.model_id}")
    with page.expect_navigation():
        page.click("#adapter-links a:has-text('Its requests and trace')")
    assert "training utilization" in page.inner_text("#requests-view")
    with page.expect_navigation():
        page.click("#session-link a")
    heading = page.inner_text("#requests-view h2")
    assert heading.startswith("session ") and "dash-gamma" in heading
    assert "requests traced" in page.inner_text("#requests-view")
    _shoot(page, "session-1366x768.png", 1366, 768)


def _check_trace(trace: dict[str, Any], steps: int) -> None:
    """The trace-event format's rules (Chrome's JSON Object Format): complete events with name, ph, ts, dur, pid, tid;
    metadata names; and here one span per request holding its four stages in order."""
    events = trace["traceEvents"]
    for e in events:
        assert e["ph"] in ("X", "M") and isinstance(e["pid"], int) and isinstance(e["tid"], int) and e["name"]
        if e["ph"] == "X":
            assert isinstance(e["ts"], int | float) and e["dur"] >= 0
    spans = [e for e in events if e["ph"] == "X" and e["cat"] == "request"]
    assert sorted(s["args"]["seq_id"] for s in spans) == [-1, *range(1, steps + 1)]  # its creation, then its steps
    assert next(s for s in spans if s["args"]["seq_id"] == -1)["name"] == "create_adapter"
    for span in spans:
        inside = [e for e in events if e["ph"] == "X" and e["cat"] == "stage" and e["tid"] == span["tid"]
                  and span["ts"] - 0.5 <= e["ts"] and e["ts"] + e["dur"] <= span["ts"] + span["dur"] + 0.5]  # fmt: skip
        names = [e["name"] for e in sorted(inside, key=lambda e: e["ts"])]
        assert names[:4] == ["queue", "plan", "engine", "result"], names
        engine = next(e for e in inside if e["name"] == "engine")
        assert engine["dur"] > 0  # the engine ran it
