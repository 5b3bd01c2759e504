"""Every non-finite number in a request body is a 422 naming the field (never a plain-text 500 and a reset connection,
nor an inf written as JSON null and read back as the default). The 422 body itself is valid JSON, and a
rejected request queues nothing."""

from __future__ import annotations

import json

import pytest

from tests.helpers.queued import queued_work, rejections


@pytest.fixture()
def alice(gateway):
    headers = {"X-API-Key": gateway.keys["alice"], "Content-Type": "application/json"}
    model_id = gateway.client.post("/v1/adapters", json={"rank": 4}, headers=headers).json()["model_id"]
    return gateway, headers, model_id


def _post(gateway, path: str, body_text: str, headers: dict):
    return gateway.client.post(path, content=body_text.encode(), headers=headers)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("optim_step", '{{"seq_id": 1, "adam_params": {{"learning_rate": {x}}}}}', "learning_rate"),
        ("optim_step", '{{"seq_id": 1, "adam_params": {{"beta1": {x}}}}}', "beta1"),
        ("forward_backward", '{{"seq_id": 1, "data": [{{"model_input": [1, 2], "loss_fn_inputs": '
         '{{"target_tokens": [2, 3], "weights": [1.0, {x}]}}}}]}}', "weights"),
        ("forward_backward", '{{"seq_id": 1, "data": [{{"model_input": [1, 2], "loss_fn_inputs": '
         '{{"target_tokens": [2, 3]}}}}], "loss_fn_config": {{"clip": {x}}}}}', "loss_fn_config"),
    ],
)  # fmt: skip
def test_non_finite_numbers_in_training_calls_are_422_naming_the_field(alice, literal, path, body, field) -> None:
    gateway, headers, model_id = alice
    before = queued_work(gateway.services)
    response = _post(gateway, f"/v1/adapters/{model_id}/{path}", body.format(x=literal), headers)
    assert response.status_code == 422, response.text
    detail = json.loads(response.text)["detail"]  # valid JSON, whatever the input held
    assert any(field in ".".join(str(p) for p in e["loc"]) for e in detail), detail
    assert queued_work(gateway.services) == before  # nothing to train on; only the rejection holds seq_id 1
    assert field in rejections(gateway.services)[(model_id, 1)].payload.to_wire()["message"]


@pytest.mark.parametrize("literal", ["NaN", "Infinity"])
def test_a_non_finite_alpha_creates_nothing(alice, literal) -> None:
    gateway, headers, _ = alice
    before = gateway.client.get("/v1/adapters", headers=headers).json()
    response = _post(gateway, "/v1/adapters", f'{{"rank": 4, "alpha": {literal}}}', headers)
    assert response.status_code == 422 and "alpha" in response.text
    assert gateway.client.get("/v1/adapters", headers=headers).json() == before
