"""Adapter state off the slots: the tiered adapter store (adapter_store.py: slots, pinned host, disk; slot_rows.py,
spill_format.py), checkpoints (checkpoint.py, checkpoint_state.py), frozen sampler copies (snapshots.py), and durable
snapshot files (durable_snapshot.py). The PEFT export reads checkpoints without torch: service/peft_export.py."""
