"""The learning rate of each optimizer step: linear warmup, then cosine or linear decay (or constant) down to
`min_lr_ratio` x the peak at the last step. Steps count from 1; the value goes in that step's adam_params."""

from __future__ import annotations

import math

from loraplex.service.pipeline_config import OptimizerConfig


def learning_rate(optimizer: OptimizerConfig, step: int, total_steps: int) -> float:
    peak = optimizer.learning_rate
    warmup = min(optimizer.warmup_steps, total_steps)
    if step <= warmup:
        return peak * step / warmup
    floor = peak * optimizer.min_lr_ratio
    if optimizer.schedule == "constant" or total_steps <= warmup:
        return peak
    # 0 at the first step after warmup, 1 at the last step.
    progress = (step - warmup - 1) / max(1, total_steps - warmup - 1)
    if optimizer.schedule == "linear":
        return peak - (peak - floor) * progress
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
