"""The native sampler: batched autoregressive generation over the Engine's own multi-LoRA model.

Rows of different adapters and rows of the bare base model decode in one batch. The prefill's LoRA routing is the
engine's (workers/lora/routing.py): a run's prompts are kept contiguous per adapter, one `Routing` per prefill chunk, read
by every `SlotBankLinear` through `engine.context.use(routing, banks)`; each adapter of a run is one routing group and
the base model a group of scale 0 (its delta is exactly 0; a chunk of base prompts only runs with no routing). On the
fused path (engine.fused_lora) a run's slots are gathered and cast once when it starts (`MicrobatchBanks`).

One decode batch for every run (`_Batch`): the sampler keeps one static decoder of `max_rows` rows and `max_groups`
LoRA groups (static_decoder.py: rows never move, each row carries its own adapter's group, so a step needs no
reordering; on CUDA a captured graph per row bucket). A run that starts joins it: its adapters get groups (their
weights copied from the slots now: what the run samples from, whatever trains later), and its samples wait in job
order for free rows and, paged, for KV blocks. Whenever rows are free the run's next samples are admitted: their jobs
are prefilled (packed without padding into the paged cache, or right padded for the dense one; chunks of at most
`engine.microbatch_tokens` tokens; the samples of one job share its prefill and, paged, its prompt blocks), each new
row draws its first token from the prefill's last logits and joins the live rows of every run. A decode step serves
all of them.

Slices: `start` makes a resumable run (`SampleRun`) and `advance(budget_s)` runs it for about that many seconds (at
least one admission or decode step; the other runs' rows decode in the same steps), so the pool interleaves long
generations with other tenants' training plans (workers/sampling/step.py). A run froze its weights when it joined (its
LoRA groups and, on the fused path, the gathered banks), so training between slices changes nothing it reads: a sliced
run gives exactly the tokens of an unsliced one. When it ends (or is abandoned) its rows, prompt blocks and groups go
back.

Per token the reported logprob is log_softmax of the model's raw logits (fp32), i.e. the policy's logprob of the token,
before temperature / top-k / top-p (as vLLM's default logprobs and Tinker's sampling logprobs, which RL losses compare
with the trainer's). Top-k logprobs (prompt and sample) are of that same distribution, sorted descending.

Stops: a token in `stop_token_ids` or in the EOS ids ends the sequence with "stop" (the stop token is kept, with its
logprob, as the last token); a stop string ends it with "stop" at the token whose decoded text completes the string
(that token is kept; the decoded text of the sample is `tokenizer.decode(tokens, skip_special_tokens=False)`, and
cutting the text at the string is the caller's business); `max_tokens` tokens end it with "length".
"""

from __future__ import annotations

import heapq
import itertools
import secrets
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F

from loraplex.errors import EngineError, InvalidRequestError
from loraplex.workers.engine.engine import Engine
from loraplex.workers.lora import MicrobatchBanks, Routing, lora_delta_grouped
from loraplex.workers.sampling.choice import choose_tokens, stream_key
from loraplex.workers.sampling.jobs import (
    LENGTH,
    STOP,
    SampledSequence,
    SampleJob,
    SampleOutput,
    SampleParams,
    SamplerStats,
)
from loraplex.workers.sampling.kv_blocks import KvBlocksExhausted, first_sample_blocks
from loraplex.workers.sampling.prefill import LayerKV, RunPrefill
from loraplex.workers.sampling.static_decoder import BLOCK_TOKENS, StaticDecoder, check_decodable

MIN_WIDTH = 64  # a dense decode cache's positions: a power of two >= the longest prompt + max_tokens
PAGED_MIN_WIDTH = 4096  # a paged one's with a block budget (its rows' block tables have width / 16 columns)


@dataclass
class _Row:
    run: _Run
    job: int
    sample: int
    group: int  # the call's routing group (adapter or base)
    stream: int | None  # its draws' key (choice.stream_key of the job's seed and the sample index); None: greedy
    length: int  # tokens in the KV cache (the last sampled token is not yet)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk: list[list[tuple[int, float]]] | None = None
    stop_reason: str | None = None
    text_checked: int = 0  # decoded characters already searched for stop strings
    cache_row: int = -1  # the row's index in the static decode cache


@dataclass(frozen=True)
class _Group:
    slot: int
    rank: int
    scale: float  # 0 for the base model


class Sampler:
    def __init__(
        self,
        engine: Engine,
        tokenizer: Any = None,
        max_rows: int = 32,
        eos_token_ids: tuple[int, ...] | None = None,
        cuda_graphs: bool = True,
        paged_kv: bool = True,
        kv_blocks: int | None = None,
        max_groups: int | None = None,
        expand_kernel: bool = False,
    ) -> None:
        """tokenizer: decodes samples for stop strings (and gives the EOS id); eos_token_ids: the ids that end a sample
        with "stop" (default: the tokenizer's EOS, else the model config's; () = none); cuda_graphs: on CUDA, replay
        each decode step as a captured graph (False: run it eagerly, for comparison); paged_kv: decode on the paged KV
        cache (static_decoder.py's paged mode, the default: prompts prefilled packed, a job's prompt KV written once
        and its samples fork it); False: the dense per-row cache (kept for comparison); kv_blocks: the paged cache's
        blocks (None: enough for every row at full width; fewer, and samples wait for blocks as they wait for rows);
        max_groups: the adapters decoding at once, over all runs (default the engine's slots); expand_kernel: the
        decode step's LoRA expand as one Triton kernel per projection group on CUDA (kernels/lora_expand.py; off: the
        plain-torch path, until the kernel is measured the faster)."""
        if engine.dist is not None and engine.shard_base:  # a decode step would all-gather every layer
            raise EngineError("the native sampler needs the base model whole: sample a replica (sampling/replica.py)")
        layer_types = getattr(engine.model.config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise EngineError(f"the native sampler supports full-attention layers only, got {sorted(set(layer_types))}")
        for name, value in (("max_rows", max_rows), ("kv_blocks", kv_blocks), ("max_groups", max_groups)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_rows = max_rows
        self.cuda_graphs = cuda_graphs
        self.paged_kv = paged_kv
        if eos_token_ids is None:
            eos: Any = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
            if eos is None:
                eos = getattr(engine.model.config, "eos_token_id", None)
            eos_token_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (int(eos),))
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.max_positions = int(getattr(engine.model.config, "max_position_embeddings", 0) or 0)
        check_decodable(engine)
        self.kv_blocks = kv_blocks
        self.max_groups = max_groups or engine.num_slots
        self.expand_kernel = expand_kernel
        self.stats = SamplerStats()
        self._batch: _Batch | None = None  # the decode batch every run's rows share (built at the first run)

    def batch(self, width: int) -> _Batch:
        """The shared decode batch, built (or rebuilt wider, once no row is live) for rows of `width` positions."""
        batch = self._batch
        if batch is None or (width > batch.decoder.width and not batch.busy):
            if batch is not None:  # its cache and graphs go before the wider one takes the same memory
                batch.retired = True
                batch.decoder.free()
            self._batch = batch = _Batch(self, self._width(width))
        return batch

    def _width(self, need: int) -> int:
        """A decoder's positions for rows of `need`: a power of two, clipped to the model's positions; generous when
        the paged cache has a block budget (a wider paged decoder then costs only its block tables' columns; without
        a budget its blocks cover every row at full width)."""
        generous = self.paged_kv and self.kv_blocks is not None
        width = max(PAGED_MIN_WIDTH if generous else MIN_WIDTH, 1 << (need - 1).bit_length())
        if self.max_positions:
            width = max(need, min(width, self.max_positions))
        return width

    # ---- validation --------------------------------------------------------------------------------------------------
    def check(self, job: SampleJob) -> None:
        """InvalidRequestError (or NotFoundError for an adapter not resident) if the job cannot run on this engine."""
        p = job.params
        vocab = self.engine.vocab_size
        if not job.prompt:
            raise InvalidRequestError("the prompt is empty: sampling needs at least one prompt token")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in job.prompt):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        if job.model_id is not None:
            self.engine.adapter(job.model_id)
        if isinstance(job.num_samples, bool) or not isinstance(job.num_samples, int) or job.num_samples < 1:
            raise InvalidRequestError(f"num_samples must be a positive integer, got {job.num_samples!r}")
        if isinstance(job.first_sample, bool) or not isinstance(job.first_sample, int) or job.first_sample < 0:
            raise InvalidRequestError(f"first_sample must be an integer >= 0, got {job.first_sample!r}")
        if isinstance(p.max_tokens, bool) or not isinstance(p.max_tokens, int) or p.max_tokens < 0:
            raise InvalidRequestError(f"max_tokens must be an integer >= 0, got {p.max_tokens!r}")
        if self.max_positions and len(job.prompt) + p.max_tokens > self.max_positions:
            raise InvalidRequestError(
                f"prompt ({len(job.prompt)} tokens) + max_tokens ({p.max_tokens}) exceeds the model's "
                f"{self.max_positions} positions"
            )
        if not isinstance(p.temperature, int | float) or not 0 <= p.temperature < float("inf"):
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {p.temperature!r}")
        if isinstance(p.top_k, bool) or not isinstance(p.top_k, int) or not (p.top_k == -1 or p.top_k >= 1):
            raise InvalidRequestError(f"top_k must be -1 (off) or a positive integer, got {p.top_k!r}")
        if not isinstance(p.top_p, int | float) or not 0 < p.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {p.top_p!r}")
        if p.seed is not None and (isinstance(p.seed, bool) or not isinstance(p.seed, int)):
            raise InvalidRequestError(f"seed must be an integer or None, got {p.seed!r}")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in p.stop_token_ids):
            raise InvalidRequestError(f"stop token ids must be integers in [0, {vocab})")
        if p.stop_strings:
            if self.tokenizer is None:
                raise InvalidRequestError("stop strings need a tokenizer; this sampler has none")
            if any(not isinstance(s, str) or not s for s in p.stop_strings):
                raise InvalidRequestError("stop strings must be non-empty strings")
        if self.paged_kv and self.kv_blocks is not None:
            need = first_sample_blocks(len(job.prompt), p.max_tokens, BLOCK_TOKENS)
            if need > self.kv_blocks:
                raise InvalidRequestError(
                    f"prompt ({len(job.prompt)} tokens) + max_tokens ({p.max_tokens}) needs {need} KV blocks of "
                    f"{BLOCK_TOKENS} positions; this pool's sampler cache has {self.kv_blocks}: ask for fewer tokens"
                )
        for name in ("topk_prompt_logprobs", "topk_sample_logprobs"):
            k = getattr(job, name)
            if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= vocab:
                raise InvalidRequestError(f"{name} must be an integer in [0, {vocab}], got {k!r}")

    # ---- generation --------------------------------------------------------------------------------------------------
    def generate(self, jobs: Sequence[SampleJob]) -> list[SampleOutput]:
        """One output per job, in order (see the module docstring). Every job is checked first (`check`)."""
        run = self.start(jobs)
        try:
            run.advance(None)  # no budget: to the end
        finally:
            run.close()
        return run.outputs

    def start(self, jobs: Sequence[SampleJob]) -> SampleRun:
        """A resumable generation of these jobs (checked first); its weights are frozen from now on. Run it with
        `advance`; `close` it if it is abandoned before it is done."""
        for job in jobs:
            self.check(job)
        return SampleRun(self, list(jobs))


class SampleRun:
    """One generation run in slices: `advance` until it returns True, then `outputs` holds one output per job. Its
    rows decode in the sampler's shared batch beside other runs' rows."""

    def __init__(self, sampler: Sampler, jobs: list[SampleJob]) -> None:
        self.outputs = [SampleOutput(sequences=[]) for _ in jobs]
        self.stats = SamplerStats()
        sampler.stats = self.stats  # the sampler's stats: its latest run's
        self._sampler = sampler
        self._run: _Run | None = None
        if jobs:
            with torch.inference_mode():
                self._run = _Run(sampler, jobs, self.outputs, self.stats)

    @property
    def done(self) -> bool:
        return self._run is None or self._run.done

    @property
    def model_ids(self) -> set[str]:
        """The adapters (sampler copies) it samples from."""
        return set() if self._run is None else {m for m in self._run.group_of if m is not None}

    @property
    def needs_slots(self) -> bool:
        """Whether its adapters must be resident in their slots while it advances: on the unfused path its prefills
        read the slot banks (the fused path gathered its weights when it started), and until its adapters have LoRA
        groups in the decode batch (they are copied from the slots then)."""
        run = self._run
        return run is not None and bool(self.model_ids) and (run.banks is None or run.decoder_group is None)

    def advance(self, budget_s: float | None, yield_now: Callable[[], bool] | None = None) -> bool:
        """Run for about `budget_s` seconds (None: to the end), at least one admission or decode step, and stop early
        once `yield_now()` says other work waits; True when done. The shared batch's other runs advance as well."""
        if self._run is None:
            return True
        with torch.inference_mode():
            finished = self._run.advance(budget_s, yield_now)
        if finished:
            self.close()
        return finished

    def progress(self) -> list[list[SampledSequence]]:
        """Per job, per sample: what it has sampled so far (a sample not admitted yet: nothing; stop_reason "" while
        it goes on). The lists are the rows' own, growing as the run advances: copy what is kept past the next
        `advance`. For streaming answers (workers/sampling/step.py's `progress`)."""
        if self._run is None:
            return [list(out.sequences) for out in self.outputs]
        return self._run.progress()

    def close(self) -> None:
        """Leave the batch: rows and blocks go back (a run abandoned before its end: its outputs stay incomplete)."""
        if self._run is not None:
            with torch.inference_mode():
                self._run.leave()
            self._run = None


class _Run:
    """One run's state (see SampleRun)."""

    def __init__(
        self, sampler: Sampler, jobs: list[SampleJob], outputs: list[SampleOutput], stats: SamplerStats
    ) -> None:
        self.sampler = sampler
        self.stats = stats
        self.engine = engine = sampler.engine
        self.jobs = jobs
        self.outputs = outputs
        self.finished: list[list[SampledSequence | None]] = [[None] * j.num_samples for j in jobs]
        # Routing groups: one per distinct adapter (and the base model), in order of first appearance.
        self.group_of: dict[str | None, int] = {}
        self.groups: list[_Group] = []
        for job in jobs:
            if job.model_id not in self.group_of:
                self.group_of[job.model_id] = len(self.groups)
                if job.model_id is None:
                    self.groups.append(_Group(slot=0, rank=1, scale=0.0))
                else:
                    r = engine.adapter(job.model_id)
                    self.groups.append(_Group(slot=r.slot, rank=r.rank, scale=r.scale))
        self.banks: MicrobatchBanks | None = None
        if engine.fused_lora and any(g.scale != 0.0 for g in self.groups):
            engine.optimizer.adopt_views()
            full = Routing.build(
                [g.slot for g in self.groups],
                [g.rank for g in self.groups],
                [g.scale for g in self.groups],
                [0] * len(self.groups),
                engine.device,
            )
            grouped = next(iter(engine.banks.values())).op is lora_delta_grouped
            self.banks = MicrobatchBanks.gather(
                engine.optimizer.data, full, engine.compute_dtype, trainable=False, grouped=grouped
            )
        self.head_weight = cast(torch.Tensor, engine.head.weight)
        self.config: Any = engine.model.config
        # The run's adapters (not the base model), in group order, and once it has joined the batch their LoRA groups
        # there (None until then: the batch had no free groups or was too narrow).
        self.adapter_groups = [g for g, group in enumerate(self.groups) if group.scale != 0.0]
        if len(self.adapter_groups) > sampler.max_groups:
            raise InvalidRequestError(
                f"{len(self.adapter_groups)} adapters in one run; the sampler decodes at most {sampler.max_groups} "
                "at once"
            )
        self.need = max(len(job.prompt) + job.params.max_tokens for job in jobs)
        self.key = next(_RUN_KEYS)  # its holder rows' keys in the decoder: (key, job)
        self.decoder_group: dict[int, int] | None = None
        self.live = 0  # its rows in the batch
        self.prefill = RunPrefill(self)  # its prompts through the model (holders, pieces, prompt logprobs)
        self.waiting: deque[tuple[int, int]] = deque(
            (j, s) for j, job in enumerate(jobs) for s in range(job.num_samples)
        )
        # Jobs of the same adapter, prompt and prompt-logprob asks (another request for the same prompt) share the
        # first such job's prefill and prompt blocks: `source[j]` is that job (j itself for the first). Its holder
        # row ends once every sample of every job sharing it has forked.
        first: dict[tuple[Any, ...], int] = {}
        self.source = [
            first.setdefault((job.model_id, job.prompt, job.prompt_logprobs, job.topk_prompt_logprobs), j)
            for j, job in enumerate(jobs)
        ]
        self.unadmitted = [0] * len(jobs)  # per source job: samples of the jobs sharing it not admitted yet
        for j, job in enumerate(jobs):
            self.unadmitted[self.source[j]] += job.num_samples
        # A job without a seed draws one now, from the OS (not torch's global generator, which model init seeds).
        self.seeds = [job.params.seed if job.params.seed is not None else secrets.randbits(64) for job in jobs]
        self.batch = sampler.batch(self.need)
        self.batch.join(self)

    # ---- routing -----------------------------------------------------------------------------------------------------
    def routing_for(self, rows_per_group: Sequence[int]) -> tuple[Routing | None, MicrobatchBanks | None]:
        """Routing (and gathered banks) for a batch whose rows are contiguous per group, `rows_per_group` rows each."""
        present = [g for g, n in enumerate(rows_per_group) if n > 0]
        if all(self.groups[g].scale == 0.0 for g in present):
            return None, None  # base rows only: the plain model
        if len(present) == 1:  # one adapter: the plain-matmul path on a one-group view of the gathered banks
            g = present[0]
            group = self.groups[g]
            routing = Routing.build([group.slot], [group.rank], [group.scale], [rows_per_group[g]], self.engine.device)
            banks = None
            if self.banks is not None:
                banks = MicrobatchBanks(self.banks.compute[g : g + 1], None, self.banks.grouped)
            return routing, banks
        routing = Routing.build(
            [g.slot for g in self.groups],
            [g.rank for g in self.groups],
            [g.scale for g in self.groups],
            list(rows_per_group),
            self.engine.device,
        )
        return routing, self.banks

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, V] of final-norm hidden states [N, H]."""
        return F.linear(hidden, self.head_weight).float()

    # ---- the loop ----------------------------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return not (self.waiting or self.live)

    @property
    def decoder(self) -> StaticDecoder:
        return self.batch.decoder

    def advance(self, budget_s: float | None, yield_now: Callable[[], bool] | None = None) -> bool:
        """Admit this run's samples and decode the shared batch until this run is done, `budget_s` seconds have
        passed or `yield_now()` (at least one round); True when done."""
        self._rebind()
        deadline = None if budget_s is None else time.perf_counter() + budget_s
        while not self.done:
            if self.batch.retired:  # too narrow for this run and idle: move to the wider one the sampler builds
                self.batch.leave(self)
                self.batch = self.sampler.batch(self.need)
                self.batch.join(self)
            self.batch.place(self)
            self._admit()
            if self.batch.rows:
                self.stats.peak_rows = max(self.stats.peak_rows, len(self.batch.rows))
                for run in self.batch.runs:
                    run.stats.decode_steps += run.live > 0
                graphs = len(self.decoder.graphs)
                self.batch.decode_step()  # reads its tokens back to the host: the time includes the device's work
                self.stats.graph_captures += len(self.decoder.graphs) - graphs
            elif not self.done and not self.batch.retired:
                # Nothing decodes and this run cannot start: other runs hold the LoRA groups or blocks it needs until
                # they advance (a sliced caller advances them in turn).
                if budget_s is None:
                    raise EngineError("this sampling run cannot start: other runs hold the decoder's groups or blocks")
                break
            if deadline is not None and time.perf_counter() >= deadline:
                break
            if yield_now is not None and yield_now():
                break
        return self.done

    def progress(self) -> list[list[SampledSequence]]:
        """SampleRun.progress: finished samples as they ended, live rows as they stand, waiting ones empty."""
        live = {(row.job, row.sample): row for row in self.batch.rows.values() if row.run is self}
        out: list[list[SampledSequence]] = []
        for j, job in enumerate(self.jobs):
            seqs = []
            for s in range(job.num_samples):
                done, row = self.finished[j][s], live.get((j, s))
                if done is not None:
                    seqs.append(done)
                elif row is not None:
                    seqs.append(SampledSequence(row.tokens, row.logprobs, "", row.topk))
                else:
                    seqs.append(SampledSequence([], [], "", [] if job.topk_sample_logprobs else None))
            out.append(seqs)
        return out

    def leave(self) -> None:
        """The run ended or is abandoned: its rows and prompt holders end, its LoRA groups go back."""
        self.batch.leave(self)
        for j in list(self.prefill.held):
            self.decoder.drop_prompt((self.key, j))
        self.prefill.held.clear()
        self.prefill.pieces.clear()
        self.waiting.clear()
        self.live = 0

    def _rebind(self) -> None:
        """Without gathered banks (the unfused path), prefills read the slots: find the adapters' slots again (a
        swap between slices may have moved them; the caller keeps them resident while the run advances)."""
        if self.banks is not None and self.decoder_group is not None:
            return
        for model_id, g in self.group_of.items():
            if model_id is not None:
                r = self.engine.adapter(model_id)
                self.groups[g] = _Group(slot=r.slot, rank=r.rank, scale=r.scale)

    def _admit(self) -> None:
        """Admit this run's waiting samples into free rows of the batch while the KV blocks cover them (rows that end
        at their first token finish here). Paged: a job's holder row ends once every sample of it has forked."""
        if self.decoder_group is None:
            return  # not placed in the batch yet
        stats, batch = self.stats, self.batch
        decoding = bool(batch.rows)  # rows joining now join a batch already mid-decode
        while self.waiting and batch.free_rows:
            if self.prefill.next_piece():  # a long prompt's prefill went one piece further
                if decoding:
                    return  # the batch's next step first
                continue
            # While rows decode, at most one prefill chunk between two of their steps: a large admission (hundreds of
            # prompts) delays them by a chunk's forward, not by every prompt's.
            take = self._fitting(len(batch.free_rows), self.engine.microbatch_tokens if decoding else None)
            if not take:
                return  # wait for rows of the batch to end and give their blocks back
            source = self.source
            prefill = sorted({source[j] for j, _ in take if source[j] not in self.prefill.prefilled})
            self.prefill.prompts(prefill)
            rows = [self._new_row(j, s) for j, s in take]
            first = [row for row in rows if row.stop_reason is None]  # max_tokens 0 ends at once
            if first:  # every new row's first token, from its job's prefill logits: one choice for all
                logits = [self.prefill.prefilled[source[row.job]].last_logits for row in first]
                _choose(self.sampler, first, torch.stack(logits))
            for row in rows:
                stats.rows_admitted += 1
                shared = source[row.job]
                if row.stop_reason is None:
                    self._join(row, self.prefill.prefilled[shared].kv)
                    stats.joined_live_batch += decoding
                else:
                    self._finish(row)
                self.unadmitted[shared] -= 1
                if self.unadmitted[shared] == 0:
                    del self.prefill.prefilled[shared]  # every sample sharing it has its copy of the prompt KV in the cache
                    if shared in self.prefill.held:
                        self.decoder.drop_prompt((self.key, shared))
                        self.prefill.held.discard(shared)
            if decoding and prefill:
                return  # the batch's next step first

    def _fitting(self, free_rows: int, prefill_tokens: int | None = None) -> list[tuple[int, int]]:
        """The next waiting samples (at most `free_rows`) whose KV blocks the paged cache can hold now (each job's
        prompt once, for its holder, then each sample's own blocks), taken off the queue. prefill_tokens: the prompts
        still to prefill among them fit one chunk of that many tokens (at least one prompt; None: no limit)."""
        blocks = self.decoder.blocks
        take: list[tuple[int, int]] = []
        available = blocks.available if blocks is not None else 0
        holding: set[int] = set()
        to_prefill: set[int] = set()
        prompt_tokens = 0
        while self.waiting and len(take) < free_rows:
            j, _ = self.waiting[0]
            shared = self.source[j]
            if prefill_tokens is not None and shared not in self.prefill.prefilled and shared not in to_prefill:
                length = len(self.jobs[shared].prompt)
                if to_prefill and prompt_tokens + length > prefill_tokens:
                    break
                to_prefill.add(shared)
                prompt_tokens += length
            if blocks is not None:
                job = self.jobs[j]
                length = len(job.prompt)
                if shared in self.prefill.held or shared in holding:  # its prompt's blocks are held: only the sample's own
                    need = blocks.blocks_needed(length, job.params.max_tokens, length)
                else:
                    need = first_sample_blocks(length, job.params.max_tokens, blocks.block_tokens)
                if need > available:
                    if need > blocks.num_blocks:
                        raise KvBlocksExhausted(
                            f"a sample of {length} + {job.params.max_tokens} positions needs {need} KV blocks of "
                            f"{blocks.block_tokens}; the sampler's cache has {blocks.num_blocks}"
                        )
                    break
                available -= need
                holding.add(shared)
            take.append(self.waiting.popleft())
        return take

    def _join(self, row: _Row, kv: list[LayerKV] | None) -> None:
        """A new row takes a free row of the batch (with its prompt KV and its adapter's LoRA group)."""
        group = self.groups[row.group]
        assert self.decoder_group is not None
        lora_group = self.decoder_group[row.group] if group.scale != 0.0 else None
        max_new = self.jobs[row.job].params.max_tokens
        row.cache_row = self.batch.take_row(row)
        prompt = (self.key, self.source[row.job])
        self.decoder.set_row(row.cache_row, lora_group, group.scale, kv, prompt=prompt, max_new=max_new)
        self.live += 1

    def _new_row(self, j: int, s: int) -> _Row:
        job = self.jobs[j]
        stream = stream_key(self.seeds[j], job.first_sample + s) if job.params.temperature > 0 else None
        row = _Row(run=self, job=j, sample=s, group=self.group_of[job.model_id], stream=stream, length=len(job.prompt))
        if job.topk_sample_logprobs:
            row.topk = []
        if job.params.max_tokens == 0:
            row.stop_reason = LENGTH
        return row

    def _hit_stop_string(self, row: _Row, p: SampleParams) -> bool:
        if not p.stop_strings:
            return False
        text: str = self.sampler.tokenizer.decode(row.tokens, skip_special_tokens=False)
        longest = max(len(s) for s in p.stop_strings)
        start = max(0, row.text_checked - longest)  # a string may end in the new text and start before it
        row.text_checked = len(text)
        window = text[start:]
        return any(s in window for s in p.stop_strings)

    def _finish(self, row: _Row) -> None:
        assert row.stop_reason is not None
        self.finished[row.job][row.sample] = SampledSequence(
            tokens=row.tokens, logprobs=row.logprobs, stop_reason=row.stop_reason, topk_logprobs=row.topk
        )
        out = self.outputs[row.job]
        if all(seq is not None for seq in self.finished[row.job]):
            out.sequences = [seq for seq in self.finished[row.job] if seq is not None]


class _Batch:
    """The decode batch every run of a sampler shares: one static decoder (its rows, KV cache and LoRA groups), the
    live rows of all runs, and one decode step for them all, so runs that start at different times (other tenants'
    requests, later plans) decode together instead of one batch each."""

    def __init__(self, sampler: Sampler, width: int) -> None:
        self.sampler = sampler
        self.decoder = StaticDecoder(
            sampler.engine, sampler.max_rows, width, sampler.max_groups, paged=sampler.paged_kv,
            num_blocks=sampler.kv_blocks, expand_kernel=sampler.expand_kernel,
        )  # fmt: skip
        if sampler.cuda_graphs:
            self.decoder.enable_graphs()
        # A heap: a new row takes the lowest free one, so live rows stay packed at the bottom and a step runs the
        # smallest row bucket that holds them (rows past the highest live one are not run).
        self.free_rows = list(range(sampler.max_rows))
        self.free_groups = list(range(sampler.max_groups - 1, -1, -1))
        self.rows: dict[int, _Row] = {}  # cache row -> its live row
        self.runs: list[_Run] = []  # joined, in order
        self.retired = False  # replaced by a wider batch: its runs move to the sampler's new one

    @property
    def busy(self) -> bool:
        """Some run holds rows, prompt holders or LoRA groups here."""
        return any(run.live or run.prefill.held or run.decoder_group is not None for run in self.runs)

    def join(self, run: _Run) -> None:
        self.runs.append(run)
        self.place(run)

    def place(self, run: _Run) -> None:
        """Give a joined run LoRA groups for its adapters (copied from their slots now) when enough are free and its
        rows fit the decoder's width; until then it waits (its `decoder_group` stays None). Too narrow and idle: the
        sampler builds a wider batch now (this one retires, and its runs move at their next round)."""
        if self.retired or run.decoder_group is not None:
            return
        if run.need > self.decoder.width:
            if not self.busy:
                self.sampler.batch(run.need)
            return
        if len(run.adapter_groups) > len(self.free_groups):
            return
        run._rebind()
        placed = {}
        for g in run.adapter_groups:
            placed[g] = self.free_groups.pop()
            self.decoder.load_group(placed[g], run.groups[g].slot)
        run.decoder_group = placed

    def leave(self, run: _Run) -> None:
        for row in [row for row in self.rows.values() if row.run is run]:
            self.end_row(row)
        if run.decoder_group is not None:
            self.free_groups.extend(run.decoder_group.values())
            run.decoder_group = None
        if run in self.runs:
            self.runs.remove(run)

    def take_row(self, row: _Row) -> int:
        cache_row = heapq.heappop(self.free_rows)
        self.rows[cache_row] = row
        return cache_row

    def end_row(self, row: _Row) -> None:
        self.decoder.end_row(row.cache_row)
        del self.rows[row.cache_row]
        heapq.heappush(self.free_rows, row.cache_row)
        row.run.live -= 1

    def decode_step(self) -> None:
        """One token for every live row of every run (rows [0, highest live row] of the decoder)."""
        live = sorted(self.rows.items())
        count = live[-1][0] + 1
        tokens, positions = [0] * count, [0] * count
        for cache_row, row in live:
            tokens[cache_row], positions[cache_row] = row.tokens[-1], row.length
        logits = self.decoder.step(tokens, positions)
        rows = [row for _, row in live]
        index = torch.tensor([r for r, _ in live], dtype=torch.int64, device=logits.device)
        for row in rows:
            row.length += 1
        _choose(self.sampler, rows, logits.index_select(0, index))
        for row in rows:
            if row.stop_reason is not None:
                row.run._finish(row)
                self.end_row(row)


_RUN_KEYS = itertools.count()


def _choose(sampler: Sampler, rows: Sequence[_Row], logits: torch.Tensor) -> None:
    """Pick each row's next token from its logits [B, V] (fp32), append it and check the stops (rows of any runs)."""
    params = [r.run.jobs[r.job].params for r in rows]
    chosen = choose_tokens(  # each row's t-th draw: t = the tokens it has sampled so far
        logits,
        [p.temperature for p in params],
        [p.top_k for p in params],
        [p.top_p for p in params],
        streams=[r.stream for r in rows],
        steps=[len(r.tokens) for r in rows],
        topk_logprobs=[r.run.jobs[r.job].topk_sample_logprobs for r in rows],
    ).to_host()  # tokens, logprobs and top-k logprobs in one copy
    for row, p, tok, lp, top in zip(rows, params, chosen.tokens, chosen.logprobs, chosen.top, strict=True):
        row.tokens.append(int(tok))
        row.logprobs.append(float(lp))
        if row.topk is not None and top is not None:
            row.topk.append(top)
        eos = p.stop_at_eos and tok in sampler.eos_token_ids
        if tok in p.stop_token_ids or eos or row.run._hit_stop_string(row, p):
            row.stop_reason = STOP
        elif len(row.tokens) >= p.max_tokens:
            row.stop_reason = LENGTH
