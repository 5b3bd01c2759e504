"""The pool process: its composition root (process.py: engine, adapter store, executor, dispatcher, recorder,
metrics), one leader per pool (leadership.py), durable adapter state (durable/), and its ready file (ready.py)."""
