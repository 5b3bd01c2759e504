"""Worker side: the training engine and what it runs on. Imports only torch, transformers, safetensors, tokenizers,
numpy, the stdlib and the bottom layers (loraplex.protocol, loraplex.errors, loraplex.runtime.fsutil, loraplex.protocol.checkpoint_paths), so it runs on a GPU machine without the service stack."""
