"""The SQL statement counter: each statement an engine from make_db_engine sends counts once under its verb (on a
real SQLite file), the process-wide counter included, and its listeners (the pool's Prometheus counter) see each."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text

from loraplex.pool.metrics import PoolMetrics
from loraplex.storage.db import make_db_engine, session_factory, unit_of_work
from loraplex.storage.statement_count import OTHER, STATEMENTS, StatementCounts, count_statements, statement_verb


def test_verb_is_the_first_keyword_or_other() -> None:
    assert statement_verb("SELECT 1") == "select"
    assert statement_verb("\n  insert into t values (1)") == "insert"
    assert statement_verb("BEGIN IMMEDIATE") == "begin"
    assert statement_verb("PRAGMA busy_timeout = 1") == OTHER
    assert statement_verb("WITH q AS (SELECT 'secret') SELECT * FROM q") == OTHER  # never the text as a label
    assert statement_verb("") == OTHER


def test_every_statement_of_an_engine_counts_once(tmp_path: Path) -> None:
    engine = make_db_engine(f"sqlite:///{tmp_path / 'x.db'}")
    counts = StatementCounts()
    count_statements(engine, counts)
    seen: list[str] = []
    counts.subscribe(seen.append)
    before = STATEMENTS.snapshot()
    factory = session_factory(engine)
    with unit_of_work(factory) as session:  # BEGIN IMMEDIATE (the SQLite hook), CREATE, INSERT, COMMIT
        session.execute(text("CREATE TABLE t (x INTEGER)"))
        session.execute(text("INSERT INTO t VALUES (1)"))
    with factory() as session:  # BEGIN (deferred), SELECT, ROLLBACK at close
        assert session.execute(text("SELECT x FROM t")).scalar_one() == 1
    engine.dispose()
    got = counts.snapshot()
    assert got["begin"] == 2 and got["insert"] == 1 and got["select"] == 1
    assert got["commit"] == 1 and got["rollback"] == 1  # the read session's rollback at close
    assert got[OTHER] == 1  # the CREATE (the connect hook's PRAGMAs run below SQLAlchemy: not counted)
    assert sorted(seen) == sorted(verb for verb, n in got.items() for _ in range(n))
    after = STATEMENTS.snapshot()  # make_db_engine counted the same statements in the process's counter
    assert after["insert"] - before.get("insert", 0) == 1 and after["select"] - before.get("select", 0) == 1


def test_the_pools_counter_follows_its_subscription() -> None:
    counts, metrics = StatementCounts(), PoolMetrics("p-sql")
    counts.subscribe(metrics.sql_statement)
    for verb in ("select", "select", "update"):
        counts.add(verb)
    samples = {
        (s.name, s.labels.get("verb")): s.value
        for family in text_string_to_metric_families(metrics.exposition().decode())
        for s in family.samples
        if s.name == "loraplex_pool_sql_statements_total"
    }
    assert samples == {("loraplex_pool_sql_statements_total", "select"): 2,
                       ("loraplex_pool_sql_statements_total", "update"): 1}  # fmt: skip
