"""Which base models this deployment serves, and on which pools: pure, from the registry's snapshot (the live pools'
registrations, queue/pool_registry.py) and the gateway's own pool (settings.pool serving settings.base_model).

A base model is served when a live pool serves it. The gateway's own pool also keeps its base model served while no
live pool does (a one-pool deployment whose pool restarts, or has not registered yet): requests for it wait in that
pool's queue, as they always have. A registration outranks the settings: a live pool of the gateway's pool name that
serves another base model serves that one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from loraplex.errors import InvalidRequestError
from loraplex.queue.pool_registry import PoolRegistration


@dataclass(frozen=True)
class ServedModel:
    """One base model and the pools that serve it (by name; never empty)."""

    name: str
    pools: tuple[PoolRegistration, ...]

    @property
    def max_rank(self) -> int:
        """The largest rank every pool of the model takes (an adapter may be placed on any of them)."""
        return min(p.max_rank for p in self.pools)

    @property
    def target_modules(self) -> tuple[str, ...]:
        """The modules every pool of the model trains, in the first pool's order."""
        first, *rest = self.pools
        return tuple(m for m in first.target_modules if all(m in p.target_modules for p in rest))

    @property
    def stand_in(self) -> bool:
        """Served only by the gateway's own pool, unregistered (fleet_of)."""
        return any(p.published_at == 0 for p in self.pools)

    @property
    def sampleable_live(self) -> bool:
        """A live pool of the model samples (the stand-in's own figure is the gateway's guess: service/sampling.py)."""
        return any(p.sampleable for p in self.pools if p.published_at)

    @property
    def pool_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.pools)


@dataclass(frozen=True)
class Fleet:
    """The served base models, by name."""

    models: dict[str, ServedModel]

    @property
    def names(self) -> list[str]:
        return sorted(self.models)

    def model(self, base_model: str) -> ServedModel:
        """The served model of this name; InvalidRequestError (400) naming the served ones otherwise."""
        found = self.models.get(base_model)
        if found is None:
            served = ", ".join(repr(n) for n in self.names) or "none (no pool is running)"
            raise InvalidRequestError(f"base_model {base_model!r} is not served here; served: {served}")
        return found

    def pool(self, name: str) -> PoolRegistration | None:
        """A pool of the fleet by name (None: not live, and not the gateway's own)."""
        return next((p for m in self.models.values() for p in m.pools if p.name == name), None)


def fleet_of(live: Sequence[PoolRegistration], home: PoolRegistration) -> Fleet:
    """The fleet the live registrations make, with the gateway's own pool (`home`, from its settings) standing in for
    its base model while no live pool serves that."""
    by_model: dict[str, list[PoolRegistration]] = {}
    for pool in sorted(live, key=lambda p: p.name):
        by_model.setdefault(pool.base_model, []).append(pool)
    home_is_live = any(p.name == home.name for p in live)
    if not home_is_live and home.base_model not in by_model:
        by_model[home.base_model] = [home]
    return Fleet({name: ServedModel(name, tuple(pools)) for name, pools in sorted(by_model.items())})
