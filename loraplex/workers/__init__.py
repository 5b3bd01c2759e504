"""Worker side: the training engine and what it runs on. Imports only torch, transformers, safetensors, tokenizers,
numpy, the stdlib, loraplex.errors and loraplex.dispatch.plan, so it runs on a GPU machine without the service stack."""
