"""Sampling on a pool of several ranks: a run's rows (samples) split across the ranks, each decoding its share alone
(on a whole copy of the base model: workers/sampling/replica.py, or the engine itself under pool_layout "replicate"),
the outputs gathered to the leader once the whole run is done.

Every rank runs the same SAMPLE step on the same plan (rank_loop.py), so every rank makes the same adapter-store
swaps and starts the same runs; `RankSampler.start` runs this rank's pieces of the jobs (`assign_rows`: contiguous
ranges of the run's samples balanced by work, so one job of many samples spreads over ranks). A sample's draws depend
only on (seed, sample index, token index), and a piece keeps its samples' indices (SampleJob.first_sample), so every
sample gets the tokens it gets on one process (an unseeded job draws its seed on each rank). A run advances each rank's share for the slice's budget with no collective per
decode step; at the end of each slice the ranks exchange one small status (done, or the error a rank hit), and when
every share is done the outputs travel once to the leader (gather on the control group). An error on any rank fails
the whole run on every rank alike, so the ranks stay in step.

A slice on a multi-rank pool ends on its time budget only: `yield_now` (the leader's "training waits" event) is
ignored, since the other ranks cannot see it without a collective per decode step; an arriving training step waits
at most one slice (LORAPLEX_SAMPLE_SLICE_MS), not one decode step.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch.distributed as dist

from loraplex.errors import EngineError
from loraplex.workers.engine.engine import Engine
from loraplex.workers.ranks.distributed import RankGroup
from loraplex.workers.sampling.jobs import SampleJob, SampleOutput
from loraplex.workers.sampling.replica import ReplicaEngine
from loraplex.workers.sampling.sampler import Sampler, SampleRun


@dataclass(frozen=True)
class Piece:
    """Samples first .. first + count - 1 of job `job`: a rank's part of it."""

    job: int
    first: int
    count: int


def row_work(job: SampleJob) -> int:
    """What one sample of a job costs to decode, roughly: the positions its row may reach."""
    return len(job.prompt) + job.params.max_tokens


def assign_rows(jobs: Sequence[SampleJob], world_size: int) -> list[list[Piece]]:
    """Each rank's pieces of the jobs: the run's rows (every job's samples, in job order) cut into `world_size`
    contiguous ranges balanced by work, a row going to the rank whose share holds its midpoint (as split_rows cuts a
    plan's sequences). So a job is cut only where a range ends (its prompt then prefilled on both sides), and a job of
    many samples spreads over ranks. A pure function of the jobs: every rank computes the same split."""
    total = sum(job.num_samples * row_work(job) for job in jobs)
    parts: list[list[Piece]] = [[] for _ in range(world_size)]
    before = 0
    for j, job in enumerate(jobs):
        w = row_work(job)
        for s in range(job.num_samples):
            r = min((world_size * (2 * before + w)) // (2 * total), world_size - 1) if total else 0
            last = parts[r][-1] if parts[r] else None
            if last is not None and last.job == j and last.first + last.count == s:
                parts[r][-1] = Piece(j, last.first, last.count + 1)
            else:
                parts[r].append(Piece(j, s, 1))
            before += w
    return parts


def piece_job(job: SampleJob, piece: Piece) -> SampleJob:
    """The job a rank runs for its piece: those samples (their draws as in the whole job); the prompt's logprobs
    only in the piece holding sample 0, so they are computed once."""
    first = piece.first == 0
    return replace(
        job,
        num_samples=piece.count,
        first_sample=job.first_sample + piece.first,
        prompt_logprobs=job.prompt_logprobs and first,
        topk_prompt_logprobs=job.topk_prompt_logprobs if first else 0,
    )


def agree(group: RankGroup, error: BaseException | None) -> BaseException | None:
    """Every rank's `error` (None: it went well) exchanged on the control group: the lowest rank's error, the same on
    every rank, or None when every rank is well."""
    errors: list[Any] = [None] * group.world_size
    dist.all_gather_object(errors, picklable(error), group=group.control)
    return next((e for e in errors if e is not None), None)


def picklable(error: BaseException | None) -> BaseException | None:
    """The error itself when it pickles (loraplex's errors do), else an EngineError with its text: an exchange that
    fails to pickle on one rank would leave the others waiting."""
    if error is None:
        return None
    try:
        pickle.dumps(error)
        return error
    except Exception:  # noqa: BLE001 - any pickling failure
        return EngineError(f"{type(error).__name__}: {error}")


class RankSampler:
    """The SAMPLE step's sampler on one rank of a pool: `check` and `engine` as a Sampler's (the training engine: the
    adapter store's swaps and checkpoint loads go to it), `start` a run of this rank's share of the jobs."""

    def __init__(self, sampler: Sampler, group: RankGroup) -> None:
        self.sampler = sampler  # over a whole copy of the base model (or the engine itself, unsharded)
        decoding: Any = sampler.engine
        self.engine: Engine = decoding.training if isinstance(decoding, ReplicaEngine) else sampler.engine
        self.group = group

    def check(self, job: SampleJob) -> None:
        self.sampler.check(job)

    def start(self, jobs: Sequence[SampleJob]) -> SplitRun:
        for job in jobs:  # every rank checks every job (the same state): a bad job fails the start on all alike
            self.check(job)
        return SplitRun(self, list(jobs))


class SplitRun:
    """A run whose samples are split across the ranks; the interface of SampleRun. `outputs` (on the leader) holds one
    output per job once `advance` returned True; a follower's holds only its own pieces' samples."""

    def __init__(self, owner: RankSampler, jobs: list[SampleJob]) -> None:
        self.group = owner.group
        self.jobs = jobs
        self.mine = assign_rows(jobs, self.group.world_size)[self.group.rank]
        self.outputs = [SampleOutput(sequences=[]) for _ in jobs]
        # Every job's adapters, whatever this rank decodes: the store's swaps before each slice are the same on every
        # rank. On the unfused path a prefill reads the slot banks (SampleRun.needs_slots).
        self._model_ids = {j.model_id for j in jobs if j.model_id is not None}
        self._needs_slots = bool(self._model_ids) and not owner.sampler.engine.fused_lora
        self.local: SampleRun | None = None
        self.error: BaseException | None = None
        self.finished = False
        try:
            self.local = owner.sampler.start([piece_job(jobs[p.job], p) for p in self.mine])
        except Exception as exc:  # noqa: BLE001 - reported to every rank by the next advance
            self.error = exc

    @property
    def done(self) -> bool:
        return self.finished

    @property
    def model_ids(self) -> set[str]:
        return set() if self.finished else set(self._model_ids)

    @property
    def needs_slots(self) -> bool:
        return not self.finished and self._needs_slots

    def advance(self, budget_s: float | None, yield_now: Callable[[], bool] | None = None) -> bool:
        """This rank's share for about `budget_s` seconds (None: to its end), then one exchange with the other ranks;
        True once every rank's share is done (the leader then holds every output). Raises on every rank if any rank's
        share failed. `yield_now` is ignored (see the module docstring)."""
        if self.finished:
            return True
        local = self.local
        if self.error is None and local is not None and not local.done:
            try:
                local.advance(budget_s)
            except Exception as exc:  # noqa: BLE001 - every rank learns of it below
                self.error = exc
        done = self.error is None and (local is None or local.done)
        statuses: list[Any] = [None] * self.group.world_size
        dist.all_gather_object(statuses, (done, picklable(self.error)), group=self.group.control)
        failed = next((e for _, e in statuses if e is not None), None)
        if failed is not None:
            self.close()
            raise failed if isinstance(failed, Exception) else EngineError(f"a rank's sample run failed: {failed}")
        if not all(d for d, _ in statuses):
            return False
        self._gather()
        self.finished = True
        return True

    def _gather(self) -> None:
        """Every rank's outputs to the leader (one gather on the control group), merged per job in sample order."""
        assert self.local is not None
        shares: list[Any] = [None] * self.group.world_size if self.group.is_leader else []
        mine = (self.mine, self.local.outputs)
        dist.gather_object(mine, shares if self.group.is_leader else None, dst=0, group=self.group.control)
        for pieces, outputs in shares if self.group.is_leader else [mine]:
            for piece, out in zip(pieces, outputs, strict=True):
                whole = self.outputs[piece.job]
                whole.sequences.extend(out.sequences)  # ranks in order, each one's pieces in order: sample order
                if piece.first == 0:
                    whole.prompt_logprobs = out.prompt_logprobs
                    whole.topk_prompt_logprobs = out.topk_prompt_logprobs

    def close(self) -> None:
        """Abandon this rank's share (its decode cache goes back); no collective."""
        if self.local is not None:
            self.local.close()
