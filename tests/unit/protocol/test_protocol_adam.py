"""AdamW's hyperparameters are declared once (protocol/adam.py): every reader has exactly its names and defaults, and
each refuses exactly what the table's bounds refuse, naming the field (the gateway's request model, the Tinker
route's body, the pipelines' optimizer config, the engine's optimizer)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from pydantic import BaseModel, ValidationError

from loraplex.api.tinker.schemas import AdamParamsBody
from loraplex.client.types import AdamParams as ClientAdamParams
from loraplex.errors import InvalidRequestError
from loraplex.protocol.adam import ADAM_DEFAULTS, ADAM_FIELD, ADAM_FIELDS, adam_problems
from loraplex.service.pipeline_config import OptimizerConfig
from loraplex.service.schemas import AdamParams

NAMES = [f.name for f in ADAM_FIELDS]
MODELS: list[type[BaseModel]] = [AdamParams, AdamParamsBody, OptimizerConfig]


def _cases(name: str) -> tuple[list[float], list[float]]:
    """(values the bounds accept, values they refuse) for one field: its edges and just past them."""
    f = ADAM_FIELD[name]
    good, bad = [f.default], [math.nan, math.inf]
    if f.ge is not None:
        good.append(f.ge)
        bad.append(f.ge - 1e-9)
    if f.gt is not None:
        good.append(f.gt + 1e-30)
        bad.append(f.gt)
    if f.lt is not None:
        good.append(f.lt - 1e-9)
        bad.append(f.lt)
    return good, bad


def test_the_table() -> None:
    assert NAMES == ["learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"]
    assert dict(ADAM_DEFAULTS) == {f.name: f.default for f in ADAM_FIELDS}
    assert adam_problems(ADAM_DEFAULTS) == []
    assert adam_problems({"eps": 0.0}) == ["eps must be > 0, got 0.0"]
    assert adam_problems({"beta1": 1.0, "other": -1}) == ["beta1 must be >= 0 and < 1, got 1.0"]


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_request_models_declare_the_table(model: type[BaseModel]) -> None:
    adam = {name: field for name, field in model.model_fields.items() if name in ADAM_FIELD}
    assert list(adam) == NAMES
    assert {name: field.default for name, field in adam.items()} == dict(ADAM_DEFAULTS)


def test_the_client_and_the_engine_declare_the_table() -> None:
    from loraplex.workers.engine.optimizer import AdamParams as EngineAdamParams

    assert [f.name for f in dataclasses.fields(ClientAdamParams)] == NAMES
    assert [f.name for f in dataclasses.fields(EngineAdamParams)] == NAMES
    assert dataclasses.asdict(EngineAdamParams()) == dict(ADAM_DEFAULTS)


@pytest.mark.parametrize("name", NAMES)
def test_every_reader_applies_the_same_bounds(name: str) -> None:
    from loraplex.workers.engine.optimizer import AdamParams as EngineAdamParams

    good, bad = _cases(name)
    for value in good:
        for model in MODELS:
            assert getattr(model.model_validate({name: value}), name) == value
        assert getattr(EngineAdamParams.from_dict({name: value}), name) == value
    for value in bad:
        for model in MODELS:
            with pytest.raises(ValidationError) as caught:
                model.model_validate({name: value})
            assert [e["loc"] for e in caught.value.errors()] == [(name,)]
        with pytest.raises(InvalidRequestError, match=f"adam_params.{name} "):
            EngineAdamParams.from_dict({name: value})
