"""A small local RL task for tinker-cookbook's RL loop (rl.train.main): a response with an "e" in it earns the reward
(the random tiny model says it now and then, so rewards vary and the loop trains), and a runner against a stack."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path

import chz
from tinker_cookbook import renderers, tokenizer_utils
from tinker_cookbook.rl import train
from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder
from tinker_cookbook.rl.types import EnvGroupBuilder, RLDataset, RLDatasetBuilder
from transformers import AutoTokenizer

BATCHES, GROUPS, GROUP_SIZE = 3, 2, 4


class SayYes(ProblemEnv):
    def get_question(self) -> str:
        return "Say yes."

    def check_answer(self, sample_str: str) -> bool:
        return "e" in sample_str

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


def run_rl_loop(stack, log_path: Path) -> list[dict]:
    """The cookbook's RL loop against `stack` (TINKER_API_KEY set by the caller) to its end; its metrics rows."""
    name = stack.settings.base_model
    folder = stack.settings.resolved_model_cache / name
    tokenizer_utils.register_tokenizer(name, lambda: AutoTokenizer.from_pretrained(folder, local_files_only=True))
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
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
