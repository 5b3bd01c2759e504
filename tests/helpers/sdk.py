"""Training loops the Tinker-SDK tests share: cross-entropy steps through the official client, the losses back."""

from __future__ import annotations

from typing import Any

from tinker import types

LR = types.AdamParams(learning_rate=1e-2)


def train(client: Any, data: list[types.Datum], steps: int, lr: types.AdamParams = LR) -> list[float]:
    """`steps` forward_backward + optim_step rounds on `data`; each round's loss:sum."""
    losses = []
    for _ in range(steps):
        fb = client.forward_backward(data, "cross_entropy")
        client.optim_step(lr).result()
        losses.append(fb.result().metrics["loss:sum"])
    return losses
