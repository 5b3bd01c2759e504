"""Defaults of the wire protocol that the client, the gateway's request schemas and the workers must agree on. Plain
values with no imports of loraplex, so the client reads them without importing any server code."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

# Tinker's AdamParams defaults (AdamW; grad_clip_norm 0 = no clipping). Read-only: every reader shares this one copy.
ADAM_DEFAULTS: Final[Mapping[str, float]] = MappingProxyType(
    {
        "learning_rate": 1e-4,
        "beta1": 0.9,
        "beta2": 0.95,
        "eps": 1e-12,
        "weight_decay": 0.0,
        "grad_clip_norm": 0.0,
    }
)
