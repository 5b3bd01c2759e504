"""The loss functions a forward_backward may name (Tinker's, plus gspo and stable_reinforce), listed once: the gateway's
request model (service/schemas.py LossFn) accepts exactly these, and the engine's registry (workers/engine/losses.py
LOSSES) implements exactly these (tests/unit/workers/test_engine_losses.py holds the two together). Stdlib only."""

from __future__ import annotations

from typing import Final

LOSS_NAMES: Final[tuple[str, ...]] = (
    "cross_entropy",
    "importance_sampling",
    "ppo",
    "cispo",
    "dro",
    "gspo",
    "stable_reinforce",
)

__all__ = ["LOSS_NAMES"]
