"""A rejected chain step leaves no hole (an unfilled seq_id would hold the caller's next call until the gap timeout,
then fail it). Through the gateway's HTTP routes on real Redis and SQLite, no pool: a body that fails validation is
queued as a `rejected` request in its seq_id's place; a foreign adapter, a bad key or a body without a usable seq_id
queues nothing."""

from __future__ import annotations

import pytest

from tests.helpers.queued import queued_work, rejections

KIND_OF_ROUTE = {"save_weights_for_sampler": "save_sampler"}
DATUM = {"model_input": [1, 2], "loss_fn_inputs": {"target_tokens": [2, 3]}}


@pytest.fixture()
def alice(gateway):
    headers = {"X-API-Key": gateway.keys["alice"]}
    model_id = gateway.client.post("/v1/adapters", json={"rank": 4}, headers=headers).json()["model_id"]
    return gateway, headers, model_id


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [
        ("forward_backward", {"seq_id": 1, "data": [DATUM], "loss_fn": "nope"}, "loss_fn"),
        ("forward", {"seq_id": 1, "data": [{"model_input": [-1]}]}, "negative token"),
        ("optim_step", {"seq_id": 1, "adam_params": {"beta1": 2}}, "adam_params.beta1"),
        ("save_state", {"seq_id": 1, "name": ""}, "name"),
        ("save_weights_for_sampler", {"seq_id": 1, "name": "x", "extra": 1}, "extra"),
        ("load_state", {"seq_id": 1}, "path"),
    ],
)
def test_an_invalid_body_holds_its_seq_id_with_the_error(alice, route, body, field) -> None:
    gateway, headers, model_id = alice
    before = queued_work(gateway.services)
    response = gateway.client.post(f"/v1/adapters/{model_id}/{route}", json=body, headers=headers)
    assert response.status_code == 422, response.text
    held = rejections(gateway.services)[(model_id, 1)]
    assert held.payload.to_wire()["rejected_kind"] == KIND_OF_ROUTE.get(route, route) and field in held.payload.to_wire()["message"]
    assert held.tenant_id == gateway.tenant_ids["alice"] and queued_work(gateway.services) == before
    # The same bad call again queues nothing more; a valid call under the spent seq_id is a 409 naming it.
    assert gateway.client.post(f"/v1/adapters/{model_id}/{route}", json=body, headers=headers).status_code == 422
    assert len(rejections(gateway.services)) == 1
    reuse = gateway.client.post(
        f"/v1/adapters/{model_id}/forward_backward", json={"seq_id": 1, "data": [DATUM]}, headers=headers
    )
    assert reuse.status_code == 409 and "rejected" in reuse.json()["detail"]
    ok = gateway.client.post(f"/v1/adapters/{model_id}/forward_backward", json={"seq_id": 2, "data": [DATUM]},
                             headers=headers)  # fmt: skip
    assert ok.status_code == 202


def test_nothing_is_held_without_an_owned_adapter_a_key_or_a_seq_id(alice) -> None:
    gateway, headers, model_id = alice
    bad = {"seq_id": 1, "data": [DATUM], "loss_fn": "nope"}
    bob = {"X-API-Key": gateway.keys["bob"]}
    assert gateway.client.post(f"/v1/adapters/{model_id}/forward_backward", json=bad, headers=bob).status_code in (
        404, 422,
    )  # fmt: skip
    wrong_key = {"X-API-Key": "tml-not-a-key"}
    assert (
        gateway.client.post(f"/v1/adapters/{model_id}/forward_backward", json=bad, headers=wrong_key).status_code == 401
    )
    unknown = gateway.client.post(f"/v1/adapters/{'0' * 32}/forward_backward", json=bad, headers=headers)
    assert unknown.status_code in (404, 422)
    for body in ({"data": [DATUM], "loss_fn": "nope"}, {"seq_id": "1", "loss_fn": "nope"}, {"seq_id": -3}, [1, 2]):
        response = gateway.client.post(f"/v1/adapters/{model_id}/forward_backward", json=body, headers=headers)
        assert response.status_code == 422
    not_json = gateway.client.post(
        f"/v1/adapters/{model_id}/forward_backward",
        content=b"{nope",
        headers={**headers, "Content-Type": "application/json"},
    )
    assert not_json.status_code == 422
    assert rejections(gateway.services) == {}
