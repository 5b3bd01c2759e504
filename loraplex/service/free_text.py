"""Free-form text a caller gives to be stored and answered back later (user_metadata, session tags): it must be
encodable as UTF-8 and hold no NUL (PostgreSQL refuses it). JSON lets a lone UTF-16 surrogate in (the escape "\\ud800"); stored, it would make every later
answer that quotes it fail to render (the tenant's run listings would be 500s for good). So it is a 400 at once."""

from __future__ import annotations

from typing import Any

from loraplex.errors import InvalidRequestError


def check_storable(value: Any, where: str) -> None:
    """InvalidRequestError naming the field if any string in `value` (nested dicts' keys and values, lists) is not
    encodable as UTF-8."""
    if isinstance(value, str):
        if "\x00" in value:  # PostgreSQL text and JSON cannot hold it
            raise InvalidRequestError(f"{where} holds a NUL character, which cannot be stored")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            quoted = value[:80].encode("utf-8", "backslashreplace").decode("utf-8")
            raise InvalidRequestError(
                f"{where} holds text that is not valid Unicode (a lone surrogate): '{quoted}'"
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_storable(key, f"{where} (a key)")
            check_storable(item, f"{where}.{key}" if isinstance(key, str) and key.isprintable() else where)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            check_storable(item, f"{where}[{i}]")
