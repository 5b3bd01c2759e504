"""Counting the calls of a function a test wants to see used (the real function still runs)."""

from __future__ import annotations

from typing import Any

import pytest


class CallCount:
    """Replaces `owner.name` (for the test, through monkeypatch) by a wrapper that counts its calls in `calls`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> None:
        self.calls = 0
        inner = getattr(owner, name)

        def counting(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return inner(*args, **kwargs)

        monkeypatch.setattr(owner, name, counting)
