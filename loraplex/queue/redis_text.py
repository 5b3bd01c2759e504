"""Redis replies as text: clients made with or without `decode_responses` hand back bytes or str."""

from __future__ import annotations


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
