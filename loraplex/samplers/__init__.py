"""Sampling backends outside the training pool. `vllm`: a supervised vLLM OpenAI server with adapters loaded at run
time (no torch in this package; the native sampler lives in the workers)."""

from loraplex.samplers.vllm import SampledSequence, SampleOutput, VllmSampler, VllmServer

__all__ = ["SampleOutput", "SampledSequence", "VllmSampler", "VllmServer"]
