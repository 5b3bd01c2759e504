"""A collective that failed because another rank is gone is not the request's error (workers/executor.error_outcome):
it is raised again, so that a multi-rank pool ends without answering (tests/e2e/test_recovery.py kills ranks)."""

from __future__ import annotations

import pytest

from loraplex.protocol import PlannedRequest, RequestKind
from loraplex.workers.engine.executor import error_outcome
from loraplex.workers.ranks.distributed import lost_a_rank

GLOO_RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:9389: Connection "
    "reset by peer. This is typically caused by a remote worker hanging or bugs in the application."
)


def _request() -> PlannedRequest:
    return PlannedRequest("r1", "t", "m", 2, RequestKind.OPTIM_STEP, {"adam_params": {"learning_rate": 1e-3}})


def test_a_lost_rank_is_raised_again_and_other_failures_are_the_requests() -> None:
    assert lost_a_rank(RuntimeError(GLOO_RESET)) and lost_a_rank(RuntimeError("x: Connection closed by peer [::1]"))
    assert not lost_a_rank(RuntimeError("CUDA out of memory")) and not lost_a_rank(ValueError(GLOO_RESET))
    with pytest.raises(RuntimeError, match="Connection reset by peer"):
        error_outcome(_request(), RuntimeError(GLOO_RESET))
    outcome = error_outcome(_request(), RuntimeError("CUDA out of memory"))
    assert (outcome.ok, outcome.error_name) == (False, "EngineError")
