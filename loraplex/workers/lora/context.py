"""The state every wrapped layer of one model shares: the current microbatch's routing and, on the fused path, its
banks (set by the engine around each microbatch's forward and backward)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from loraplex.workers.lora.fused import MicrobatchBanks
from loraplex.workers.lora.routing import Routing


class LoraContext:
    """Shared by every wrapped layer of one model: the current microbatch's routing (None = base model only) and, on
    the fused path, its banks gathered and cast once (None = each layer runs its own op on the master banks)."""

    def __init__(self) -> None:
        self.routing: Routing | None = None
        self.banks: MicrobatchBanks | None = None
        # Sibling layers (q/k/v, gate/up) run as one node on the fused path (lora/siblings.py); False: each alone.
        self.shared_inputs = True

    @contextmanager
    def use(self, routing: Routing | None, banks: MicrobatchBanks | None = None) -> Iterator[None]:
        previous = self.routing, self.banks
        self.routing, self.banks = routing, banks
        try:
            yield
        finally:
            self.routing, self.banks = previous
