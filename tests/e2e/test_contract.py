"""The step contract through the embedded stack and the Python client: a call the client cannot send (a non-finite
number) raises at once, naming the field, and costs the caller's next call nothing (it takes no seq_id: before, the
next call waited 60 s for the seq_id that never arrived, then failed); a result is visible only after its record."""

from __future__ import annotations

import math
import time

import pytest

from loraplex.client import AdamParams, Datum
from loraplex.errors import InvalidRequestError, NotFoundError
from tests.helpers.stack import tenant_clients

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_number_fails_at_the_call_and_the_next_call_runs(stack, bad: float) -> None:
    name = "finite-nan" if math.isnan(bad) else "finite-inf"
    client = tenant_clients(stack, name)[name]
    trainer = client.create_lora_training_client(rank=4)
    data = [Datum.for_next_token([10, 11, 12, 13])]
    trainer.forward_backward(data).result(timeout=60)
    with pytest.raises(InvalidRequestError, match="adam_params.learning_rate"):
        trainer.optim_step(AdamParams(learning_rate=bad))
    bad_weights = [Datum(model_input=[10, 11], loss_fn_inputs={"target_tokens": [11, 12], "weights": [1.0, bad]})]
    with pytest.raises(InvalidRequestError, match=r"data\.0\.loss_fn_inputs\.weights\.1"):
        trainer.forward_backward(bad_weights)
    started = time.monotonic()
    assert trainer.optim_step(AdamParams(learning_rate=1e-3)).result(timeout=30) is not None
    assert trainer.forward_backward(data).result(timeout=30)["metrics"]
    assert time.monotonic() - started < 20  # nothing waited for a missing seq_id
    client.close()


def test_a_call_the_gateway_rejects_costs_the_next_call_nothing(stack) -> None:
    """The client took seq_ids for these calls and the gateway turned them down (a 422 from validation, a 400 from a
    service rule, a 404 for a missing checkpoint): each rejection holds its seq_id, so the next calls run at once
    (before: the next call waited 60 s for the rejected seq_id, then failed)."""
    client = tenant_clients(stack, "rejected")["rejected"]
    trainer = client.create_lora_training_client(rank=4)
    data = [Datum.for_next_token([10, 11, 12, 13])]
    with pytest.raises(InvalidRequestError, match="loss_fn"):
        trainer.forward_backward(data, loss_fn="no_such_loss")
    with pytest.raises(InvalidRequestError, match="invalid checkpoint name"):
        trainer.save_state("../escape")
    with pytest.raises(NotFoundError):
        trainer.load_state(f"tinker://{trainer.model_id}/weights/never-saved")
    started = time.monotonic()
    fb = trainer.forward_backward(data)
    assert trainer.optim_step(AdamParams(learning_rate=1e-3)).result(timeout=30) is not None
    assert fb.result(timeout=30)["metrics"]
    assert time.monotonic() - started < 20  # nothing waited for a missing seq_id
    assert trainer.info()["applied_seq_id"] == 5  # the three rejected seq_ids, answered with their errors, then two
    client.close()


def test_a_result_is_visible_only_after_its_step_is_recorded(stack) -> None:
    """Right after a step's results, the adapter's row already shows that step applied (before: results reached Redis
    ahead of the SQL record, and 2 reads in 18 saw the previous applied_seq_id; `training_client()` derives the next
    seq_id from it)."""
    client = tenant_clients(stack, "recorded-first")["recorded-first"]
    trainer = client.create_lora_training_client(rank=4)
    data = [Datum.for_next_token([10, 11, 12, 13])]
    seen = []
    for _ in range(20):
        fb, opt = trainer.forward_backward(data), trainer.optim_step(AdamParams(learning_rate=1e-3))
        fb.result(timeout=30)
        opt.result(timeout=30)
        seen.append(trainer.info()["applied_seq_id"])
    assert seen == list(range(2, 41, 2))
    client.close()
