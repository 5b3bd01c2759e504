"""What a sampling job asks for and what it gets: the native sampler's inputs and outputs (workers/sampling/sampler.py),
plain data with no torch, shared by the sampler, the SAMPLE step and the multi-rank split."""

from __future__ import annotations

from dataclasses import dataclass

STOP = "stop"
LENGTH = "length"


@dataclass(frozen=True)
class SampleParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = -1  # -1 = off
    top_p: float = 1.0
    seed: int | None = None  # same seed + same job = same tokens, whatever else is in the batch
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()  # needs the Sampler's tokenizer; matched on the decoded text of the sample
    stop_at_eos: bool = True  # False: EOS is a token like any other (Tinker's `stop=[]`)


@dataclass(frozen=True)
class SampleJob:
    prompt: tuple[int, ...]
    model_id: str | None  # an adapter resident in the engine; None = the bare base model
    params: SampleParams = SampleParams()
    num_samples: int = 1
    prompt_logprobs: bool = False  # logprob of each prompt token given the ones before (first: None)
    topk_prompt_logprobs: int = 0  # per prompt position, the top-k (token_id, logprob) (first: None)
    topk_sample_logprobs: int = 0  # per sampled position, the top-k (token_id, logprob)
    # The index of its first sample: samples first_sample.. of a job split across ranks draw what they draw whole.
    first_sample: int = 0


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]  # log_softmax of the raw logits at each sampled token (before temperature/top-k/top-p)
    stop_reason: str  # "stop" (a stop token or string, or EOS) or "length"
    topk_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class SampleOutput:
    sequences: list[SampledSequence]  # num_samples of them
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None


@dataclass
class SamplerStats:
    """What the last `generate` did (for tests and benchmarks)."""

    decode_steps: int = 0
    prefill_forwards: int = 0
    prefill_tokens: int = 0  # prompt tokens prefilled: each prompt once per run, however many jobs and samples share it
    rows_admitted: int = 0
    joined_live_batch: int = 0  # rows that joined while other rows were mid-decode (continuous batching)
    peak_rows: int = 0
    graph_captures: int = 0  # decode graphs this run recorded (one per new row bucket; 0 on the CPU)
