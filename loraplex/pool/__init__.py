"""The pool process: its composition root (process.py: engine, adapter store, executor, the dispatcher and the hooks it
plugs into it, metrics), the end of each plan (finish.py: background writes, one SQL transaction, results, acks; the
records it writes and the SQL lookups the dispatcher is given in records.py), one leader per pool (leadership.py),
durable adapter state (durable/), adapters handed to and from other pools (handoff.py), metrics (metrics.py, metrics_publisher.py) and its ready file (ready.py)."""
