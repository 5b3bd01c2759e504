"""Plain data the client sends. Dicts in the same shape are accepted wherever these are."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from loraplex.protocol.defaults import ADAM_DEFAULTS


@dataclass
class Datum:
    """One sequence. `target_tokens[i]` is the token scored at position i; `weights[i]` its weight in the summed loss."""

    model_input: Sequence[int]
    loss_fn_inputs: dict[str, Sequence[float] | Sequence[int]] = field(default_factory=dict)

    @classmethod
    def for_next_token(cls, tokens: Sequence[int], weights: Sequence[float] | None = None) -> Datum:
        """Causal LM training on `tokens`: input tokens[:-1], targets tokens[1:]."""
        if len(tokens) < 2:
            raise ValueError("need at least 2 tokens for next-token prediction")
        n = len(tokens) - 1
        w = list(weights)[1:] if weights is not None else [1.0] * n
        return cls(model_input=list(tokens[:-1]), loss_fn_inputs={"target_tokens": list(tokens[1:]), "weights": w})

    def to_json(self) -> dict[str, Any]:
        return {
            "model_input": [int(t) for t in self.model_input],
            "loss_fn_inputs": {k: list(v) for k, v in self.loss_fn_inputs.items()},
        }


@dataclass
class AdamParams:
    """AdamW settings of one optim_step; each default is Tinker's (loraplex.protocol.defaults)."""

    learning_rate: float = ADAM_DEFAULTS["learning_rate"]
    beta1: float = ADAM_DEFAULTS["beta1"]
    beta2: float = ADAM_DEFAULTS["beta2"]
    eps: float = ADAM_DEFAULTS["eps"]
    weight_decay: float = ADAM_DEFAULTS["weight_decay"]
    grad_clip_norm: float = ADAM_DEFAULTS["grad_clip_norm"]  # 0 = no clipping

    def to_json(self) -> dict[str, float]:
        return asdict(self)


def datum_json(datum: Datum | dict[str, Any]) -> dict[str, Any]:
    return datum.to_json() if isinstance(datum, Datum) else dict(datum)
