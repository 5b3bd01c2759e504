"""The worker side, torch only, by job: engine/ (the multi-LoRA training engine: trunk, batching, losses, optimizer,
CUDA graphs, the plan executor), kernels/ (Triton and packed-attention fast paths, each with its plain-torch
reference), lora/ (slot banks and the grouped LoRA ops), state/ (the adapter store's tiers, checkpoints, durable
snapshot files), sampling/ (the native sampler), ranks/ (process groups and the follower ranks' loop). Imports only
torch, transformers, safetensors, tokenizers, numpy, the stdlib, loraplex.protocol, loraplex.errors and
loraplex.runtime, so it runs on a GPU machine without the service stack (tests/unit/test_layers.py)."""
