"""Training loops the Tinker-SDK tests share: cross-entropy steps through the official client, the losses back; the
recovery workload (tests/helpers/recovery.py) through the SDK."""

from __future__ import annotations

from typing import Any

from tinker import types

from tests.helpers.recovery import ADAM, Plan, Trained

LR = types.AdamParams(learning_rate=1e-2)


def train(client: Any, data: list[types.Datum], steps: int, lr: types.AdamParams = LR) -> list[float]:
    """`steps` forward_backward + optim_step rounds on `data`; each round's loss:sum."""
    losses = []
    for _ in range(steps):
        fb = client.forward_backward(data, "cross_entropy")
        client.optim_step(lr).result()
        losses.append(fb.result().metrics["loss:sum"])
    return losses


def train_plan(client: Any, plan: Plan, out: Trained, checkpoint: str) -> None:
    """recovery.train's workload through the Tinker SDK (`client` a tinker.ServiceClient): each step's
    forward_backward and optim_step submitted together, then both awaited; then save_state. Errors land in `out`."""
    try:
        # alpha is the service's default, 2 x rank, as the reference's
        tc = client.create_lora_training_client(base_model="tiny", rank=plan.rank, seed=plan.seed).result()
        out.model_id = tc.model_id
        adam = types.AdamParams(**ADAM)
        for k in range(plan.steps):
            data = [_datum(d) for d in plan.batch(k)]
            fb = tc.forward_backward(data, "cross_entropy")
            optim = tc.optim_step(adam)
            out.losses.append(fb.result().metrics["loss:sum"])
            out.done += 1
            optim.result()
            out.done += 1
        tc.save_state(checkpoint).result()
    except BaseException as exc:  # noqa: BLE001 - the test thread reports it
        out.errors.append(exc)


def _datum(d: dict) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(d["model_input"]), loss_fn_inputs=d["loss_fn_inputs"])
