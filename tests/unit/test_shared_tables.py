"""Tables written once and read by several layers: the HTTP status of each error (gateway and client) and Tinker's
AdamParams defaults (client, gateway schema, workers)."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from loraplex import errors
from loraplex.client.transport import raise_for_status
from loraplex.client.types import AdamParams as ClientAdamParams
from loraplex.protocol.defaults import ADAM_DEFAULTS
from loraplex.service.schemas import AdamParams as SchemaAdamParams


def test_each_error_has_one_status_and_the_client_maps_it_back() -> None:
    for cls, status in errors.HTTP_STATUS_BY_ERROR.items():
        assert errors.http_status_for(cls("x")) == status
        assert errors.error_class_for_status(status) is cls
    assert errors.error_class_for_status(422) is errors.InvalidRequestError  # FastAPI's validation answer
    assert errors.error_class_for_status(418) is errors.LoraplexError
    assert errors.http_status_for(errors.EngineError("x")) == 500
    assert errors.http_status_for(errors.LoraplexError("x")) == 500


def test_a_subclass_takes_its_bases_status() -> None:
    class Stale(errors.ConflictError):
        pass

    assert errors.http_status_for(Stale("x")) == 409


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (400, errors.InvalidRequestError),
        (404, errors.NotFoundError),
        (409, errors.ConflictError),
        (429, errors.CapacityError),
        (401, errors.AuthenticationError),
        (500, errors.LoraplexError),
    ],
)
def test_the_client_raises_the_typed_error_of_a_status(status: int, cls: type[errors.LoraplexError]) -> None:
    response = httpx.Response(status, json={"detail": "why"})
    with pytest.raises(cls, match=f"HTTP {status}: why") as caught:
        raise_for_status(response)
    assert type(caught.value) is cls


def test_adam_defaults_are_one_table() -> None:
    assert ADAM_DEFAULTS == {
        "learning_rate": 1e-4,
        "beta1": 0.9,
        "beta2": 0.95,
        "eps": 1e-12,
        "weight_decay": 0.0,
        "grad_clip_norm": 0.0,
    }
    assert ClientAdamParams().to_json() == dict(ADAM_DEFAULTS)
    assert SchemaAdamParams().model_dump() == dict(ADAM_DEFAULTS)
    with pytest.raises(TypeError):
        ADAM_DEFAULTS["learning_rate"] = 1.0  # type: ignore[index]


def test_the_workers_adam_defaults_agree() -> None:
    from loraplex.workers.engine.optimizer import AdamParams as WorkerAdamParams

    assert dataclasses.asdict(WorkerAdamParams()) == dict(ADAM_DEFAULTS)
