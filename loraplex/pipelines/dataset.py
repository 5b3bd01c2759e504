"""A pipeline's dataset as training examples: the uploaded JSONL records tokenized with the pipeline's tokenizer,
loss on the completion only (weight 0 on every prompt token, 1 on each completion token and the EOS after it), the
eval split, and the deterministic order of the batches (a function of the seed and the step number, so a resumed
run trains on exactly the batches the interrupted one would have).

Chat records are rendered with the tokenizer's chat template: the prompt is every message but the last, rendered
with the generation prompt; the completion is what the full conversation adds after it (the last assistant turn)."""

from __future__ import annotations

import json
import random
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.errors import InvalidRequestError
from loraplex.service.pipeline_config import PipelineConfig, record_format, split_indices

# transformers' lazy module import is not thread-safe: a threads-pool worker imports it (tokenizers here, a preset's
# tokenizer through the model registry in runner) under this lock.
TRANSFORMERS_IMPORT = threading.Lock()


@dataclass(frozen=True)
class Example:
    tokens: list[int]
    weights: list[float]  # per token: 1 where it is a completion token (predicted and scored), else 0

    def datum(self) -> dict[str, Any]:
        """Next-token prediction: input tokens[:-1], target tokens[1:] weighted by the target's weight."""
        return {"model_input": self.tokens[:-1],
                "loss_fn_inputs": {"target_tokens": self.tokens[1:], "weights": self.weights[1:]}}  # fmt: skip

    @property
    def scored_tokens(self) -> float:
        return sum(self.weights[1:])


def load_tokenizer(folder: str, shown: str | None = None) -> Any:
    """A Hugging Face tokenizer from a local folder (offline). shown: how the error names it (the config's value, not
    the server's path)."""
    path = Path(folder).expanduser()
    if not ((path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()):
        raise InvalidRequestError(
            f"tokenizer: {shown or folder!r} is not a tokenizer folder (no tokenizer.json) on this worker"
        )
    with TRANSFORMERS_IMPORT:
        from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def encode(tokenizer: Any, record: dict[str, Any], max_tokens: int, where: str) -> Example:
    if record_format(record, where, "auto") == "chat":
        prompt_ids, full = _chat_ids(tokenizer, record["messages"], where)
    else:
        prompt_ids = tokenizer.encode(record["prompt"], add_special_tokens=True) if record["prompt"] else []
        completion = tokenizer.encode(record["completion"], add_special_tokens=False)
        if tokenizer.eos_token_id is not None:
            completion.append(tokenizer.eos_token_id)
        full = prompt_ids + completion
    tokens = full[:max_tokens]
    weights = [0.0 if i < len(prompt_ids) else 1.0 for i in range(len(tokens))]
    example = Example(tokens, weights)
    if len(tokens) < 2 or example.scored_tokens == 0:
        raise InvalidRequestError(
            f"{where}: no completion token within dataset.max_tokens={max_tokens} (the prompt has {len(prompt_ids)})"
        )
    return example


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]], where: str) -> tuple[list[int], list[int]]:
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(
            f"{where}: a chat record, but the tokenizer has no chat_template; use prompt/completion records or a "
            "tokenizer folder whose tokenizer_config.json has one"
        )
    convo = [{"role": m["role"], "content": m["content"]} for m in messages]
    prompt_text = tokenizer.apply_chat_template(convo[:-1], tokenize=False, add_generation_prompt=True)
    full_text = tokenizer.apply_chat_template(convo, tokenize=False)
    if not full_text.startswith(prompt_text):
        raise InvalidRequestError(f"{where}: the chat template renders the conversation without its prompt as a prefix")
    prompt_ids = tokenizer.encode(prompt_text, add_special_tokens=False)
    full = prompt_ids + tokenizer.encode(full_text[len(prompt_text) :], add_special_tokens=False)
    return prompt_ids, full


def prepare(config: PipelineConfig, dataset_dir: Path, tokenizer: Any) -> tuple[list[Example], list[Example]]:
    """(train, eval) examples of the uploaded dataset folder (train.jsonl, eval.jsonl if the config named one)."""
    train_records = read_jsonl(dataset_dir / "train.jsonl")
    eval_file = dataset_dir / "eval.jsonl"
    max_tokens = config.dataset.max_tokens
    train = [encode(tokenizer, r, max_tokens, f"train[{i}]") for i, r in enumerate(train_records)]
    if eval_file.is_file():
        return train, [encode(tokenizer, r, max_tokens, f"eval[{i}]") for i, r in enumerate(read_jsonl(eval_file))]
    if config.dataset.eval_fraction == 0:
        return train, []
    train_idx, eval_idx = split_indices(len(train), config.dataset.eval_fraction, config.seed)
    return [train[i] for i in train_idx], [train[i] for i in eval_idx]


def batch_indices(n_train: int, batch_size: int, seed: int, step: int) -> list[int]:
    """The train examples of optimizer step `step` (from 1): epoch e's order is a shuffle seeded by (seed, e); the
    last batch of an epoch may be smaller."""
    per_epoch = -(-n_train // batch_size)
    epoch, k = divmod(step - 1, per_epoch)
    order = list(range(n_train))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return order[k * batch_size : (k + 1) * batch_size]
