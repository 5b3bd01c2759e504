"""The embedded stack with fewer slots than adapters: three tenants train one adapter each, concurrently, on a pool of
two slots; the adapter store swaps them through disk (host budget 0) and the `residency` table shows where each is."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from loraplex.client import AdamParams, Datum, ServiceClient
from loraplex.launch.embedded import Stack
from loraplex.runtime.netutil import free_port
from loraplex.settings import Settings
from loraplex.storage.db import make_db_engine, session_factory
from loraplex.storage.repositories import ResidencyRepository, TenantRepository, unit_of_work


def _data(offset: int) -> list[Datum]:
    return [Datum.for_next_token([(offset * 13 + 7 * i + j) % 200 + 10 for j in range(10)]) for i in range(2)]


def _train(client: ServiceClient, offset: int, steps: int, out: dict) -> None:
    trainer = client.create_lora_training_client(rank=4, seed=offset)
    losses = []
    for _ in range(steps):
        fb = trainer.forward_backward(_data(offset))
        opt = trainer.optim_step(AdamParams(learning_rate=2e-2))
        losses.append(fb.result()["metrics"]["loss:sum"])
        opt.result()
    out[offset] = (trainer, losses)


Rows = dict[str, tuple[str, int | None, str | None]]  # model_id -> (tier, slot, location) of rank 0


def _tiers(stack: Stack, recorded: Callable[[Rows], bool], timeout_s: float = 30.0) -> Rows:
    """The `residency` rows of rank 0, once they show the state `recorded` describes (or after `timeout_s`, as they
    are then: the assertions say what is missing). The wait is on the recorded state itself: a condition that the
    rows before a swap also meet (e.g. "3 rows, 2 on the GPU") returns the old rows before the swap is recorded."""
    sessions = session_factory(make_db_engine(stack.settings.resolved_database_url))
    deadline = time.monotonic() + timeout_s
    while True:
        with sessions() as s:
            rows = {
                r.model_id: (str(r.tier), r.slot, r.location) for r in ResidencyRepository(s).list(stack.settings.pool)
            }
        if recorded(rows) or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


def _two_resident_one_spilled(rows: Rows) -> bool:
    """Three adapters: two in slots, one on disk with its spill file recorded."""
    return sorted(t for t, _, _ in rows.values()) == ["disk", "gpu", "gpu"] and all(
        loc is not None for t, _, loc in rows.values() if t == "disk"
    )


def test_three_tenants_share_two_slots_through_the_adapter_store(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, slots=2, max_rank=8, host_budget_mb=0)
    with Stack(settings, api_port=free_port()) as stack:
        with unit_of_work(session_factory(make_db_engine(stack.settings.resolved_database_url))) as session:
            repo = TenantRepository(session)
            keys = [repo.create_tenant(f"tenant-{i}")[1] for i in range(3)]
        clients = [ServiceClient(stack.base_url, key) for key in keys]
        results: dict = {}
        threads = [threading.Thread(target=_train, args=(c, i + 1, 8, results)) for i, c in enumerate(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == [1, 2, 3]
        for _trainer, losses in results.values():
            assert losses[-1] < 0.5 * losses[0]  # each learned its own data despite the swaps

        rows = _tiers(stack, _two_resident_one_spilled)
        assert sorted(t for t, _, _ in rows.values()) == ["disk", "gpu", "gpu"]
        assert sorted(slot for t, slot, _ in rows.values() if t == "gpu") == [0, 1]
        (out_id,) = [m for m, (t, _, _) in rows.items() if t == "disk"]
        location = Path(rows[out_id][2])
        assert location.exists() and location.is_relative_to(tmp_path / "spill" / settings.pool / "rank0")

        # The adapter on disk comes back for its next step and continues from where it was.
        trainer, losses = next(v for v in results.values() if v[0].model_id == out_id)
        offset = next(k for k, v in results.items() if v[0].model_id == out_id)
        again = trainer.forward_backward(_data(offset)).result()["metrics"]["loss:sum"]
        assert again < 0.5 * losses[0]  # its trained state, not a fresh one
        # Wait for the swap-in itself: the rows before it (out_id on disk) also show two adapters on the GPU.
        rows = _tiers(stack, lambda r: _two_resident_one_spilled(r) and r.get(out_id, ("",))[0] == "gpu")
        assert rows[out_id][0] == "gpu" and not location.exists()
        assert sorted(t for t, _, _ in rows.values()) == ["disk", "gpu", "gpu"]
