"""runtime/json_read.py and api/json_body.py: orjson reads the gateway's request bodies (and the client's answers),
and every body reads as the standard library reads it (the same values, the same types, the same errors), so the
routes accept and refuse exactly what they did."""

from __future__ import annotations

import json
import math

import pytest
from fastapi.routing import APIRoute
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.api.app import create_app
from loraplex.api.json_body import JsonBodyRoute
from loraplex.runtime.json_read import parse_json
from loraplex.settings import Settings


def _same(a, b) -> bool:
    """Equal values of equal types all the way down (1 == 1.0 is not enough: an int field reads them differently)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b and (not isinstance(a, float) or math.copysign(1, a) == math.copysign(1, b))


def _both(body: bytes):
    """(parse_json's answer, json.loads's answer): a value or the error's type, message and position."""
    out = []
    for parse in (parse_json, json.loads):
        try:
            out.append(parse(body))
        except ValueError as exc:
            out.append(("error", type(exc).__name__, str(exc)))
    return out


json_values = st.recursive(
    st.none() | st.booleans() | st.text()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=True, allow_infinity=True),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
    max_leaves=40,
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(json_values, st.booleans())
def test_every_value_reads_as_the_standard_library_reads_it(value, ascii_only) -> None:
    body = json.dumps(value, ensure_ascii=ascii_only).encode()
    ours, stdlib = _both(body)
    assert _same(ours, stdlib), (body[:200], ours, stdlib)


@pytest.mark.parametrize(
    "body",
    [
        b"[NaN, Infinity, -Infinity]",  # not JSON, accepted by Python: the routes refuse them by field (422)
        b"[1e400, -1e400, 1e-400, -0.0, 0.1, 5e-324]",  # past a double, to zero, the smallest double
        b"[18446744073709551615, 18446744073709551616, -9223372036854775809, 123456789012345678901234567890]",
        b"[100000000000000000000.5, 0.12345678901234567890123, -9223372036854775808]",  # long numbers orjson reads right
        b'["\\ud800", "\\udfff\\ud800", "\\u00e9", "\xc3\xa9"]',  # lone surrogates; an escape and UTF-8 for one letter
        b'{"a": 1, "a": 2}',  # a repeated key: the last one
        b"\xef\xbb\xbf{}",  # a byte-order mark
        '{"a": [1, 2.5, "x"]}'.encode("utf-16"),
        '{"a": [1, 2.5, "x"]}'.encode("utf-32-le"),
        b'{"a": 1,}', b"[1, 2", b"", b"   ", b'"\x01"', b"\xff\xfe\xfd", b"[01]", b"{'a': 1}",  # not JSON at all
    ],
)  # fmt: skip
def test_what_orjson_reads_differently_or_refuses_reads_as_before(body: bytes) -> None:
    ours, stdlib = _both(body)
    assert _same(ours, stdlib), (ours, stdlib)


def test_a_big_integer_stays_an_integer() -> None:
    assert parse_json(b'{"seed": 123456789012345678901234567890}') == {"seed": 123456789012345678901234567890}
    assert type(parse_json(b"[18446744073709551615]")[0]) is int


def test_every_route_of_the_gateway_reads_its_body_this_way(tmp_path) -> None:
    app = create_app(Settings(home=tmp_path))
    routes = [r for r in app.routes if isinstance(r, APIRoute)]
    assert routes
    assert [r.path for r in routes if not isinstance(r, JsonBodyRoute)] == []
