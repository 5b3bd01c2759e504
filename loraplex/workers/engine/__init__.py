"""The training engine (engine.py) and what one step is made of: the trunk's packed forward (trunk.py, batching.py),
the losses and the chunked LM head (losses.py, lm_head.py), batched AdamW over slots (optimizer.py), CUDA graphs of the
decoder body (body_graphs.py), activation recomputation (recompute.py), pinned host staging
(pinned_staging.py), the allocator's counts (allocator_events.py), and the plan executor mapping steps onto the engine
(executor.py)."""
