"""The gateway's cache of checked API keys: entries expire after the TTL, 0 turns it off, the size is bounded, and no
plaintext key is kept."""

from __future__ import annotations

from loraplex.service.auth_cache import AuthCache


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_entry_answers_until_its_ttl_then_expires() -> None:
    clock = Clock()
    cache: AuthCache[str] = AuthCache(2.0, clock=clock)
    cache.put("tml-key-aaaaaaaaaaaaaaaa", "alice")
    clock.now += 1.9
    assert cache.get("tml-key-aaaaaaaaaaaaaaaa") == "alice"
    assert cache.get("tml-key-bbbbbbbbbbbbbbbb") is None
    clock.now += 0.2
    assert cache.get("tml-key-aaaaaaaaaaaaaaaa") is None


def test_ttl_zero_never_caches() -> None:
    cache: AuthCache[str] = AuthCache(0.0)
    cache.put("tml-key-aaaaaaaaaaaaaaaa", "alice")
    assert cache.get("tml-key-aaaaaaaaaaaaaaaa") is None


def test_the_oldest_entries_go_past_the_bound_and_keys_are_held_hashed() -> None:
    cache: AuthCache[int] = AuthCache(60.0, max_entries=3)
    keys = [f"tml-key-{i:016d}" for i in range(5)]
    for i, key in enumerate(keys):
        cache.put(key, i)
    assert [cache.get(k) for k in keys] == [None, None, 2, 3, 4]
    assert not any(k in repr(cache._entries) for k in keys)
