"""The operator controls through the service layer (service/tenant_controls.py) against a real gateway (real Redis,
SQLite; no pool, so what is queued stays queued): a suspended tenant's calls are a 403 naming the reason on the
native, Tinker and OpenAI routes while its queued requests stay in its stream and its futures come back after the
resume; a draining tenant keeps reading and deleting but queues nothing new; a tenant's own quotas replace the
settings'; a key's name and last use (written at most once a minute); every change in the audit log; and the auth
cache's bound: another gateway process serves a suspended tenant for at most `auth_cache_seconds`."""

from __future__ import annotations

import asyncio
import time

import pytest
from sqlalchemy import func, select

from loraplex.api.deps import tenant_for_key
from loraplex.protocol import RequestKind
from loraplex.service import tenant_controls
from loraplex.service.audit import recent_admin_actions
from loraplex.service.build import build_services
from loraplex.service.context import TenantQuotas
from loraplex.service.tenant_controls import TenantLimits
from loraplex.storage.models import Adapter, AdminAuditEntry, ApiKey, Tenant
from loraplex.storage.types import utcnow
from tests.helpers.tenant_state import stream_of
from tests.helpers.tinker_wire import forward_backward_body

FB = {"seq_id": 1, "data": [{"model_input": [1, 2, 3], "loss_fn_inputs": {"target_tokens": [2, 3, 4]}}]}
OPS = "ops"


def _h(key: str) -> dict[str, str]:
    return {"X-API-Key": key}


def _adapter(client, key: str) -> tuple[str, str]:
    created = client.post("/v1/adapters", json={"rank": 4}, headers=_h(key))
    assert created.status_code == 202, created.text
    return created.json()["model_id"], created.json()["request_id"]


def test_a_suspended_tenant_gets_403_with_the_reason_everywhere_and_its_queue_survives(gateway) -> None:
    client, services, alice = gateway.client, gateway.services, gateway.keys["alice"]
    model_id, create_id = _adapter(client, alice)
    step = client.post(f"/v1/adapters/{model_id}/forward_backward", json=FB, headers=_h(alice))
    assert step.status_code == 202
    queued_before = [e.request_id for e in stream_of(services, gateway.tenant_ids["alice"])]
    assert len(queued_before) == 2

    tenant_controls.suspend_tenant(services, OPS, gateway.tenant_ids["alice"], "unpaid invoice #42")
    for method, path, body in (("GET", "/v1/adapters", None), ("POST", f"/v1/adapters/{model_id}/forward_backward", FB),
                               ("GET", f"/v1/futures/{step.json()['request_id']}?timeout=0", None),
                               ("GET", "/api/v1/training_runs", None), ("GET", "/v1/models", None),
                               ("POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 1})):  # fmt: skip
        answer = client.request(method, path, json=body, headers=_h(alice))
        assert answer.status_code == 403, (path, answer.status_code, answer.text)
        assert "suspended" in answer.text and "unpaid invoice #42" in answer.text, (path, answer.text)
    assert client.get("/v1/adapters", headers=_h(gateway.keys["bob"])).status_code == 200  # others unaffected
    # Nothing queued was touched.
    assert [e.request_id for e in stream_of(services, gateway.tenant_ids["alice"])] == queued_before

    tenant_controls.resume_tenant(services, OPS, gateway.tenant_ids["alice"])
    assert client.get("/v1/adapters", headers=_h(alice)).status_code == 200
    for request_id in (create_id, step.json()["request_id"]):  # still pending, still the tenant's to read
        assert client.get(f"/v1/futures/{request_id}?timeout=0", headers=_h(alice)).status_code == 200
    assert [e.request_id for e in stream_of(services, gateway.tenant_ids["alice"])] == queued_before
    actions = [(e.actor, e.action, e.target_name) for e in recent_admin_actions(services)]
    assert actions[:2] == [(OPS, "resume", "alice"), (OPS, "suspend", "alice")]


def test_a_suspended_tenants_sdk_keeps_its_session_and_its_telemetry_is_taken(gateway) -> None:
    """The Tinker SDK's session heartbeat and telemetry queue no work: a suspended tenant's are answered (its session
    survives the suspension), while its work routes are a 403; another tenant's session stays its own."""
    client, alice = gateway.client, gateway.keys["alice"]
    session = client.post("/api/v1/create_session", json={"tags": []}, headers=_h(alice)).json()["session_id"]
    tenant_controls.suspend_tenant(gateway.services, OPS, gateway.tenant_ids["alice"], "quota review")
    beat = client.post("/api/v1/session_heartbeat", json={"session_id": session}, headers=_h(alice))
    assert beat.status_code == 200, beat.text
    sent = client.post("/api/v1/telemetry", json={"events": []}, headers=_h(alice))
    assert sent.status_code == 200 and sent.json() == {"status": "accepted"}, sent.text
    refused = client.post("/api/v1/create_session", json={"tags": []}, headers=_h(alice))
    assert refused.status_code == 403 and "quota review" in refused.text, refused.text
    other = client.post("/api/v1/session_heartbeat", json={"session_id": session}, headers=_h(gateway.keys["bob"]))
    assert other.status_code == 404, other.text
    assert client.post("/api/v1/telemetry", json={"events": []}).status_code == 401  # a key is still needed
    tenant_controls.resume_tenant(gateway.services, OPS, gateway.tenant_ids["alice"])
    assert client.post("/api/v1/session_heartbeat", json={"session_id": session}, headers=_h(alice)).status_code == 200


def test_a_draining_tenant_reads_and_deletes_but_queues_nothing_new(gateway) -> None:
    client, services, alice = gateway.client, gateway.services, gateway.keys["alice"]
    model_id, create_id = _adapter(client, alice)
    tenant_controls.drain_tenant(services, OPS, gateway.tenant_ids["alice"], "moving to the new cluster")
    step = client.post(f"/v1/adapters/{model_id}/forward_backward", json=FB, headers=_h(alice))
    assert step.status_code == 403 and "draining" in step.text and "moving to the new cluster" in step.text
    with services.sessions() as db:
        adapters_before = db.scalar(select(func.count()).select_from(Adapter))
    assert client.post("/v1/adapters", json={"rank": 4}, headers=_h(alice)).status_code == 403
    with services.sessions() as db:  # the refused create wrote no row
        assert db.scalar(select(func.count()).select_from(Adapter)) == adapters_before
    assert client.get("/v1/adapters", headers=_h(alice)).status_code == 200
    assert client.get(f"/v1/futures/{create_id}?timeout=0", headers=_h(alice)).status_code == 200
    assert client.delete(f"/v1/adapters/{model_id}", headers=_h(alice)).status_code == 202  # frees what it holds
    with pytest.raises(Exception, match="draining already"):
        tenant_controls.drain_tenant(services, OPS, gateway.tenant_ids["alice"], "again")
    tenant_controls.resume_tenant(services, OPS, gateway.tenant_ids["alice"])
    assert _adapter(client, alice)


def test_a_chain_step_refused_for_the_tenants_state_fills_its_seq_id_so_the_next_step_does_not_wait(gateway) -> None:
    """Clients take a step's seq_id before sending it: a step refused with 403 (suspended: at the door, before the body
    is read; draining: in the route) is queued as a rejection in its place, whichever way the request names the
    seq_id (our client's X-Seq-Id header, a JSON body, the Tinker SDK's protobuf), so after the resume the tenant's
    next step is not stuck behind a hole. Another tenant's adapter gets nothing filled."""
    client, services, alice = gateway.client, gateway.services, gateway.keys["alice"]
    model_id, _ = _adapter(client, alice)
    bobs_model, _ = _adapter(client, gateway.keys["bob"])
    fb, opt = f"/v1/adapters/{model_id}/forward_backward", f"/v1/adapters/{model_id}/optim_step"
    tenant_controls.suspend_tenant(services, OPS, gateway.tenant_ids["alice"], "maintenance")
    refused = [
        client.post(fb, json={**FB, "seq_id": 1}, headers={**_h(alice), "X-Seq-Id": "1"}),
        client.post(opt, json={"seq_id": 2}, headers=_h(alice)),
        client.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 3}, headers=_h(alice)),
        client.post("/api/v1/forward_backward", content=forward_backward_body(model_id, 4), headers=_h(alice)),
        client.post(f"/v1/adapters/{bobs_model}/optim_step", json={"seq_id": 1}, headers=_h(alice)),
    ]
    tenant_controls.resume_tenant(services, OPS, gateway.tenant_ids["alice"])
    tenant_controls.drain_tenant(services, OPS, gateway.tenant_ids["alice"], "moving")
    refused += [
        client.post(fb, json={**FB, "seq_id": 5}, headers=_h(alice)),
        client.post(opt, json={"seq_id": 6}, headers=_h(alice)),
    ]
    tenant_controls.resume_tenant(services, OPS, gateway.tenant_ids["alice"])
    assert [r.status_code for r in refused] == [403] * 7, [r.text for r in refused]

    queued = stream_of(services, gateway.tenant_ids["alice"])
    fills = [(e.model_id, e.seq_id, e.payload) for e in queued if e.kind == RequestKind.REJECTED]
    assert [(m, s) for m, s, _ in fills] == [(model_id, seq) for seq in range(1, 7)]
    for (_, seq, payload), why in zip(fills, ["suspended"] * 4 + ["draining"] * 2, strict=True):
        assert payload.error_type == "ForbiddenError" and why in payload.message, (seq, payload)
    assert not [e for e in stream_of(services, gateway.tenant_ids["bob"]) if e.kind == RequestKind.REJECTED]
    # The next step takes the next seq_id as usual.
    assert client.post(opt, json={"seq_id": 7}, headers=_h(alice)).status_code == 202


def test_a_tenants_own_quotas_replace_the_settings_and_empty_restores_them(gateway) -> None:
    client, services, alice = gateway.client, gateway.services, gateway.keys["alice"]
    tenant_id = gateway.tenant_ids["alice"]
    model_id, _ = _adapter(client, alice)  # 1 queued request (its create)
    limits = TenantLimits(2.5, TenantQuotas(max_queued_requests=1, max_queued_tokens=None, max_adapters=1))
    tenant_controls.set_tenant_limits(services, OPS, tenant_id, limits)
    over = client.post(f"/v1/adapters/{model_id}/forward_backward", json=FB, headers=_h(alice))
    assert over.status_code == 429 and "the quota is 1" in over.text
    refused = client.post("/v1/adapters", json={"rank": 4}, headers=_h(alice))
    assert refused.status_code == 429 and "set by an operator" in refused.text
    assert client.post("/v1/adapters", json={"rank": 4}, headers=_h(gateway.keys["bob"])).status_code == 202
    with services.sessions() as db:
        row = db.get(Tenant, tenant_id)
        assert (row.weight, row.max_queued_requests, row.max_queued_tokens, row.max_adapters) == (2.5, 1, None, 1)
    tenant_controls.set_tenant_limits(services, OPS, tenant_id, TenantLimits(1.0, TenantQuotas()))
    assert client.post(f"/v1/adapters/{model_id}/forward_backward", json=FB, headers=_h(alice)).status_code == 202
    (entry, *_) = recent_admin_actions(services, target_id=tenant_id)
    assert entry.action == "set limits" and "max_queued_requests=default" in (entry.detail or "")


def test_keys_have_a_name_and_a_last_use_written_at_most_once_a_minute(gateway) -> None:
    client, services = gateway.client, gateway.services
    tenant_id = gateway.tenant_ids["bob"]
    key = tenant_controls.issue_key(services, OPS, tenant_id, "  nightly eval job ")
    with services.sessions() as db:
        row = db.scalars(select(ApiKey).where(ApiKey.prefix == key[:8])).one()
        assert (row.name, row.last_used_at) == ("nightly eval job", None)
    assert client.get("/v1/adapters", headers=_h(key)).status_code == 200
    with services.sessions() as db:
        first = db.get(ApiKey, row.id).last_used_at
    assert first is not None and (utcnow() - first).total_seconds() < 30
    services.auth.clear()  # a cache miss reads SQL again, but a use within the minute is not written again
    assert client.get("/v1/adapters", headers=_h(key)).status_code == 200
    with services.sessions() as db:
        assert db.get(ApiKey, row.id).last_used_at == first
    tenant_controls.revoke_key(services, OPS, row.id)
    assert client.get("/v1/adapters", headers=_h(key)).status_code == 401  # this process cleared its cache
    with services.sessions() as db:
        audit = db.scalars(select(AdminAuditEntry).order_by(AdminAuditEntry.id)).all()
    assert [(e.action, e.target_kind) for e in audit][-2:] == [("issue key", "tenant"), ("revoke key", "api key")]
    assert "nightly eval job" in (audit[-2].detail or "") and key not in str([e.detail for e in audit])
    with pytest.raises(Exception, match="64 printable"):
        tenant_controls.issue_key(services, OPS, tenant_id, "x" * 65)


def test_another_gateway_serves_a_suspended_tenant_for_at_most_its_auth_cache_time(gateway) -> None:
    """Gateway A suspends; gateway B (its own Services and auth cache, as another replica) has the key cached: it
    keeps serving until its entry expires, never longer."""
    settings = gateway.services.settings.model_copy(update={"auth_cache_seconds": 0.5})
    other = build_services(settings)
    try:
        key = gateway.keys["alice"]
        assert asyncio.run(tenant_for_key(other, key)).name == "alice"  # cached on B
        tenant_controls.suspend_tenant(gateway.services, OPS, gateway.tenant_ids["alice"], "abuse report")
        suspended_at = time.monotonic()
        while True:
            try:
                asyncio.run(tenant_for_key(other, key))
            except PermissionError as exc:
                assert "abuse report" in str(exc)
                break
            assert time.monotonic() - suspended_at < 0.5 + 0.2, "served past the auth cache's time"
            time.sleep(0.02)
    finally:
        other.redis.close()
