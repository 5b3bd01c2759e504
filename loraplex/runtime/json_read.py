"""JSON read by orjson where it reads as the standard library does (~5x faster on token lists and logprobs: a
forward_backward body of 4,096 tokens with targets and weights, 60 KB, 1.1 ms -> 0.2 ms), and by the standard library
where it would not: what orjson refuses (NaN and Infinity literals, numbers past a double such as 1e400, lone
surrogates, encodings other than UTF-8) gets the standard library's value or error, and an integer past 64 bits
(which orjson reads as a float) stays an integer."""

from __future__ import annotations

import json
from typing import Any

import orjson

# A run of 19 digits: possibly an integer outside orjson's 64 bits (-9223372036854775809 has 19); every integer of
# fewer digits is inside. The check takes ~50 us on 60 KB (a regex: ~600).
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_NUMBER = b"0" * 19


def parse_json(text: bytes) -> Any:
    """What `json.loads(text)` returns or raises."""
    if _LONG_NUMBER not in text.translate(_DIGITS_AS_ZERO):
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:
            pass  # refused by orjson: the standard library's answer, value or error
    return json.loads(text)
