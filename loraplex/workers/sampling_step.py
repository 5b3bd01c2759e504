"""A SAMPLE step on the pool: each request's frozen sampler snapshot (or the bare base model) made resident, then
one batched generation (workers/sampler.py) over all of them, rows of different snapshots mixed.

A snapshot is the copy a named save_weights_for_sampler left in the adapter store (adapter_store.freeze_copy), named
by its tinker path. A pool that does not hold it (it restarted since, or another pool saved it) loads it from the
checkpoint's folder the payload names, into the store, once. A request that cannot run (a snapshot missing everywhere,
a bad token id) fails alone; more snapshots than slots run in consecutive groups of at most `slots`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loraplex.errors import NotFoundError
from loraplex.protocol import Outcome, PlannedRequest, SamplePayload, Step
from loraplex.workers.adapter_store import AdapterStore
from loraplex.workers.executor import error_outcome, restore_checkpoint
from loraplex.workers.sampler import SampleJob, SampleOutput, SampleParams, Sampler


class SampleStep:
    def __init__(self, sampler: Sampler, store: AdapterStore | None) -> None:
        self.sampler = sampler
        self.store = store

    def __call__(self, step: Step) -> list[Outcome]:
        outcomes: dict[str, Outcome] = {}
        ready: list[tuple[PlannedRequest, SampleJob]] = []
        for request in step.requests:
            try:
                ready.append((request, self._job(request)))
            except Exception as exc:  # noqa: BLE001 - this request alone
                outcomes[request.request_id] = error_outcome(request, exc)
        for group in self._groups(ready):
            try:
                if self.store is not None:
                    self.store.ensure_resident({j.model_id for _, j in group if j.model_id is not None})
            except Exception as exc:  # noqa: BLE001 - a failed swap fails this group only
                outcomes.update((r.request_id, error_outcome(r, exc)) for r, _ in group)
                continue
            valid = []
            for request, job in group:
                try:
                    self.sampler.check(job)  # against the resident snapshot: its rank, the vocabulary
                    valid.append((request, job))
                except Exception as exc:  # noqa: BLE001 - this request alone
                    outcomes[request.request_id] = error_outcome(request, exc)
            if not valid:
                continue
            try:
                results = self.sampler.generate([job for _, job in valid])
            except Exception as exc:  # noqa: BLE001 - the batch failed: each of its requests gets the error
                outcomes.update((r.request_id, error_outcome(r, exc)) for r, _ in valid)
                continue
            for (request, _), output in zip(valid, results, strict=True):
                outcomes[request.request_id] = Outcome(request.request_id, result=sample_result(output))
        return [outcomes[r.request_id] for r in step.requests]

    def _job(self, request: PlannedRequest) -> SampleJob:
        p = request.payload
        assert isinstance(p, SamplePayload)
        if p.snapshot is not None:
            self._have(p.snapshot, p.snapshot_dir)
        job = SampleJob(
            prompt=p.prompt,
            model_id=p.snapshot,
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

    def _have(self, snapshot: str, directory: str | None) -> None:
        """The snapshot in the store: as saved (freeze_copy), or loaded from its checkpoint folder now."""
        if self.store is None:
            self.sampler.engine.adapter(snapshot)  # NotFoundError unless resident
            return
        if snapshot in self.store:
            return
        if not directory:
            raise NotFoundError(f"sampler weights {snapshot} are not on this pool and name no checkpoint folder")
        restore_checkpoint(self.sampler.engine, self.store, snapshot, Path(directory), with_optimizer=False)

    def _groups(self, ready: list[tuple[PlannedRequest, SampleJob]]) -> list[list[tuple[PlannedRequest, SampleJob]]]:
        """Consecutive groups holding at most `slots` distinct snapshots each (the base model takes none)."""
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


def sample_result(output: SampleOutput) -> dict[str, Any]:
    """A SampleOutput as the stored result (JSON): sequences, and the prompt's logprobs when asked."""
    return {
        "sequences": [
            {
                "tokens": seq.tokens,
                "logprobs": seq.logprobs,
                "stop_reason": seq.stop_reason,
                "topk_logprobs": [[list(pair) for pair in row] for row in seq.topk_logprobs]
                if seq.topk_logprobs is not None
                else None,
            }
            for seq in output.sequences
        ],
        "prompt_logprobs": output.prompt_logprobs,
        "topk_prompt_logprobs": [None if row is None else [list(pair) for pair in row] for row in output.topk_prompt_logprobs]
        if output.topk_prompt_logprobs is not None
        else None,
    }
