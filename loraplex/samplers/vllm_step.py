"""A SAMPLE step served by a vLLM server instead of the training engine (`LORAPLEX_SAMPLER=vllm`): each request's
sampler copy is its checkpoint folder, exported once as a PEFT folder and loaded into the server at run time
(samplers/vllm.py: LRU beyond its max_loras); the bare base model goes through the zero adapter. Requests of a step
run concurrently (the server batches them). No torch here: the PEFT export is the caller's callable (the pool process
passes service/peft_export.export_checkpoint).

Not offered by this backend (each a NotSupportedError for that request): top-k logprobs, and `stop=[]` (sampling
through EOS)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from loraplex.errors import NotFoundError, NotSupportedError
from loraplex.protocol import Outcome, PlannedRequest, SamplePayload, Step
from loraplex.protocol.results import SampledSequence, SampleResult
from loraplex.samplers.vllm import VllmSampler


def adapter_name(copy_id: str) -> str:
    """The server-side name of a sampler copy (its tinker path hashed: vLLM names are plain strings)."""
    return "copy-" + hashlib.sha256(copy_id.encode()).hexdigest()[:24]


class VllmSampleStep:
    def __init__(
        self, sampler: VllmSampler, export: Callable[[Path, Path], Path], workdir: Path, max_concurrent: int = 16
    ) -> None:
        """export(checkpoint_dir, out_dir) -> the PEFT folder of a sampler checkpoint."""
        self.sampler = sampler
        self.export = export
        self.workdir = Path(workdir)
        self.max_concurrent = max_concurrent

    def __call__(self, step: Step) -> list[Outcome]:
        with ThreadPoolExecutor(max_workers=min(self.max_concurrent, max(1, len(step.requests)))) as pool:
            return list(pool.map(self._one, step.requests))

    def _one(self, request: PlannedRequest) -> Outcome:
        try:
            return Outcome(request.request_id, result=self._sample(request))
        except Exception as exc:  # noqa: BLE001 - this request alone
            return Outcome.failed(request.request_id, exc)

    def _sample(self, request: PlannedRequest) -> SampleResult:
        p = request.payload
        assert isinstance(p, SamplePayload)
        if p.topk_prompt_logprobs or p.topk_sample_logprobs:
            raise NotSupportedError("top-k logprobs are not offered by this pool's vLLM sampler")
        if not p.stop_at_eos:
            raise NotSupportedError("stop=[] (sampling through EOS) is not offered by this pool's vLLM sampler")
        adapter = self._adapter(p.sampler_copy, p.sampler_copy_dir) if p.sampler_copy is not None else None
        greedy = p.temperature == 0  # vLLM refuses n > 1 when greedy: one draw stands for all (it is deterministic)
        out = self.sampler.sample(
            list(p.prompt),
            adapter=adapter,
            max_tokens=p.max_tokens,
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            seed=p.seed,
            stop=[*p.stop_strings, *p.stop_token_ids],
            logprobs=True,
            prompt_logprobs=p.prompt_logprobs,
            n=1 if greedy else p.num_samples,
        )
        sequences = out.sequences * p.num_samples if greedy else out.sequences
        return SampleResult(
            sequences=tuple(SampledSequence(s.tokens, s.logprobs, s.stop_reason) for s in sequences),
            prompt_logprobs=out.prompt_logprobs,
        )

    def _adapter(self, copy_id: str, directory: str | None) -> str:
        name = adapter_name(copy_id)
        if name not in self.sampler.known_adapters:
            if not directory:
                raise NotFoundError(f"sampler weights {copy_id} name no checkpoint folder")
            folder = self.export(Path(directory), self.workdir / name)
            self.sampler.load_adapter(name, folder)
        return name
