"""A throwaway redis-server for tests: `with redis_server() as url: r = redis.Redis.from_url(url)`. The product's own
child-process runner (loopback, no persistence, SHUTDOWN NOSAVE, reaped) is what the tests use too."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from loraplex.redis_child import RedisChild


@contextmanager
def redis_server() -> Iterator[str]:
    """Start redis-server on a free port, yield its URL (`redis://127.0.0.1:PORT/0`), shut it down on exit."""
    with RedisChild() as child:
        yield child.url
