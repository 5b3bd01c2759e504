"""Coalescing dispatcher: pure policy (pending requests -> batch plan) and the thin I/O loop around it."""
