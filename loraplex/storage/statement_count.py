"""Counts the SQL statements this process sends, by verb (SELECT, INSERT, UPDATE, DELETE, BEGIN, COMMIT, ...): every
engine make_db_engine builds reports each statement here through SQLAlchemy's `before_cursor_execute` event. The
composition roots subscribe a Prometheus counter (the pool's and the gateway's metrics); storage/ itself imports no
prometheus. What a plan or a request costs the database is what an operator sizes PostgreSQL by (ARCHITECTURE.md,
"A fleet of 1,000 GPUs")."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, event

# The verbs counted by name; any other first keyword (PRAGMA, SAVEPOINT, WITH, ...) counts as "other", so a
# statement's text never becomes a label.
VERBS = ("select", "insert", "update", "delete", "begin", "commit", "rollback")
OTHER = "other"


def statement_verb(statement: str) -> str:
    """The statement's first keyword, lower case, when it is one of VERBS, else OTHER."""
    head = statement.lstrip().split(None, 1)
    verb = head[0].lower() if head else ""
    return verb if verb in VERBS else OTHER


class StatementCounts:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._listeners: list[Callable[[str], None]] = []

    def add(self, verb: str) -> None:
        with self._lock:
            self._counts[verb] = self._counts.get(verb, 0) + 1
            listeners = list(self._listeners)
        for listener in listeners:
            listener(verb)

    def subscribe(self, listener: Callable[[str], None]) -> None:
        """Call `listener(verb)` on every statement from now on (on the thread that sends it)."""
        with self._lock:
            self._listeners.append(listener)

    def snapshot(self) -> dict[str, int]:
        """Statements sent since the process started, per verb."""
        with self._lock:
            return dict(self._counts)


STATEMENTS = StatementCounts()  # the process's: every engine of it counts here


def count_statements(engine: Engine, counts: StatementCounts = STATEMENTS) -> None:
    """Count every statement `engine` sends to the database: those run through a cursor (the SQLite hook's own BEGIN
    too) and the commits and rollbacks, which the driver sends without one (each a round trip all the same)."""

    def before_cursor_execute(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        counts.add(statement_verb(statement))

    event.listen(engine, "before_cursor_execute", before_cursor_execute)
    event.listen(engine, "commit", lambda _conn: counts.add("commit"))
    event.listen(engine, "rollback", lambda _conn: counts.add("rollback"))
