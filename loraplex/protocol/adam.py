"""AdamW's hyperparameters (Tinker's AdamParams), declared once: their names, defaults and bounds. The gateway's
request models (service/schemas.py, the Tinker route's body), the pipelines' optimizer config and the engine's
optimizer (workers/engine/optimizer.py) all read this table; stdlib only, so the client reads it too.

The bounds are PyTorch AdamW's (lr >= 0, 0 <= beta < 1, weight_decay >= 0) except eps, which must be positive: a
LoRA adapter starts with B = 0, so A's first gradient is exactly zero and AdamW with eps = 0 divides 0 by 0 (NaN
weights). grad_clip_norm 0 means no clipping (Tinker's wire value); a positive one clips the adapter's global norm.
Every value must be finite.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final


@dataclass(frozen=True)
class AdamField:
    """One hyperparameter: its default and its bounds (ge: >=, gt: >, lt: <; None: no such bound)."""

    name: str
    default: float
    ge: float | None = None
    gt: float | None = None
    lt: float | None = None

    def problem(self, value: object) -> str | None:
        """Why `value` is out of range for this field (None: it is fine)."""
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return f"{self.name} must be a finite number, got {value!r}"
        if (
            (self.ge is not None and value < self.ge)
            or (self.gt is not None and value <= self.gt)
            or (self.lt is not None and value >= self.lt)
        ):
            return f"{self.name} must be {self.bounds()}, got {value!r}"
        return None

    def bounds(self) -> str:
        """The bounds in words, e.g. ">= 0 and < 1"."""
        parts = [
            f"{op} {bound:g}" for op, bound in ((">=", self.ge), (">", self.gt), ("<", self.lt)) if bound is not None
        ]
        return " and ".join(parts)


ADAM_FIELDS: Final[tuple[AdamField, ...]] = (
    AdamField("learning_rate", 1e-4, ge=0.0),
    AdamField("beta1", 0.9, ge=0.0, lt=1.0),
    AdamField("beta2", 0.95, ge=0.0, lt=1.0),
    AdamField("eps", 1e-12, gt=0.0),
    AdamField("weight_decay", 0.0, ge=0.0),
    AdamField("grad_clip_norm", 0.0, ge=0.0),  # 0 = no clipping
)
ADAM_FIELD: Final[Mapping[str, AdamField]] = MappingProxyType({f.name: f for f in ADAM_FIELDS})
# Tinker's AdamParams defaults. Read-only: every reader shares this one copy.
ADAM_DEFAULTS: Final[Mapping[str, float]] = MappingProxyType({f.name: f.default for f in ADAM_FIELDS})


def adam_problems(values: Mapping[str, object]) -> list[str]:
    """What is wrong with these hyperparameters (by name; names not in the table are not looked at)."""
    return [p for f in ADAM_FIELDS if f.name in values and (p := f.problem(values[f.name])) is not None]


__all__ = ["ADAM_DEFAULTS", "ADAM_FIELD", "ADAM_FIELDS", "AdamField", "adam_problems"]
