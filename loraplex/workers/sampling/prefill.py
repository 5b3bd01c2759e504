"""A sampling run's prompts through the model (sampler.py's `_Run` owns one `RunPrefill`).

Paged (the default): a chunk of prompts runs as one [1, N] row without padding (positions restarting at 0 per
prompt, the engine's packed attention); each prompt's K/V is written by the forward itself into the blocks of a
holder row (`static_decoder.PromptWriter`), which the job's samples then fork. A prompt longer than a chunk
(engine.microbatch_tokens tokens) goes one piece at a time, each piece attending over the prompt's earlier positions
read back from the holder's blocks (the packed attention's continuation path); admission runs at most one piece
between two decode steps, so a long prompt never stalls the rows that decode. Dense: right-padded chunks through the
model's own forward and cache, the prompt KV copied out per job.

What a prefill leaves per job: its last logits (each sample's first token is drawn from them), the prompt KV (dense)
or the held blocks (paged), and the prompt logprobs (and top-k) when the job asks, for every job sharing its prompt.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from transformers import DynamicCache

from loraplex.workers.engine.engine import Engine
from loraplex.workers.engine.lm_head import LOSS_CHUNK_TOKENS
from loraplex.workers.kernels.packed_attention import packed_forward_kwargs
from loraplex.workers.lora import MicrobatchBanks, Routing
from loraplex.workers.sampling.choice import top_logprobs
from loraplex.workers.sampling.jobs import SampleJob, SampleOutput, SamplerStats
from loraplex.workers.sampling.kv_blocks import first_sample_blocks
from loraplex.workers.sampling.static_decoder import PromptWriter, StaticDecoder

# One layer's (keys, values) for one sequence: [kv_heads, L, D] each.
LayerKV = tuple[torch.Tensor, torch.Tensor]


class PrefillRun(Protocol):
    """What a prefill reads of its run (sampler.py's `_Run`)."""

    engine: Engine
    jobs: list[SampleJob]
    outputs: list[SampleOutput]
    stats: SamplerStats
    config: Any
    key: int  # its holder rows' keys in the decoder: (key, job)
    group_of: dict[str | None, int]  # a job's model_id -> its routing group
    groups: list[Any]  # the run's routing groups (their count sizes a chunk's per-group row counts)
    source: list[int]  # per job, the job whose prefill it shares
    waiting: deque[tuple[int, int]]  # (job, sample) not admitted yet, in order

    @property
    def decoder(self) -> StaticDecoder: ...

    def routing_for(self, rows_per_group: Sequence[int]) -> tuple[Routing | None, MicrobatchBanks | None]: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass
class Prefilled:
    kv: list[LayerKV] | None  # per layer [H, L, D]; None when paged (the KV sits in the decoder's blocks)
    last_logits: torch.Tensor  # fp32 [V]


@dataclass
class PromptPieces:
    """A long prompt's prefill so far: the positions done, its holder's cache slots, the prompt logprobs so far."""

    slots: torch.Tensor
    end: int = 0
    values: list[float] = field(default_factory=list)
    tops: list[list[tuple[int, float]] | None] = field(default_factory=list)


class RunPrefill:
    def __init__(self, run: PrefillRun) -> None:
        self.run = run
        self.prefilled: dict[int, Prefilled] = {}
        self.held: set[int] = set()  # paged: jobs whose prompt KV the decoder holds for their samples to fork
        self.pieces: dict[int, PromptPieces] = {}  # paged: prompts longer than a chunk, part way through

    def prompts(self, job_ids: Sequence[int]) -> None:
        """Prefill these jobs' prompts (rows contiguous per group, in chunks of at most engine.microbatch_tokens
        tokens: packed without padding when paged, right padded to the chunk's longest prompt when dense; a longer
        prompt in pieces when paged, alone when dense): keep each job's last logits (and, dense, its prompt KV), and
        fill in its prompt logprobs when asked."""
        pending = sorted(job_ids, key=lambda j: (self.run.group_of[self.run.jobs[j].model_id], j))
        budget = max(1, self.run.engine.microbatch_tokens)
        if self.run.decoder.paged:  # a prompt longer than a chunk: its pieces, one after another
            for j in [j for j in pending if len(self.run.jobs[j].prompt) > budget]:
                while j not in self.prefilled:
                    self._piece(j)
            pending = [j for j in pending if j not in self.prefilled]
        chunk: list[int] = []
        for j in pending:
            lengths = [len(self.run.jobs[i].prompt) for i in (*chunk, j)]
            size = sum(lengths) if self.run.decoder.paged else max(lengths) * len(lengths)
            if chunk and size > budget:
                self._chunk(chunk)
                chunk = []
            chunk.append(j)
        if chunk:
            self._chunk(chunk)

    def _chunk(self, job_ids: Sequence[int]) -> None:
        if self.run.decoder.paged:
            self._packed(job_ids)
            return
        engine = self.run.engine
        self.run.stats.prefill_forwards += 1
        prompts = [self.run.jobs[j].prompt for j in job_ids]
        self.run.stats.prefill_tokens += sum(len(p) for p in prompts)
        width = max(len(p) for p in prompts)
        # Right padding: causal attention keeps each real token blind to the pads after it (as the engine's forward).
        tokens = torch.full((len(prompts), width), engine.pad_id, dtype=torch.int64)
        for b, prompt in enumerate(prompts):
            tokens[b, : len(prompt)] = torch.tensor(prompt, dtype=torch.int64)
        tokens = tokens.to(engine.device)
        positions = torch.arange(width, device=engine.device).expand(len(prompts), width)
        counts = [0] * len(self.run.groups)
        for j in job_ids:
            counts[self.run.group_of[self.run.jobs[j].model_id]] += width
        routing, banks = self.run.routing_for(counts)
        cache = DynamicCache(config=self.run.config)
        with engine.context.use(routing, banks):
            hidden = engine.body(
                input_ids=tokens, position_ids=positions, past_key_values=cache, use_cache=True
            ).last_hidden_state
        lengths = torch.tensor([len(p) for p in prompts], device=engine.device)
        last = self.run.logits(hidden[torch.arange(len(prompts), device=engine.device), lengths - 1])
        layers = [(layer.keys, layer.values) for layer in cast(Any, cache).layers]
        for b, j in enumerate(job_ids):
            n = len(prompts[b])
            kv = [(k[b, :, :n].clone(), v[b, :, :n].clone()) for k, v in layers]
            self.prefilled[j] = Prefilled(kv=kv, last_logits=last[b])
            job = self.run.jobs[j]
            if job.prompt_logprobs or job.topk_prompt_logprobs:
                self._prompt_logprobs(j, hidden[b, : n - 1])

    def _packed(self, job_ids: Sequence[int]) -> None:
        """Paged: the chunk's prompts back to back in one [1, N] row (positions restarting at 0 per prompt, the
        engine's packed attention), each prompt's K/V written by the forward itself into the blocks of its holder row
        (`static_decoder.PromptWriter`), which the job's samples then fork."""
        engine, decoder = self.run.engine, self.run.decoder
        self.run.stats.prefill_forwards += 1
        prompts = [self.run.jobs[j].prompt for j in job_ids]
        self.run.stats.prefill_tokens += sum(len(p) for p in prompts)
        lengths = [len(p) for p in prompts]
        device = engine.device
        tokens = torch.tensor([t for p in prompts for t in p], dtype=torch.int64).to(device).view(1, -1)
        positions = torch.cat([torch.arange(n) for n in lengths]).to(device).view(1, -1)
        ends = torch.tensor(lengths).cumsum(0)
        cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int64), ends]).to(device, torch.int32)
        held = []
        for j, prompt in zip(job_ids, prompts, strict=True):
            held.append(decoder.prompt_slots((self.run.key, j), prompt))
            self.held.add(j)  # at once: a failure after this still gives the holder's blocks back (`leave`)
        slots = torch.cat(held)
        counts = [0] * len(self.run.groups)
        for j, n in zip(job_ids, lengths, strict=True):
            counts[self.run.group_of[self.run.jobs[j].model_id]] += n
        routing, banks = self.run.routing_for(counts)
        writer = PromptWriter(decoder, slots)
        with engine.context.use(routing, banks), engine.elementwise():
            hidden = engine.body(
                input_ids=tokens,
                position_ids=positions,
                past_key_values=writer,
                use_cache=True,
                **packed_forward_kwargs(self.run.config, cu_seqlens, max(lengths)),
            ).last_hidden_state[0]
        last = self.run.logits(hidden.index_select(0, (ends - 1).to(device)))
        starts = (ends - torch.tensor(lengths)).tolist()
        for b, j in enumerate(job_ids):
            self.prefilled[j] = Prefilled(kv=None, last_logits=last[b])
            job = self.run.jobs[j]
            if job.prompt_logprobs or job.topk_prompt_logprobs:
                self._prompt_logprobs(j, hidden[starts[b] : starts[b] + lengths[b] - 1])

    def next_piece(self) -> bool:
        """Paged: prefill the next piece of the next waiting sample's prompt when it is longer than a chunk (its
        holder's blocks counted as admission counts them: the prompt and a first sample); False when there is no
        such prompt or its blocks are not free yet (admission then waits for them, or refuses a prompt that can
        never fit)."""
        if not self.run.decoder.paged or not self.run.waiting:
            return False
        j = self.run.source[self.run.waiting[0][0]]
        job = self.run.jobs[j]
        if j in self.prefilled or (
            j not in self.pieces and len(job.prompt) <= max(1, self.run.engine.microbatch_tokens)
        ):
            return False
        blocks = self.run.decoder.blocks
        assert blocks is not None
        need = first_sample_blocks(len(job.prompt), job.params.max_tokens, blocks.block_tokens)
        if j not in self.pieces and need > blocks.available:
            return False
        self._piece(j)
        return True

    def _piece(self, j: int) -> None:
        """The next piece (at most engine.microbatch_tokens tokens) of job j's prompt through the body: its K/V into
        the holder's blocks, its attention over every earlier position of the prompt read back from them
        (`PromptWriter` with history, the packed attention's continuation path). The last piece leaves the prompt
        prefilled as `_packed` does."""
        engine, decoder = self.run.engine, self.run.decoder
        job = self.run.jobs[j]
        prompt = job.prompt
        if j not in self.pieces:
            self.pieces[j] = PromptPieces(slots=decoder.prompt_slots((self.run.key, j), prompt))
            self.held.add(j)  # at once: a failure after this still gives the holder's blocks back (`leave`)
        piece = self.pieces[j]
        start, slots = piece.end, piece.slots
        end = min(len(prompt), start + max(1, engine.microbatch_tokens))
        n, device = end - start, engine.device
        self.run.stats.prefill_forwards += 1
        self.run.stats.prefill_tokens += n
        tokens = torch.tensor(prompt[start:end], dtype=torch.int64).to(device).view(1, -1)
        positions = torch.arange(start, end).to(device).view(1, -1)
        kwargs = packed_forward_kwargs(self.run.config, torch.tensor([0, n], dtype=torch.int32).to(device), n)
        if start:
            kwargs.update(cu_seq_lens_k=torch.tensor([0, end], dtype=torch.int32).to(device), max_length_k=end)
        counts = [0] * len(self.run.groups)
        counts[self.run.group_of[job.model_id]] = n
        routing, banks = self.run.routing_for(counts)
        writer = PromptWriter(decoder, slots[start:end], history=slots[:end] if start else None)
        with engine.context.use(routing, banks), engine.elementwise():
            hidden = engine.body(
                input_ids=tokens, position_ids=positions, past_key_values=writer, use_cache=True, **kwargs
            ).last_hidden_state[0]
        if job.prompt_logprobs or job.topk_prompt_logprobs:  # rows predicting prompt tokens start+1 .. end
            got_values, got_tops = self._prompt_logprob_values(j, hidden[: min(n, len(prompt) - 1 - start)], start + 1)
            piece.values += got_values
            piece.tops += got_tops
        if end < len(prompt):
            piece.end = end
            return
        del self.pieces[j]
        self.prefilled[j] = Prefilled(kv=None, last_logits=self.run.logits(hidden[n - 1 :])[0])
        self._set_prompt_logprobs(j, piece.values, piece.tops)

    def _prompt_logprobs(self, j: int, hidden: torch.Tensor) -> None:
        """Prompt token t's logprob given tokens < t (from hidden states of positions 0..n-2), chunked over tokens."""
        self._set_prompt_logprobs(j, *self._prompt_logprob_values(j, hidden, 1))

    def _prompt_logprob_values(
        self, j: int, hidden: torch.Tensor, first: int
    ) -> tuple[list[float], list[list[tuple[int, float]] | None]]:
        """The logprobs (and top-k) of prompt tokens first, first + 1, ... from the hidden states of the positions
        before each (one row per token), chunked over tokens."""
        job = self.run.jobs[j]
        targets = torch.tensor(job.prompt[first : first + hidden.shape[0]], dtype=torch.int64, device=hidden.device)
        values: list[float] = []
        tops: list[list[tuple[int, float]] | None] = []
        for start in range(0, hidden.shape[0], LOSS_CHUNK_TOKENS):
            lp = torch.log_softmax(self.run.logits(hidden[start : start + LOSS_CHUNK_TOKENS]), dim=-1)
            if job.prompt_logprobs:
                values += lp.gather(1, targets[start : start + LOSS_CHUNK_TOKENS, None]).view(-1).cpu().tolist()
            if job.topk_prompt_logprobs:
                tops += top_logprobs(lp, [job.topk_prompt_logprobs] * lp.shape[0])
        return values, tops

    def _set_prompt_logprobs(self, j: int, values: list[float], tops: list[list[tuple[int, float]] | None]) -> None:
        job = self.run.jobs[j]
        for k in (k for k, shared in enumerate(self.run.source) if shared == j):  # j and the jobs sharing its prompt
            out = self.run.outputs[k]
            if job.prompt_logprobs:
                out.prompt_logprobs = [None, *values]
            if job.topk_prompt_logprobs:
                out.topk_prompt_logprobs = [None, *tops]
