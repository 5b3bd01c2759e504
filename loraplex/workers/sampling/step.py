"""A SAMPLE step on the pool: each request's sampler copy (or the bare base model) made resident, then batched
generation (workers/sampling/sampler.py) over all of them, rows of different copies mixed, run in bounded slices.

A sampler copy is the frozen copy of an adapter's weights a named save_weights_for_sampler left in the adapter store
(adapter_store.freeze_copy), named by its tinker path. A pool that does not hold it (it restarted since, or another
pool saved it) loads it from the checkpoint's folder the payload names, into the store, once. A request that cannot
run (a copy missing everywhere, a bad token id) fails alone; more copies than slots run in consecutive groups of at
most `slots`.

Slices: with `slice_s`, a step starts runs for its new requests (one per group; at most `max_runs` in flight, the rest
wait for a later step, unstarted) and advances every run in flight for about `slice_s` seconds in all, shared
between them. A request whose run is not done yet gets an unfinished Outcome (no result: the dispatcher keeps it
pending, dispatch/loop.py) and goes on in the next step that names it; so one tenant's long generation holds the
pool for one slice per plan, and other tenants' training runs in between. A request id already in flight is never
started again (a redelivered entry). A step's `seconds` (the training its plan ran just before) lowers the slice to
that (sampling takes about half the pool's time while others train), and a slice on an otherwise idle pool ends after
its current decode step once `yield_now()` says requests wait (so an arriving step waits for one decode step, not a
whole slice). Without `slice_s`, every run goes to its
end within the step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loraplex.errors import NotFoundError
from loraplex.protocol import Outcome, PlannedRequest, SamplePayload, Step
from loraplex.protocol.results import SampledSequence, SampleResult
from loraplex.workers.engine.executor import error_outcome, restore_checkpoint
from loraplex.workers.sampling.jobs import SampledSequence as SampledSoFar
from loraplex.workers.sampling.jobs import SampleJob, SampleOutput, SampleParams
from loraplex.workers.sampling.sampler import Sampler, SampleRun
from loraplex.workers.state.adapter_store import AdapterStore


@dataclass
class _InFlight:
    run: SampleRun
    requests: list[PlannedRequest]  # one per job of the run, in job order


class SampleStep:
    def __init__(
        self,
        sampler: Sampler,
        store: AdapterStore | None,
        slice_s: float | None = None,
        max_runs: int = 4,
        yield_now: Callable[[], bool] | None = None,
        written: Callable[[str], None] | None = None,
    ) -> None:
        """slice_s: the seconds of sampling one step runs (None: every run to its end); max_runs: the runs in flight
        at once (each holds its decode cache and gathered weights); yield_now: whether other requests wait for the
        pool (the dispatcher's arrivals event), so a slice on an otherwise idle pool ends after its decode step;
        written: waits for a checkpoint folder's files still being written (runtime/background_writes.py) before a
        copy is loaded from it (a save is answered before its files)."""
        self.written = written
        self.sampler = sampler
        self.store = store
        self.slice_s = slice_s
        self.max_runs = max(1, max_runs)
        self._runs: list[_InFlight] = []  # oldest first
        self._owner: dict[str, _InFlight] = {}  # request_id -> its run in flight
        self._done: dict[str, Outcome] = {}  # outcomes of runs that ended, for requests not in the step they ended in
        self.executions = 0  # requests started (each request id once while in flight)
        self.yield_now = yield_now

    @property
    def in_flight(self) -> set[str]:
        """Request ids whose run has started and not ended."""
        return set(self._owner)

    def __call__(self, step: Step) -> list[Outcome]:
        outcomes: dict[str, Outcome] = {}
        new: list[PlannedRequest] = []
        named = {r.request_id for r in step.requests}
        for request in step.requests:
            if request.request_id in self._done:
                outcomes[request.request_id] = self._done.pop(request.request_id)
            elif request.request_id not in self._owner and request.request_id not in {r.request_id for r in new}:
                new.append(request)
        outcomes.update(self._start(new))
        advancing = [f for f in self._runs if any(r.request_id in named for r in f.requests)]
        budget = None if self.slice_s is None else min(self.slice_s, step.seconds if step.seconds is not None else 1e9)
        budget = None if budget is None else budget / max(1, len(advancing))
        # A slice beside training runs its share whole; one on an otherwise idle pool yields to what arrives.
        yield_now = self.yield_now if step.seconds is None else None
        for flight in advancing:
            self._advance(flight, budget, yield_now)
        for request in step.requests:
            if request.request_id not in outcomes:
                done = self._done.pop(request.request_id, None)
                outcomes[request.request_id] = done or Outcome(request.request_id, unfinished=True)
        return [outcomes[r.request_id] for r in step.requests]

    def progress(self, request_ids: set[str]) -> dict[str, list[SampledSoFar]]:
        """What the runs in flight of these requests have sampled so far, per sample (SampleRun.progress: the rows'
        own lists, read before the next step); requests not in flight are left out, and so are a multi-rank pool's
        runs (a rank holds only its share of the rows until the run ends). Asked only for requests that stream their
        answer (pool/sample_partials.py), so sampling that does not stream pays nothing."""
        out: dict[str, list[SampledSoFar]] = {}
        for flight in self._runs:
            wanted = [i for i, r in enumerate(flight.requests) if r.request_id in request_ids]
            progress = getattr(flight.run, "progress", None)
            if wanted and progress is not None:
                jobs = progress()
                out.update((flight.requests[i].request_id, jobs[i]) for i in wanted)
        return out

    def close(self) -> None:
        """Abandon the runs in flight (their decode caches go back)."""
        for flight in self._runs:
            flight.run.close()
        self._runs.clear()
        self._owner.clear()

    def _start(self, requests: list[PlannedRequest]) -> dict[str, Outcome]:
        """Runs for these new requests, while fewer than `max_runs` are in flight; the failed ones' outcomes."""
        outcomes: dict[str, Outcome] = {}
        ready: list[tuple[PlannedRequest, SampleJob]] = []
        for request in requests:
            try:
                ready.append((request, self._job(request)))
            except Exception as exc:  # noqa: BLE001 - this request alone
                outcomes[request.request_id] = error_outcome(request, exc)
        for group in self._groups(ready):
            if len(self._runs) >= self.max_runs:
                break  # the rest waits for a later step, unstarted
            try:
                if self.store is not None:
                    self.store.ensure_resident({j.model_id for _, j in group if j.model_id is not None})
            except Exception as exc:  # noqa: BLE001 - a failed swap fails this group only
                outcomes.update((r.request_id, error_outcome(r, exc)) for r, _ in group)
                continue
            valid = []
            for request, job in group:
                try:
                    self.sampler.check(job)  # against the resident sampler copy: its rank, the vocabulary
                    valid.append((request, job))
                except Exception as exc:  # noqa: BLE001 - this request alone
                    outcomes[request.request_id] = error_outcome(request, exc)
            if not valid:
                continue
            try:
                run = self.sampler.start([job for _, job in valid])
            except Exception as exc:  # noqa: BLE001 - the batch failed: each of its requests gets the error
                outcomes.update((r.request_id, error_outcome(r, exc)) for r, _ in valid)
                continue
            flight = _InFlight(run, [r for r, _ in valid])
            self._runs.append(flight)
            self._owner.update((r.request_id, flight) for r in flight.requests)
            self.executions += len(flight.requests)
            if self.slice_s is None:  # unsliced: each run to its end now, one decode cache at a time
                self._advance(flight, None, None)
        return outcomes

    def _advance(self, flight: _InFlight, budget_s: float | None, yield_now: Callable[[], bool] | None) -> None:
        """One slice of a run; when it ends (or fails) its requests' outcomes go to `_done`."""
        try:
            if self.store is not None and flight.run.needs_slots:
                self.store.ensure_resident(flight.run.model_ids)
            finished = flight.run.advance(budget_s, yield_now)
        except Exception as exc:  # noqa: BLE001 - the run failed: each of its requests gets the error
            flight.run.close()
            self._end(flight, [error_outcome(r, exc) for r in flight.requests])
            return
        if finished:
            outputs = flight.run.outputs
            pairs = zip(flight.requests, outputs, strict=True)
            self._end(flight, [Outcome(r.request_id, result=sample_result(o)) for r, o in pairs])

    def _end(self, flight: _InFlight, outcomes: list[Outcome]) -> None:
        self._runs.remove(flight)
        for outcome in outcomes:
            self._owner.pop(outcome.request_id, None)
            self._done[outcome.request_id] = outcome

    def _job(self, request: PlannedRequest) -> SampleJob:
        p = request.payload
        assert isinstance(p, SamplePayload)
        if p.sampler_copy is not None:
            self._have(p.sampler_copy, p.sampler_copy_dir)
        job = SampleJob(
            prompt=p.prompt,
            model_id=p.sampler_copy,
            params=SampleParams(
                max_tokens=p.max_tokens,
                temperature=p.temperature,
                top_k=p.top_k,
                top_p=p.top_p,
                seed=p.seed,
                stop_token_ids=p.stop_token_ids,
                stop_strings=p.stop_strings,
                stop_at_eos=p.stop_at_eos,
            ),
            num_samples=p.num_samples,
            prompt_logprobs=p.prompt_logprobs,
            topk_prompt_logprobs=p.topk_prompt_logprobs,
            topk_sample_logprobs=p.topk_sample_logprobs,
        )
        return job

    def _have(self, copy_id: str, directory: str | None) -> None:
        """The sampler copy in the store: as saved (freeze_copy), or loaded from its checkpoint folder now."""
        if self.store is None:
            self.sampler.engine.adapter(copy_id)  # NotFoundError unless resident
            return
        if copy_id in self.store:
            return
        if not directory:
            raise NotFoundError(f"sampler weights {copy_id} are not on this pool and name no checkpoint folder")
        if self.written is not None:
            self.written(directory)
        restore_checkpoint(self.sampler.engine, self.store, copy_id, Path(directory), with_optimizer=False)

    def _groups(self, ready: list[tuple[PlannedRequest, SampleJob]]) -> list[list[tuple[PlannedRequest, SampleJob]]]:
        """Consecutive groups holding at most `slots` distinct sampler copies each (the base model takes none)."""
        slots = self.sampler.engine.num_slots
        groups: list[list[tuple[PlannedRequest, SampleJob]]] = []
        seen: set[str] = set()
        for item in ready:
            model_id = item[1].model_id
            if not groups or (model_id is not None and model_id not in seen and len(seen) >= slots):
                groups.append([])
                seen = set()
            if model_id is not None:
                seen.add(model_id)
            groups[-1].append(item)
        return groups


def sample_result(output: SampleOutput) -> SampleResult:
    """A SampleOutput as the request's result: sequences, and the prompt's logprobs when asked."""
    return SampleResult(
        sequences=tuple(
            SampledSequence(seq.tokens, seq.logprobs, seq.stop_reason, seq.topk_logprobs) for seq in output.sequences
        ),
        prompt_logprobs=output.prompt_logprobs,
        topk_prompt_logprobs=output.topk_prompt_logprobs,
    )
