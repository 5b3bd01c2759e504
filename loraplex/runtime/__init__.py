"""Process plumbing with no domain: supervision of child processes, the redis-server child, stop signals, atomic
files, rate-limited logging and backoff, free ports, the garbage-collector freeze, a /metrics HTTP server, and the
background file writer. Imports nothing of the service's own packages (tests/unit/test_layers.py)."""
