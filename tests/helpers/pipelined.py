"""Tenants training pipelined through a running embedded stack (tests/e2e): each with a few optimizer steps in
flight at once, so requests sit queued and running on a pool when it hands an adapter over, is killed or moves; and
the check that every request was applied exactly once against the fault-free reference (tests/helpers/recovery.py)."""

from __future__ import annotations

import threading
import time

from loraplex.client import Datum, ServiceClient
from loraplex.launch.embedded import Stack
from loraplex.storage.db import make_db_engine, session_factory
from loraplex.storage.repositories.pools import PoolRepository
from tests.helpers.recovery import ADAM, Plan, Trained, assert_same_state, reference, saved_state
from tests.helpers.stack import tenant_clients

WINDOW = 3  # optimizer steps each tenant has in flight at once (6 requests)


def train_pipelined(client: ServiceClient, plan: Plan, out: Trained, ready: threading.Event) -> None:
    """The plan with WINDOW optimizer steps in flight (each answer read in order); then save_state "final"."""
    try:
        tc = client.create_lora_training_client(rank=plan.rank, alpha=plan.alpha, seed=plan.seed)
        out.model_id = tc.model_id
        ready.set()
        pending: list[tuple[object, bool]] = []

        def collect(keep: int) -> None:
            while len(pending) > keep:
                future, is_fb = pending.pop(0)
                result = future.result()  # type: ignore[attr-defined]
                if is_fb:
                    out.losses.append(result["metrics"]["loss:sum"])
                out.done += 1

        for k in range(plan.steps):
            data = [Datum(model_input=d["model_input"], loss_fn_inputs=d["loss_fn_inputs"]) for d in plan.batch(k)]
            pending.append((tc.forward_backward(data), True))
            pending.append((tc.optim_step(ADAM), False))
            collect(2 * WINDOW)
        collect(0)
        tc.save_state("final").result()
    except BaseException as exc:  # noqa: BLE001 - the test thread reports it
        out.errors.append(exc)
        ready.set()


def wait_done(out: list[Trained], mark: int) -> None:
    """Until every tenant had `mark` requests answered."""
    deadline = time.monotonic() + 300
    while min(o.done for o in out) < mark:
        assert time.monotonic() < deadline and not any(o.errors for o in out), [o.errors for o in out]
        time.sleep(0.01)


def check_applied_once(stack: Stack, plans: list[Plan], out: list[Trained]) -> None:
    """Every request applied exactly once: no future failed, losses and final state bit-identical to the reference,
    the SQL applied seq_id exact."""
    for o in out:
        assert o.errors == [], o.errors
    want_states, want_losses = reference(stack, plans)
    sessions = session_factory(make_db_engine(stack.settings.resolved_database_url))
    for p, o in zip(plans, out, strict=True):
        assert o.losses == want_losses[p.tenant]  # each forward_backward saw exactly the reference's state
        assert_same_state(saved_state(stack, o.model_id, "final"), want_states[p.tenant])
        with sessions() as session:  # create, then 2 per step, then the save: each applied once
            assert PoolRepository(session).applied_seq_id(o.model_id) == 2 * p.steps + 1


def start_trainers(
    stack: Stack, names: list[str], plans: list[Plan]
) -> tuple[list[threading.Thread], list[Trained], dict]:
    """One pipelined trainer thread per tenant, started one after the other (each adapter placed before the next)."""
    clients = tenant_clients(stack, *names)
    out = [Trained() for _ in plans]
    threads = []
    for i, (name, plan) in enumerate(zip(names, plans, strict=True)):
        created = threading.Event()
        threads.append(threading.Thread(target=train_pipelined, args=(clients[name], plan, out[i], created),
                                        daemon=True))  # fmt: skip
        threads[-1].start()
        assert created.wait(120)
    return threads, out, clients


def join_trainers(threads: list[threading.Thread], clients: dict) -> None:
    for t in threads:
        t.join(timeout=600)
    for c in clients.values():
        c.close()
    assert not any(t.is_alive() for t in threads)
