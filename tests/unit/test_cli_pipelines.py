"""`loraplex pipelines status/cancel/export ID`: the 8 characters `status` prints (or any unique start) name a
pipeline; none or several is a clear error."""

from __future__ import annotations

import pytest

from loraplex.errors import InvalidRequestError, NotFoundError
from loraplex.launch.cli_pipelines import matching_ids

IDS = ["48697adf-9dc4-4fd6-a27f-39cd58b324d1", "486a0000-0000-0000-0000-000000000000", "e056a468-34a0-4ab6-8e0c"]


def test_a_unique_start_names_its_pipeline() -> None:
    assert matching_ids("48697adf", IDS) == IDS[0]
    assert matching_ids("e", IDS) == IDS[2]


def test_an_unknown_start_is_not_found() -> None:
    with pytest.raises(NotFoundError, match="starting with 'ff'"):
        matching_ids("ff", IDS)


def test_a_start_shared_by_several_asks_for_more() -> None:
    with pytest.raises(InvalidRequestError, match="starts 2 pipelines' ids"):
        matching_ids("486", IDS)


def test_the_cli_reaches_the_gateway_serve_starts_under_the_same_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """No --url and no LORAPLEX_BASE_URL: the pipelines commands talk to LORAPLEX_API_HOST:LORAPLEX_API_PORT, where
    `loraplex serve` listens in the same shell (a wildcard host as the loopback address)."""
    from loraplex.launch.cli_pipelines import _served_url
    from loraplex.settings import get_settings

    monkeypatch.delenv("LORAPLEX_BASE_URL", raising=False)
    monkeypatch.setenv("LORAPLEX_API_PORT", "8793")
    monkeypatch.setenv("LORAPLEX_API_HOST", "0.0.0.0")
    get_settings.cache_clear()
    try:
        assert _served_url() == "http://127.0.0.1:8793"
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()
