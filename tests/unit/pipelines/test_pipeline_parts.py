"""The pure parts of the pipelines: the learning-rate schedule, the deterministic batch order, the config's checks
and sweep expansion, the completion-only loss weights, and the hand-written SVG plot."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from pydantic import ValidationError

from loraplex.errors import InvalidRequestError
from loraplex.pipelines.dataset import batch_indices, encode
from loraplex.pipelines.schedule import learning_rate
from loraplex.pipelines.svg_plot import line_plot
from loraplex.service.pipeline_config import (
    OptimizerConfig,
    PipelineConfig,
    check_records,
    expand_sweep,
    split_indices,
    total_steps,
)


def test_warmup_then_cosine_or_linear_down_to_the_floor():
    cos = OptimizerConfig(learning_rate=1.0, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1)
    assert [learning_rate(cos, s, 10) for s in (1, 2)] == [0.5, 1.0]
    assert learning_rate(cos, 3, 10) == pytest.approx(1.0) and learning_rate(cos, 10, 10) == pytest.approx(0.1)
    assert learning_rate(cos, 6, 10) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 3 / 7)))
    lin = OptimizerConfig(learning_rate=2.0, schedule="linear")
    assert [learning_rate(lin, s, 5) for s in range(1, 6)] == pytest.approx([2.0, 1.5, 1.0, 0.5, 0.0])
    assert learning_rate(OptimizerConfig(learning_rate=3.0, schedule="constant"), 4, 5) == 3.0


def test_batches_depend_only_on_seed_and_step_and_cover_each_epoch():
    n, bs = 10, 3
    epoch = [i for step in range(1, 5) for i in batch_indices(n, bs, seed=1, step=step)]
    assert sorted(epoch) == list(range(n)) and len(batch_indices(n, bs, 1, 4)) == 1  # last batch smaller
    assert batch_indices(n, bs, 1, 6) == batch_indices(n, bs, 1, 6)
    assert batch_indices(n, bs, 1, 5) != batch_indices(n, bs, 2, 5)
    assert split_indices(8, 0.25, 3) == split_indices(8, 0.25, 3) and len(split_indices(8, 0.25, 3)[1]) == 2


def test_sweep_points_are_configs_of_their_own():
    cfg = PipelineConfig.model_validate(
        {"lora": {"rank": 4}, "sweep": {"grid": {"lora.rank": [4, 8], "optimizer.learning_rate": [1e-3, 1e-2]}}}
    )
    points = expand_sweep(cfg)
    assert [p for p, _ in points] == [{"lora.rank": r, "optimizer.learning_rate": lr}
                                      for r in (4, 8) for lr in (1e-3, 1e-2)]  # fmt: skip
    assert [(c.lora.rank, c.optimizer.learning_rate, c.sweep) for _, c in points][3] == (8, 1e-2, None)
    with pytest.raises(InvalidRequestError, match="sweep point .*batch_size"):
        expand_sweep(PipelineConfig.model_validate({"sweep": {"grid": {"batch_size": [0]}}}))
    with pytest.raises(ValidationError, match="epochs"):
        PipelineConfig.model_validate({"epochs": "many"})
    assert total_steps(PipelineConfig.model_validate({"epochs": 3, "batch_size": 4}), 10) == 9


def test_records_are_checked_and_named():
    assert check_records([{"prompt": "a", "completion": "b"}], "train", "auto") == "prompt_completion"
    with pytest.raises(InvalidRequestError, match=r"train\[1\]: .*mixed|mixed"):
        check_records([{"prompt": "a", "completion": "b"},
                       {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}],
                      "train", "auto")  # fmt: skip
    with pytest.raises(InvalidRequestError, match=r"eval\[0\]\.messages: the last message"):
        check_records(
            [{"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]}], "eval", "auto"
        )


class _Tok:
    eos_token_id = 0
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


def test_loss_weights_cover_the_completion_and_eos_only():
    example = encode(_Tok(), {"prompt": "ab", "completion": "cd"}, 64, "train[0]")
    assert example.tokens == [97, 98, 99, 100, 0] and example.weights == [0, 0, 1, 1, 1]
    datum = example.datum()
    assert datum["loss_fn_inputs"] == {"target_tokens": [98, 99, 100, 0], "weights": [0, 1, 1, 1]}
    with pytest.raises(InvalidRequestError, match="no completion token"):
        encode(_Tok(), {"prompt": "abcdef", "completion": "g"}, 4, "train[2]")
    with pytest.raises(InvalidRequestError, match="no chat_template"):
        encode(_Tok(), {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}, 8, "t")


def test_svg_plot_is_well_formed_with_a_line_per_series():
    svg = line_plot({"rank=4 <a&b>": [(1, 2.0), (2, 1.5)], "rank=8": [(1, 2.2), (2, 1.1), (3, 0.9)]}, "t", "x", "y")
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    assert len(root.findall(f"{ns}polyline")) == 2 and len(root.findall(f"{ns}circle")) == 5
    assert "rank=4 <a&b>" in [t.text for t in root.findall(f"{ns}text")]


def test_readme_example_config_evaluates_often_enough_for_a_plot() -> None:
    """The README's finetune.yaml on the dataset its command writes: at least 10 eval points per run, so the sweep
    report's plot shows curves (not one point per run)."""
    import re

    import yaml

    from loraplex.service.pipeline_config import PipelineConfig, expand_sweep, total_steps, train_count

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    section = readme.split("## Offline fine-tuning pipelines", 1)[1]
    config = PipelineConfig.model_validate(yaml.safe_load(re.findall(r"```yaml\n(.*?)```", section, re.S)[0]))
    records = int(re.search(r"for _ in range\((\d+)\)", section).group(1))  # the README's dataset command
    points = expand_sweep(config)
    assert len(points) >= 2
    for _, point in points:
        steps = total_steps(point, train_count(point, records, has_eval_file=False))
        evals = len({s for s in range(1, steps + 1) if s % point.eval_every == 0} | {steps})
        assert evals >= 10, (steps, point.eval_every)
