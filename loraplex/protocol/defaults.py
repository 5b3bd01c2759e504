"""Defaults of the wire protocol that the client, the gateway's request schemas and the workers must agree on. Plain
values with no imports of loraplex, so the client reads them without importing any server code."""

from __future__ import annotations

# Tinker's AdamParams defaults: declared with their bounds in protocol/adam.py.
from loraplex.protocol.adam import ADAM_DEFAULTS as ADAM_DEFAULTS
