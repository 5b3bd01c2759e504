"""What a fine-tuning pipeline is asked to do (`loraplex finetune CONFIG.yaml`, `ServiceClient.submit_pipeline`): the
config's schema, the checks on its dataset records, the train/eval split, and a sweep's grid expanded into one config
per point. Pure (pydantic, the stdlib): the gateway checks a submission with it, the Celery task reads it back.

Unknown keys, wrong types and out-of-range values are a 422 naming the field (`Strict`); what only the whole config
can tell (a grid key that names no setting, an eval split with nothing left to train on) is an InvalidRequestError."""

from __future__ import annotations

import itertools
import math
import random
import re
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from loraplex.errors import InvalidRequestError
from loraplex.service.schemas import AdamFields, Strict

RecordFormat = Literal["chat", "prompt_completion"]
NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
MAX_GRID_POINTS = 64
# The settings a sweep's grid may vary (dotted paths into the config).
GRID_KEYS = frozenset({
    "seed", "epochs", "batch_size", "lora.rank", "lora.alpha",
    *(f"optimizer.{k}" for k in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm",
                                 "warmup_steps", "schedule", "min_lr_ratio")),
})  # fmt: skip


class DatasetConfig(Strict):
    # The JSONL files, as the config names them (the client reads them and uploads their records).
    train: str | None = None
    eval: str | None = None
    # Without an eval file: this share of the train records is held out for evaluation (chosen by the seed).
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    # "chat": {"messages": [{"role", "content"}, ...]} ending in an assistant message, rendered with the tokenizer's
    # chat template; "prompt_completion": {"prompt", "completion"}; "auto": whichever each file's records are.
    format: Literal["auto", "chat", "prompt_completion"] = "auto"
    # Longer examples are cut to this many tokens.
    max_tokens: int = Field(1024, ge=2, le=32768)


class LoraConfig(Strict):
    rank: int = Field(8, ge=1, le=1024)
    alpha: float | None = Field(None, gt=0, description="empty: 2 x rank")


class OptimizerConfig(Strict, AdamFields):
    # The learning rate rises linearly over the first `warmup_steps` steps, then follows `schedule` down to
    # `min_lr_ratio` x learning_rate at the last step.
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)


class SweepConfig(Strict):
    # Dotted setting -> values, e.g. {"lora.rank": [4, 8], "optimizer.learning_rate": [1e-3, 1e-2]}: one pipeline
    # per point of the product, run concurrently.
    grid: dict[str, list[Any]] = Field(..., min_length=1)


class PipelineConfig(Strict):
    name: str = Field("pipeline", min_length=1, max_length=64)
    dataset: DatasetConfig = Field(default_factory=lambda: DatasetConfig.model_validate({}))
    # A local tokenizer folder the Celery workers can read; empty: the pool's base model's tokenizer.
    tokenizer: str | None = None
    seed: int = Field(0, ge=0, lt=2**31)  # the adapter's init and the data order
    epochs: int = Field(1, ge=1, le=10_000)
    batch_size: int = Field(8, ge=1, le=1024)
    lora: LoraConfig = Field(default_factory=lambda: LoraConfig.model_validate({}))
    optimizer: OptimizerConfig = Field(default_factory=lambda: OptimizerConfig.model_validate({}))
    eval_every: int = Field(0, ge=0, description="eval loss every N steps (0: at the end only)")
    checkpoint_every: int = Field(0, ge=0, description="save_state every N steps (0: none; a restart starts over)")
    # Intermediate checkpoints expire this long after they are saved (the retention task deletes them); empty: kept.
    checkpoint_ttl_seconds: int | None = Field(None, gt=0)
    export: bool = True  # write the final weights as a PEFT folder
    sweep: SweepConfig | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not NAME_RE.fullmatch(value):
            raise ValueError("use 1-64 characters of A-Z a-z 0-9 _ . -")
        return value


class SubmitPipelineRequest(Strict):
    config: PipelineConfig
    train: list[dict[str, Any]] = Field(..., min_length=1, description="the train file's records")
    eval: list[dict[str, Any]] | None = Field(None, description="the eval file's records, if the config names one")


def record_format(record: Any, where: str, wanted: str) -> RecordFormat:
    """The format of one dataset record, checked: InvalidRequestError naming `where` (e.g. "train[3]") otherwise."""
    if not isinstance(record, dict):
        raise InvalidRequestError(f"{where}: a record must be a JSON object")
    if "messages" in record:
        found: RecordFormat = "chat"
        messages = record["messages"]
        if not isinstance(messages, list) or len(messages) < 2:
            raise InvalidRequestError(f"{where}.messages: a list of at least 2 messages (the last one the assistant's)")
        for i, message in enumerate(messages):
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):  # fmt: skip
                raise InvalidRequestError(f"{where}.messages[{i}]: needs string 'role' and 'content'")
        if messages[-1]["role"] != "assistant":
            raise InvalidRequestError(f"{where}.messages: the last message must be the assistant's (what is learned)")
    elif "prompt" in record or "completion" in record:
        found = "prompt_completion"
        for key in ("prompt", "completion"):
            if not isinstance(record.get(key), str):
                raise InvalidRequestError(f"{where}.{key}: a string is required")
        if not record["completion"]:
            raise InvalidRequestError(f"{where}.completion: must not be empty (the loss is on the completion)")
    else:
        raise InvalidRequestError(f"{where}: expected 'messages' (chat) or 'prompt' and 'completion'")
    if wanted not in ("auto", found):
        raise InvalidRequestError(f"{where}: a {found} record, but dataset.format is {wanted}")
    return found


def check_records(records: list[dict[str, Any]], split: str, wanted: str) -> RecordFormat:
    """Every record valid and of one format (returned)."""
    formats = {record_format(r, f"{split}[{i}]", wanted) for i, r in enumerate(records)}
    if len(formats) > 1:
        raise InvalidRequestError(f"{split}: chat and prompt/completion records mixed; use one format per file")
    return formats.pop()


def split_indices(n: int, eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, eval) record indices when the eval split is held out of the train records: a seeded choice, so the
    gateway (counting steps) and every run of the task agree."""
    held = round(n * eval_fraction)
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return sorted(order[held:]), sorted(order[:held])


def steps_per_epoch(n_train: int, batch_size: int) -> int:
    return math.ceil(n_train / batch_size)


def train_count(config: PipelineConfig, n_records: int, has_eval_file: bool) -> int:
    """How many records are trained on."""
    if has_eval_file or config.dataset.eval_fraction == 0:
        return n_records
    return len(split_indices(n_records, config.dataset.eval_fraction, config.seed)[0])


def total_steps(config: PipelineConfig, n_train: int) -> int:
    return config.epochs * steps_per_epoch(n_train, config.batch_size)


def expand_sweep(config: PipelineConfig) -> list[tuple[dict[str, Any], PipelineConfig]]:
    """[(point, the config at that point)]: one entry without a sweep, else one per grid point (at most
    MAX_GRID_POINTS), each checked like a config of its own. The configs carry no sweep."""
    base = config.model_dump(mode="json", exclude={"sweep"})
    if config.sweep is None:
        return [({}, PipelineConfig.model_validate(base))]
    grid = config.sweep.grid
    unknown = sorted(set(grid) - GRID_KEYS)
    if unknown:
        raise InvalidRequestError(f"sweep.grid: {unknown} cannot be swept; choose from {sorted(GRID_KEYS)}")
    for key, values in grid.items():
        if not values:
            raise InvalidRequestError(f"sweep.grid.{key}: give at least one value")
    points = [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]
    if len(points) > MAX_GRID_POINTS:
        raise InvalidRequestError(f"sweep.grid has {len(points)} points; at most {MAX_GRID_POINTS}")
    out = []
    for point in points:
        data = _copy(base)
        for key, value in point.items():
            section, _, leaf = key.rpartition(".")
            (data[section] if section else data)[leaf] = value
        try:
            out.append((point, PipelineConfig.model_validate(data)))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise InvalidRequestError(f"sweep point {point}: {where}: {first['msg']}") from None
    return out


def _copy(data: dict[str, Any]) -> dict[str, Any]:
    return {k: _copy(v) if isinstance(v, dict) else v for k, v in data.items()}
