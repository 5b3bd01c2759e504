"""The real Tinker SDK against the gateway served over HTTP, with no pool running: what it reports to its user when a
request is refused, and that it hears `paused_capacity` while nothing can run its requests."""

from __future__ import annotations

import logging

import pytest
import tinker
from tinker import types

from loraplex.api.app import create_app
from loraplex.settings import Settings
from loraplex.storage.db import migrate
from loraplex.storage.repositories import TenantRepository, unit_of_work
from tests.helpers.http_server import serving


@pytest.fixture()
def server(tmp_path, redis_url):
    settings = Settings(home=tmp_path, redis_url=redis_url, pool=f"sdkgw-{tmp_path.name}", max_rank=16,
                        tinker_long_poll_seconds=0.5)  # fmt: skip
    migrate(settings.resolved_database_url)
    app = create_app(settings)
    with serving(app) as base_url:
        with unit_of_work(app.state.services.sessions) as db:
            _, key = TenantRepository(db).create_tenant("alice")
        yield base_url, key


def test_refusals_reach_the_sdk_user_as_errors_with_the_servers_message(server) -> None:
    base_url, key = server
    client = tinker.ServiceClient(base_url=base_url, api_key=key)
    try:
        with pytest.raises(tinker.BadRequestError, match="dimuon"):
            client.create_lora_training_client(
                base_model="tiny", rank=4, optimizer=types.DimuonOptimizerConfig()
            ).result(timeout=30)
        with pytest.raises(tinker.BadRequestError, match="maximum rank 16"):
            client.create_lora_training_client(base_model="tiny", rank=32).result(timeout=30)
        sampler = client.create_sampling_client(base_model="tiny").result()  # a sampling session: no pool needed
        with pytest.raises(tinker.BadRequestError, match="not offered"):
            sampler.sample(
                types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=2),
                include_prompt_logprobs=True, prompt_logprobs_last_n=1,
            ).result(timeout=30)  # fmt: skip
    finally:
        client.close("success").result()


def test_the_sdk_keeps_waiting_on_try_again_while_no_pool_runs(server, caplog) -> None:
    """Each retrieve_future long-polls, then answers try_again (queue_state paused_capacity, checked on the wire in
    test_tinker_routes.py); the SDK polls again rather than failing, until its own timeout."""
    base_url, key = server
    client = tinker.ServiceClient(base_url=base_url, api_key=key)
    caplog.set_level(logging.INFO)
    try:
        future = client.create_lora_training_client(base_model="tiny", rank=4)
        with pytest.raises(TimeoutError):
            future.result(timeout=3)
    finally:
        close_reporting_retries(client, "interrupted")
    polls = [r for r in caplog.records if "because of try_again" in r.getMessage()]
    assert 2 <= len(polls) <= 12, len(polls)  # long polls of 0.5 s over 3 s, not a spin


def close_reporting_retries(client: tinker.ServiceClient, status: str, within_s: float = 60.0) -> None:
    """`client.close(status)`, failing within `within_s` with the SDK's own records of the request failures it met
    (its telemetry events, which name the exception and status code) rather than waiting out the SDK's five minutes of
    retries of a session finish."""
    telemetry = client.get_telemetry()
    seen: list[dict[str, object]] = []
    if telemetry is not None:
        log_event = telemetry.log

        def recording(name: str, event_data: dict[str, object] | None = None, severity: str = "INFO") -> bool:
            seen.append({"event": name, **(event_data or {})})
            return log_event(name, event_data, severity)  # type: ignore[arg-type]

        telemetry.log = recording  # type: ignore[method-assign]
    try:
        client.close(status).result(timeout=within_s)  # type: ignore[arg-type]
    except TimeoutError:
        shown = [{k: v for k, v in e.items() if k != "exception_stack"} for e in seen]
        stacks = [str(e.get("exception_stack")) for e in seen if e.get("exception_stack")]
        pytest.fail(f"close did not finish in {within_s:.0f} s; the SDK met: {shown}\n{stacks[:1]}")
