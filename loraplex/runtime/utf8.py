"""Text that UTF-8 can encode: JSON and Python strings may hold a lone surrogate ("\\ud800"), which UTF-8 cannot."""

from __future__ import annotations


def utf8_safe(text: str) -> str:
    """`text`, with any lone surrogate as its backslash escape (the same string where there is none)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text
