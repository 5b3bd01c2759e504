"""tinker-cookbook 0.6.1's RL loop (`tinker_cookbook.rl.train.main`, importance_sampling), unchanged, against the
embedded stack with the native sampler: a small local task (tests/helpers/cookbook_rl.py), the pool's tokenizer
registered in process, to its end. Each step samples from a fresh sampler copy (the unnamed
save_weights_for_sampler), then trains on the samples; the sampler's logprobs and the trainer's forward logprobs agree
(the cookbook's KL(sample || train) ~ 0)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.helpers.stack import create_tenants

pytest.importorskip("tinker_cookbook")
from tests.helpers.cookbook_rl import BATCHES, run_rl_loop  # noqa: E402


def check_kl(rows: list[dict]) -> None:
    steps = [r for r in rows if "optim/kl_sample_train_v1" in r]
    assert [r["step"] for r in steps] == list(range(BATCHES))
    for r in steps:  # sampler and trainer agree on the logprobs of the sampled tokens
        assert math.isfinite(r["optim/kl_sample_train_v1"]) and abs(r["optim/kl_sample_train_v1"]) < 1e-3, r


def test_the_rl_loop_runs_to_its_end_with_the_native_sampler(stack, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TINKER_API_KEY", create_tenants(stack, "cookbook-rl")["cookbook-rl"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    check_kl(run_rl_loop(stack, tmp_path / "rl"))
