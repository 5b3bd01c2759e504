"""tinker-cookbook 0.6.1's RL loop (`tinker_cookbook.rl.train.main`, importance_sampling), unchanged, against the
embedded stack with the native sampler: a small local task (a response with an "e" in it earns the reward), the
pool's tokenizer registered in process,
to its end. Each step samples from a fresh sampler snapshot (the unnamed save_weights_for_sampler), then trains on the
samples; the sampler's logprobs and the trainer's forward logprobs agree (the cookbook's KL(sample || train) ~ 0)."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Sequence
from pathlib import Path

import chz
import pytest
from transformers import AutoTokenizer

from tests.helpers.stack import create_tenants

pytestmark = pytest.mark.e2e

pytest.importorskip("tinker_cookbook")
from tinker_cookbook import renderers, tokenizer_utils  # noqa: E402
from tinker_cookbook.rl import train  # noqa: E402
from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder  # noqa: E402
from tinker_cookbook.rl.types import EnvGroupBuilder, RLDataset, RLDatasetBuilder  # noqa: E402

BATCHES, GROUPS, GROUP_SIZE = 3, 2, 4


class SayYes(ProblemEnv):
    def get_question(self) -> str:
        return "Say yes."

    def check_answer(self, sample_str: str) -> bool:
        return "e" in sample_str  # the random tiny model says it now and then: rewards vary, so it trains

    def check_format(self, sample_str: str) -> bool:
        return True

    def get_reference_answer(self) -> str:
        return "yes"


class SayYesDataset(RLDataset):
    def __init__(self, renderer: renderers.Renderer) -> None:
        self.renderer = renderer

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        return [ProblemGroupBuilder(lambda: SayYes(self.renderer), GROUP_SIZE, "say_yes") for _ in range(GROUPS)]

    def __len__(self) -> int:
        return BATCHES


@chz.chz
class SayYesBuilder(RLDatasetBuilder):
    model_name: str
    renderer_name: str = "role_colon"

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        tokenizer = tokenizer_utils.get_tokenizer(self.model_name)
        return SayYesDataset(renderers.get_renderer(self.renderer_name, tokenizer)), None


def test_the_rl_loop_runs_to_its_end_with_the_native_sampler(stack, tmp_path: Path, monkeypatch) -> None:
    name = stack.settings.base_model
    folder = stack.settings.resolved_model_cache / name
    tokenizer_utils.register_tokenizer(name, lambda: AutoTokenizer.from_pretrained(folder, local_files_only=True))
    monkeypatch.setenv("TINKER_API_KEY", create_tenants(stack, "cookbook-rl")["cookbook-rl"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    log_path = tmp_path / "rl"
    config = train.Config(
        learning_rate=1e-3,
        dataset_builder=SayYesBuilder(model_name=name),
        model_name=name,
        recipe_name="loraplex_e2e_rl",
        max_tokens=8,
        log_path=str(log_path),
        renderer_name="role_colon",
        lora_rank=8,
        base_url=stack.base_url,
        eval_every=0,
        save_every=0,
        loss_fn="importance_sampling",
    )
    asyncio.run(train.main(config))
    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "optim/kl_sample_train_v1" in r]
    assert [r["step"] for r in steps] == list(range(BATCHES))
    for r in steps:  # sampler and trainer agree on the logprobs of the sampled tokens
        assert math.isfinite(r["optim/kl_sample_train_v1"]) and abs(r["optim/kl_sample_train_v1"]) < 1e-3, r
