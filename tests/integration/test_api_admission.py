"""Admission control at the gateway, so one tenant cannot hold the others (unbounded, a 235 MB body is parsed for
13 s, a valid 24.5 MB body holds the pool 93 s, one tenant queues 5,000 requests on 500 adapters): a body over the byte
limit is a 413
before it is read to the end, a request over the token limit a 413, a tenant over its queue quotas a 429 with
Retry-After, over its adapter quota a 429 without. A refused chain step still holds its seq_id."""

from __future__ import annotations

import pytest

from loraplex.settings import Settings
from tests.helpers.queued import rejections
from tests.integration.conftest import gateway_app


@pytest.fixture()
def small(tmp_path, redis_url):
    settings = Settings(
        home=tmp_path,
        redis_url=redis_url,
        pool=f"adm-{tmp_path.name}",
        max_body_bytes=64 * 1024,
        max_tokens_per_request=1000,
        max_queued_requests_per_tenant=4,  # the create_adapter is one of them
        max_queued_tokens_per_tenant=1500,
        max_adapters_per_tenant=2,
    )
    with gateway_app(settings) as gw:
        headers = {"X-API-Key": gw.keys["alice"]}
        model_id = gw.client.post("/v1/adapters", json={"rank": 4}, headers=headers).json()["model_id"]
        yield gw, headers, model_id


def _fb(seq_id: int, tokens: int) -> dict:
    return {"seq_id": seq_id, "data": [{"model_input": [1] * tokens, "loss_fn_inputs": {"target_tokens": [1] * tokens}}]}


def test_a_body_over_the_byte_limit_is_413_before_it_is_read(small) -> None:
    gw, headers, model_id = small
    url = f"/v1/adapters/{model_id}/forward_backward"
    big = _fb(1, 30_000)  # ~180 kB of JSON: over 64 kB
    response = gw.client.post(url, json=big, headers={**headers, "X-Seq-Id": "1"})
    assert response.status_code == 413 and response.json()["type"] == "RequestTooLargeError", response.text
    assert "65536 bytes" in response.json()["detail"]
    assert rejections(gw.services)[(model_id, 1)].payload.to_wire()["error_type"] == "RequestTooLargeError"  # seq_id 1 held

    ok = gw.client.post(url, json=_fb(2, 10), headers=headers)
    assert ok.status_code == 202, ok.text


def test_a_request_over_the_token_limit_is_413_naming_the_limit_and_holds_its_seq_id(small) -> None:
    gw, headers, model_id = small
    response = gw.client.post(f"/v1/adapters/{model_id}/forward_backward", json=_fb(1, 1001), headers=headers)
    assert response.status_code == 413 and "1001 tokens; at most 1000" in response.json()["detail"]
    assert (model_id, 1) in rejections(gw.services)


def test_queue_quotas_answer_429_with_retry_after_and_the_same_request_goes_later(small) -> None:
    gw, headers, model_id = small
    url = f"/v1/adapters/{model_id}/forward_backward"
    for seq in (1, 2):
        assert gw.client.post(url, json=_fb(seq, 600), headers=headers).status_code == 202
    over_tokens = gw.client.post(url, json=_fb(3, 600), headers=headers)  # 1,200 queued + 600 > 1,500
    assert over_tokens.status_code == 429 and over_tokens.headers["retry-after"] == "1"
    assert "1200 tokens queued" in over_tokens.json()["detail"]
    assert gw.client.post(url, json=_fb(3, 10), headers=headers).status_code == 202  # not spent: a smaller one fits
    opt = gw.client.post(f"/v1/adapters/{model_id}/optim_step", json={"seq_id": 4}, headers=headers)
    assert opt.status_code == 429 and "4 requests queued; the quota is 4" in opt.json()["detail"]
    assert (model_id, 3) not in rejections(gw.services) and (model_id, 4) not in rejections(gw.services)
    bob = {"X-API-Key": gw.keys["bob"]}  # another tenant is not held back by alice's queue
    bobs = gw.client.post("/v1/adapters", json={"rank": 4}, headers=bob).json()["model_id"]
    assert gw.client.post(f"/v1/adapters/{bobs}/forward_backward", json=_fb(1, 600), headers=bob).status_code == 202


def test_the_adapter_quota_is_429_without_retry_after(small) -> None:
    gw, headers, _ = small
    assert gw.client.post("/v1/adapters", json={"rank": 4}, headers=headers).status_code == 202
    third = gw.client.post("/v1/adapters", json={"rank": 4}, headers=headers)
    assert third.status_code == 429 and "retry-after" not in third.headers
    assert "2 adapters, its quota" in third.json()["detail"]
    assert len(gw.client.get("/v1/adapters", headers=headers).json()) == 2
