"""Test data as the engine reads it: the fixtures write datums in their JSON form (dicts, easy to vary and index), and
`datums` turns them into the payloads the pool's decoder hands the engine, through that same decoder."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from loraplex.protocol.payloads import DatumPayload


def datums(data: Iterable[Mapping[str, Any]]) -> list[DatumPayload]:
    """Each datum's JSON form ({"model_input": [...], "loss_fn_inputs": {...}}) as a DatumPayload; ValueError naming
    the field when one does not fit the payload's types, as the pool's decoder would refuse it."""
    return [DatumPayload.from_wire(d) for d in data]


def with_datums(item: Sequence[Any]) -> tuple[Any, ...]:
    """An engine.prepare argument tuple kept in its JSON form by a test, (model_id, data, loss_fn, ...), with its data
    as payloads (the tests' oracles read the same tuples' dicts)."""
    model_id, data, *rest = item
    return (model_id, datums(data), *rest)
