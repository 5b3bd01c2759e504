"""Sampling from a sampler: one of your sampler checkpoints (a `save_weights_for_sampler` path) or the base model.
Each call takes the sampler's next seq_id, so a retried call is answered once (the sampler and its seq_id are the
key); calls run in any order on the server."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from loraplex.client.futures import APIFuture
from loraplex.client.transport import Transport


class SamplingClient:
    def __init__(self, transport: Transport, sampler_id: str, model_path: str | None) -> None:
        self._transport = transport
        self.sampler_id = sampler_id
        self.model_path = model_path
        self._next_seq = 0
        self._lock = threading.Lock()

    def _body(
        self,
        prompt: Sequence[int],
        num_samples: int,
        max_tokens: int,
        temperature: float,
        top_k: int,
        top_p: float,
        seed: int | None,
        stop: str | Sequence[str] | Sequence[int] | None,
        prompt_logprobs: bool,
        topk_prompt_logprobs: int,
        topk_sample_logprobs: int,
    ) -> dict[str, Any]:
        with self._lock:
            seq, self._next_seq = self._next_seq, self._next_seq + 1
        return {
            "seq_id": seq,
            "prompt": list(prompt),
            "num_samples": num_samples,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "seed": seed,
            "stop": stop if stop is None or isinstance(stop, str) else list(stop),
            "prompt_logprobs": prompt_logprobs,
            "topk_prompt_logprobs": topk_prompt_logprobs,
            "topk_sample_logprobs": topk_sample_logprobs,
        }

    def sample(
        self,
        prompt: Sequence[int],
        num_samples: int = 1,
        max_tokens: int = 16,
        temperature: float = 1.0,
        top_k: int = -1,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: str | Sequence[str] | Sequence[int] | None = None,
        prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
    ) -> APIFuture:
        """`num_samples` continuations of `prompt` (token ids). The result: {sequences: [{tokens, logprobs,
        stop_reason ("stop" | "length"), topk_logprobs?}], prompt_logprobs?, topk_prompt_logprobs?}. `stop`: strings or
        token ids (None: at EOS only; []: not even there)."""
        body = self._body(prompt, num_samples, max_tokens, temperature, top_k, top_p, seed, stop, prompt_logprobs,
                          topk_prompt_logprobs, topk_sample_logprobs)  # fmt: skip
        ref = self._transport.request("POST", f"/v1/samplers/{self.sampler_id}/sample", json=body)
        return APIFuture(self._transport, ref["request_id"], ref["model_id"])

    async def sample_async(self, prompt: Sequence[int], **kwargs: Any) -> APIFuture:
        defaults = {"num_samples": 1, "max_tokens": 16, "temperature": 1.0, "top_k": -1, "top_p": 1.0, "seed": None,
                    "stop": None, "prompt_logprobs": False, "topk_prompt_logprobs": 0, "topk_sample_logprobs": 0}  # fmt: skip
        body = self._body(prompt, **{**defaults, **kwargs})
        ref = await self._transport.request_async("POST", f"/v1/samplers/{self.sampler_id}/sample", json=body)
        return APIFuture(self._transport, ref["request_id"], ref["model_id"])

    def compute_logprobs(self, prompt: Sequence[int]) -> APIFuture:
        """The logprob of each prompt token given the ones before it (the first: None): the result's
        `prompt_logprobs` (one sample of one token is drawn along, as Tinker does)."""
        return self.sample(prompt, max_tokens=1, temperature=0.0, prompt_logprobs=True)

    async def compute_logprobs_async(self, prompt: Sequence[int]) -> APIFuture:
        return await self.sample_async(prompt, max_tokens=1, temperature=0.0, prompt_logprobs=True)
