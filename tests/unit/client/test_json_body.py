"""client/json_body.py: a training body written by orjson reads back as the body, and a non-finite number anywhere in
it is refused naming its field, as the walk over every number found it (however orjson writes it)."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.client.json_body import check_finite, encode, first_non_finite
from loraplex.errors import InvalidRequestError

leaves = (
    st.none() | st.booleans() | st.text(max_size=6) | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.floats(allow_nan=True, allow_infinity=True).map(np.float64)  # a float subclass orjson does not write
)  # fmt: skip
bodies = st.recursive(
    leaves,
    lambda inner: st.lists(inner, max_size=5) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=6), inner, max_size=5),
    max_leaves=30,
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(bodies)
def test_a_body_is_refused_exactly_when_it_holds_a_non_finite_number_naming_it(body) -> None:
    bad = first_non_finite(body)
    if bad is None:
        check_finite(body)
        assert json.loads(encode(body)) == json.loads(json.dumps(body))
    else:
        with pytest.raises(InvalidRequestError, match=f"^{re.escape(bad)}: must be a finite number"):
            check_finite(body)


def test_a_training_body_names_the_bad_weight() -> None:
    body = {"data": [{"model_input": [1, 2], "loss_fn_inputs": {"target_tokens": [2, 3], "weights": [1.0, math.inf]}}],
            "loss_fn": "cross_entropy", "loss_fn_config": {}}  # fmt: skip
    with pytest.raises(InvalidRequestError, match=r"^data\.0\.loss_fn_inputs\.weights\.1: must be a finite number"):
        check_finite(body)
    body["data"][0]["loss_fn_inputs"]["weights"][1] = 0.5
    check_finite(body)
    assert json.loads(encode(body)) == body


def test_values_orjson_does_not_write_are_written_as_before() -> None:
    body = {1: [np.float64(0.25)], "s": "\ud800"}  # a non-string key, a float subclass, a lone surrogate
    check_finite(body)
    assert encode(body) == json.dumps(body).encode()
