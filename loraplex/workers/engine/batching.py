"""A request's datums (the payloads the pool decoded) -> validated tensors, and the mixed batch layout (adapter-contiguous
microbatches, and a packed microbatch's positions and sequence offsets)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from loraplex.errors import InvalidRequestError
from loraplex.protocol.payloads import DatumPayload
from loraplex.workers.engine.losses import LossSpec, check_clip_thresholds, get_loss, resolve_loss_config


@dataclass(frozen=True)
class PreparedDatum:
    tokens: torch.Tensor  # int64 [T] (CPU)
    targets: torch.Tensor  # int64 [T]
    inputs: dict[str, torch.Tensor]  # the loss's float inputs, fp32 [T] each

    @property
    def length(self) -> int:
        return int(self.tokens.numel())


@dataclass(frozen=True)
class PreparedItem:
    """One forward_backward / forward request, validated."""

    model_id: str
    datums: tuple[PreparedDatum, ...]
    loss: LossSpec
    loss_config: dict[str, float]
    forward_only: bool

    @property
    def num_tokens(self) -> int:
        return sum(d.length for d in self.datums)

    def metrics(self, logprobs: Sequence[Sequence[float]]) -> dict[str, float]:
        """The loss's metrics beyond loss:sum (e.g. ppo's clip_fraction:mean), from this item's per-datum logprobs."""
        return self.loss.item_metrics(logprobs, [d.inputs for d in self.datums], self.loss_config)


def _int_tensor(raw: Sequence[Any], what: str, vocab_size: int) -> torch.Tensor:
    try:
        t = torch.as_tensor(raw)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InvalidRequestError(f"{what}: not a list of token ids ({exc})") from None
    if t.dim() != 1 or t.numel() == 0:
        raise InvalidRequestError(f"{what}: expected a non-empty 1-D list of token ids, got shape {tuple(t.shape)}")
    if t.dtype == torch.bool or t.is_complex() or (t.dtype.is_floating_point and not torch.equal(t, t.round())):
        raise InvalidRequestError(f"{what}: token ids must be integers")
    t = t.to(torch.int64)
    low, high = int(t.min()), int(t.max())
    if low < 0 or high >= vocab_size:
        raise InvalidRequestError(f"{what}: token id out of range [0, {vocab_size}) (min {low}, max {high})")
    return t


def _float_tensor(raw: Sequence[Any], what: str, length: int, broadcast: bool = False) -> torch.Tensor:
    """fp32 [length] from a list of numbers; with `broadcast`, one value (a single-element list) for all."""
    try:
        t = torch.as_tensor(raw, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InvalidRequestError(f"{what}: not a list of numbers ({exc})") from None
    if broadcast and t.numel() == 1 and t.dim() <= 1:
        t = t.reshape(1).expand(length).clone()
    if t.dim() != 1 or t.numel() != length:
        one = " (or one value for the whole datum)" if broadcast else ""
        raise InvalidRequestError(
            f"{what}: length {t.numel()} (shape {tuple(t.shape)}) != model_input length {length}{one}"
        )
    if not bool(torch.isfinite(t).all()):
        raise InvalidRequestError(f"{what}: contains NaN or infinity")
    return t


def prepare_datum(
    datum: DatumPayload, loss: LossSpec, vocab_size: int, where: str, config: Mapping[str, float] | None = None
) -> PreparedDatum:
    """Validate one datum for `loss` (with its resolved `config`): token ids in the vocabulary, every float input the loss
    reads present (or defaulted), one value per token, finite. Inputs the loss does not read are ignored, as Tinker does.
    The datum's shape (model_input a list of ints, loss_fn_inputs a mapping of name -> list) is the payload decoder's
    (protocol/wire.py); what is checked here are the values."""
    tokens = _int_tensor(datum.model_input, f"{where}.model_input", vocab_size)
    n = tokens.numel()
    raw_inputs = datum.loss_fn_inputs
    if "target_tokens" not in raw_inputs:
        raise InvalidRequestError(f"{where}.loss_fn_inputs: target_tokens is required")
    targets = _int_tensor(raw_inputs["target_tokens"], f"{where}.target_tokens", vocab_size)
    if targets.numel() != n:
        raise InvalidRequestError(f"{where}: target_tokens length {targets.numel()} != model_input length {n}")
    inputs: dict[str, torch.Tensor] = {}
    for key in loss.required:
        if key not in raw_inputs:
            raise InvalidRequestError(f"{where}.loss_fn_inputs: {key} is required by loss_fn {loss.name!r}")
        inputs[key] = _float_tensor(raw_inputs[key], f"{where}.{key}", n)
    for key, default in loss.defaults.items():
        if key in raw_inputs:
            inputs[key] = _float_tensor(raw_inputs[key], f"{where}.{key}", n)
        else:
            inputs[key] = torch.full((n,), default, dtype=torch.float32)
    resolved = config if config is not None else loss.config_defaults
    for key in loss.per_token_config:  # e.g. ppo/cispo clip thresholds: the datum's own values win over loss_fn_config
        if key in raw_inputs:
            inputs[key] = _float_tensor(raw_inputs[key], f"{where}.{key}", n, broadcast=True)
        else:
            inputs[key] = torch.full((n,), resolved[key], dtype=torch.float32)
    if "clip_low_threshold" in inputs:
        check_clip_thresholds(inputs["clip_low_threshold"], inputs["clip_high_threshold"], f"{where}.loss_fn_inputs")
    for key, derive in loss.derived.items():  # e.g. gspo's sequence_ratio_mask: given, or from the other inputs
        inputs[key] = _float_tensor(raw_inputs[key], f"{where}.{key}", n) if key in raw_inputs else derive(inputs)
    if loss.check is not None:
        loss.check(inputs, f"{where}.loss_fn_inputs")
    return PreparedDatum(tokens, targets, inputs)


def prepare_item(
    model_id: str,
    data: Sequence[DatumPayload],
    loss_fn: str,
    loss_fn_config: Mapping[str, Any] | None,
    forward_only: bool,
    vocab_size: int,
) -> PreparedItem:
    """Validate one request's data; raises InvalidRequestError naming the bad datum and field."""
    loss = get_loss(loss_fn)
    if not data:
        raise InvalidRequestError("data is empty: forward_backward needs at least one datum")
    config = resolve_loss_config(loss, loss_fn_config)
    datums = tuple(prepare_datum(d, loss, vocab_size, f"data[{i}]", config) for i, d in enumerate(data))
    return PreparedItem(model_id, datums, loss, config, bool(forward_only))


@dataclass(frozen=True)
class SeqRef:
    """One datum placed in the batch."""

    item: int  # index into the prepared items
    datum: int  # index into that item's datums
    length: int


def layout(items: Sequence[PreparedItem]) -> list[SeqRef]:
    """All datums, adapter-contiguous: items grouped by model_id in order of first appearance (stable)."""
    order: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        order.setdefault(item.model_id, []).append(i)
    return [
        SeqRef(i, j, d.length) for indices in order.values() for i in indices for j, d in enumerate(items[i].datums)
    ]


def split_microbatches(seqs: Sequence[SeqRef], max_tokens: int, packed: bool = True) -> list[list[SeqRef]]:
    """Consecutive runs of `seqs` whose size stays within `max_tokens`; a longer datum goes alone.

    packed (the engine's default): the size is the real tokens, sum of the lengths (one [1, N] stream, no pads).
    padded (packed=False): count x longest (every row padded to the longest). dispatch/cost_model.shape_of_lengths
    mirrors the packed split (tested equal)."""
    batches: list[list[SeqRef]] = []
    current: list[SeqRef] = []
    longest = total = 0
    for seq in seqs:
        size = total + seq.length if packed else (len(current) + 1) * max(longest, seq.length)
        if current and size > max_tokens:
            batches.append(current)
            current, longest, total = [], 0, 0
        current.append(seq)
        longest = max(longest, seq.length)
        total += seq.length
    if current:
        batches.append(current)
    return batches


@dataclass(frozen=True)
class PackedLayout:
    """One packed microbatch's sequence structure, all from the same lengths (host tensors)."""

    positions: torch.Tensor  # int64 [N]: RoPE positions, restarting at 0 for each sequence
    cu_seqlens: torch.Tensor  # int32 [S+1]: cumulative lengths, 0 .. N (workers/kernels/packed_attention.py reads them)
    max_length: int  # the longest sequence

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())

    @property
    def uniform(self) -> bool:
        """Every sequence is max_length long (the attention's dense path)."""
        return (self.cu_seqlens.numel() - 1) * self.max_length == self.num_tokens


def packed_layout(lengths: Sequence[int]) -> PackedLayout:
    """The layout of sequences of these lengths (each >= 1) concatenated in order into one row."""
    if not lengths or min(lengths) < 1:
        raise ValueError(f"a packed microbatch needs at least one sequence, each of length >= 1, got {list(lengths)}")
    counts = torch.tensor(list(lengths), dtype=torch.int64)
    ends = counts.cumsum(0)
    starts = ends - counts
    positions = torch.arange(int(ends[-1])) - torch.repeat_interleave(starts, counts)
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int64), ends]).to(torch.int32)
    return PackedLayout(positions, cu_seqlens, max(lengths))
