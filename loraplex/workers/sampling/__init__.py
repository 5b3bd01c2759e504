"""The native sampler over the engine's multi-LoRA model: resumable batched generation (sampler.py) on a static KV
cache (static_decoder.py), per-row seeded token choice (choice.py), and the SAMPLE step run in slices between
training plans (step.py)."""
