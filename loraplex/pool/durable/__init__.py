"""Durable adapter state (DESIGN, Durability), joined in the pool process: snapshots at a cadence (snapshotter.py,
a writer thread), and the restart path that adopts them and replays the request log (recovery.py). Composition-root
code: it joins workers/ (the state and its file format), storage/ (the snapshot rows) and queue/ (the request log)."""
