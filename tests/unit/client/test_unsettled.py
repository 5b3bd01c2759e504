"""The client's table of unsettled futures (client/unsettled.py): which others a poll names, and settling from a
poll's answer."""

from __future__ import annotations

import gc
from typing import Any

from loraplex.client.unsettled import MAX_ALSO, UnsettledFutures


class _Future:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.body: dict[str, Any] | None = None

    def settle_from(self, body: dict[str, Any]) -> None:
        self.body = body


def test_others_are_the_live_unsettled_futures_oldest_first_up_to_the_cap() -> None:
    table = UnsettledFutures()
    futures = [_Future(f"r{i}") for i in range(MAX_ALSO + 5)]
    for f in futures:
        table.add(f)
    assert table.others("r0") == [f"r{i}" for i in range(1, MAX_ALSO + 1)]
    table.discard("r1")
    del futures[2]  # dropped unawaited: it leaves the table
    gc.collect()
    assert table.others("r0")[:3] == ["r3", "r4", "r5"]
    assert "r2" not in table.others("r0")


def test_settle_hands_each_body_to_its_future_once() -> None:
    table = UnsettledFutures()
    a, b = _Future("a"), _Future("b")
    table.add(a)
    table.add(b)
    table.settle([{"request_id": "b", "state": "complete", "result": {}}, {"request_id": "zzz", "state": "failed"}])
    assert b.body == {"request_id": "b", "state": "complete", "result": {}} and a.body is None
    assert table.others("x") == ["a"]  # b is settled: no poll names it again
