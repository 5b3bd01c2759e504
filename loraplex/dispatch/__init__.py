"""Coalescing dispatcher: the pure policy (pending requests + pool state -> BatchPlan: policy.py, cost_model.py,
fair_share.py, coalescing.py, step_split.py), and the loop over the queue around it (loop.py, with its read-ahead and
finisher threads in stages.py), built from its knobs and the hooks a pool plugs in (hooks.py). No SQL, storage or pool
imports: what a plan's end writes to SQL, and the lookups the loop is given, are pool/'s."""
