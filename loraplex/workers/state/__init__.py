"""Adapter state off the slots: the tiered adapter store (adapter_store.py: slots, pinned host, disk; slot_rows.py,
spill_format.py; a slot's state in host memory is a slot image, slot_images.py; sampler copies are adapters of the
store, adapter_store.freeze_copy), checkpoints (checkpoint.py, checkpoint_state.py), and durable snapshot files
(durable_snapshot.py). The PEFT export reads checkpoints without torch: service/peft_export.py."""
