"""What a FORWARD_BACKWARD step costs, predicted from its shape (pure: no I/O, no torch).

The engine (workers/engine/engine.py) lays a step's datums out adapter-contiguous (adapters in order of first appearance) and
cuts them into consecutive microbatches of at most `microbatch_tokens` real tokens (a longer datum alone), each packed
into one row without padding (workers/batching.split_microbatches, packed: mirrored here and tested against it). Each
microbatch is one pass through every layer: a plain matmul for its LoRA part when it holds one adapter, the grouped op
when it mixes several. So

    seconds = step_s                                   (once per step: validation, routing, outputs)
            + microbatch_s x microbatches              (a pass through every layer: launches, FSDP gathers)
            + token_s x tokens                         (the base model's and one adapter's work per token)
            + mixed_token_s x tokens in mixed microbatches      (the grouped op instead of a matmul)
            + adapter_token_s x sum(tokens x (adapters - 1)) over microbatches   (each further adapter in one)

Linear in its parameters, so measured steps calibrate it by least squares (dispatch/cost_calibration.py). Defaults
per device type are rough anchors (the fit replaces them within a few dozen steps). With several ranks the engine
splits rows across ranks before microbatching: this model treats the step as one rank's and lets the fit absorb it.
(An engine run with packed=False, padded microbatches, is not what this models: its microbatches are cut by count x
longest and its tokens are padded ones.) Attention's cost grows with the square of each sequence's length, which a
per-token term does not see: for the Qwen3-4B shape at 2,048-token sequences it is under a tenth of the projections'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from loraplex.protocol import ForwardBackwardPayload, PlannedRequest


@dataclass(frozen=True)
class StepShape:
    """The cost model's features of one FORWARD_BACKWARD step."""

    steps: int = 1
    microbatches: int = 0
    tokens: int = 0  # tokens (real ones: microbatches are packed, no padding)
    mixed_tokens: int = 0  # tokens in microbatches holding more than one adapter
    adapter_tokens: int = 0  # sum over microbatches of tokens x (adapters in it - 1)

    def features(self) -> tuple[float, float, float, float, float]:
        return (float(self.steps), float(self.microbatches), float(self.tokens), float(self.mixed_tokens),
                float(self.adapter_tokens))  # fmt: skip


@dataclass(frozen=True)
class CostParams:
    """Seconds per unit of each StepShape feature, in the same order."""

    step_s: float
    microbatch_s: float
    token_s: float
    mixed_token_s: float
    adapter_token_s: float

    def predict(self, shape: StepShape) -> float:
        # spelled out: the policy calls this a few dozen times per plan (dataclasses.astuple deep-copies)
        return (self.step_s * shape.steps + self.microbatch_s * shape.microbatches + self.token_s * shape.tokens
                + self.mixed_token_s * shape.mixed_tokens + self.adapter_token_s * shape.adapter_tokens)  # fmt: skip

    def values(self) -> tuple[float, float, float, float, float]:
        """The parameters in StepShape.features' order."""
        return (self.step_s, self.microbatch_s, self.token_s, self.mixed_token_s, self.adapter_token_s)


# Anchors, not measurements to rely on: the H200 with the Qwen3-4B shape at rank 32 (benchmarks/RESULTS.md: a lone
# 1x512 step ~0.27 s, 8x512 ~0.31 s, host-bound per microbatch), and the `tiny` preset on a CPU core.
DEFAULT_COST = {
    "cuda": CostParams(step_s=0.01, microbatch_s=0.25, token_s=1.5e-5, mixed_token_s=2e-6, adapter_token_s=5e-7),
    "cpu": CostParams(step_s=0.002, microbatch_s=0.01, token_s=2e-5, mixed_token_s=4e-6, adapter_token_s=1e-6),
}


def default_cost(device: str) -> CostParams:
    """The anchor for a device string ("cuda", "cuda:1", "cpu", ...)."""
    return DEFAULT_COST["cuda" if device.startswith("cuda") else "cpu"]


class StepCost(Protocol):
    """What the policy asks of a cost model (a fixed CostParams model or the online one)."""

    microbatch_tokens: int

    def predict(self, shape: StepShape) -> float: ...


@dataclass(frozen=True)
class FixedCost:
    """A cost model that does not learn: `params` with the engine's microbatch size."""

    params: CostParams
    microbatch_tokens: int = 4096

    def predict(self, shape: StepShape) -> float:
        return self.params.predict(shape)


def datum_lengths(r: PlannedRequest) -> list[int]:
    """Token counts of the datums this plan runs of `r` (its part's, when it runs in parts)."""
    p = r.payload
    if not isinstance(p, ForwardBackwardPayload):
        return []
    data = p.data if r.part is None else p.data[r.part[0] : r.part[1]]
    return [len(d.model_input) for d in data]


def shape_of(requests: Sequence[PlannedRequest], microbatch_tokens: int) -> StepShape:
    """The shape of one FORWARD_BACKWARD step of `requests` as the engine runs it (see the module doc)."""
    by_adapter: dict[str, list[int]] = {}
    for r in requests:
        by_adapter.setdefault(r.model_id, []).extend(datum_lengths(r))
    return shape_of_lengths(list(by_adapter.values()), microbatch_tokens)


def shape_of_lengths(adapters: Sequence[Sequence[int]], microbatch_tokens: int) -> StepShape:
    """The shape of a step whose adapters (in layout order) hold datums of these lengths."""
    microbatches = tokens = mixed = extra = 0
    count = total = kinds = 0  # the open microbatch: datums, tokens, adapters in it

    def close() -> None:
        nonlocal microbatches, tokens, mixed, extra
        microbatches += 1
        tokens += total
        if kinds > 1:
            mixed += total
            extra += total * (kinds - 1)

    for lengths in adapters:
        new_adapter = True
        for n in lengths:
            if count and total + n > microbatch_tokens:  # workers/batching.split_microbatches (packed)
                close()
                count = total = kinds = 0
                new_adapter = True
            if new_adapter:
                kinds += 1
                new_adapter = False
            count += 1
            total += n
    if count:
        close()
    return StepShape(1, microbatches, tokens, mixed, extra)
