"""The recovery tests' shared pieces (tests/e2e/test_recovery.py): a deterministic training workload per tenant, run
through the service by a client thread, and the same workload run by a local Engine without any fault (the
uninterrupted reference); reading an adapter's saved state back; waiting for a (re)started pool."""

from __future__ import annotations

import glob
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loraplex.client import Datum, ServiceClient
from loraplex.launch.embedded import Stack
from loraplex.models import load_base_model
from loraplex.settings import Settings
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.state.checkpoint import CheckpointState, read_checkpoint
from loraplex.workers.state.checkpoint_state import state_from_engine
from tests.helpers.datums import datums

# Every AdamW field given, so the gateway fills in nothing the reference would not know.
ADAM = {"learning_rate": 2e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.01, "grad_clip_norm": 1.0}


@dataclass(frozen=True)
class Plan:
    """One tenant's adapter and its steps: forward_backward(batch(k)) then optim_step, k = 0..steps-1."""

    tenant: int
    rank: int
    seed: int
    steps: int
    datums: int = 2  # per forward_backward
    length: int = 0  # tokens per datum (0: 10 + tenant)

    @property
    def alpha(self) -> float:
        return 2.0 * self.rank

    def batch(self, k: int) -> list[dict]:
        out = []
        for i in range(self.datums):
            n = self.length or 10 + self.tenant
            toks = [(k * 31 + i * 7 + j * 3 + self.tenant * 101) % 500 + 1 for j in range(n)]
            out.append({"model_input": toks[:-1], "loss_fn_inputs": {"target_tokens": toks[1:], "weights": [1.0] * (len(toks) - 1)}})
        return out


@dataclass
class Trained:
    model_id: str = ""
    losses: list[float] = field(default_factory=list)  # loss:sum of each forward_backward, in order
    errors: list[BaseException] = field(default_factory=list)
    done: int = 0  # requests answered


def train(client: ServiceClient, plan: Plan, out: Trained, checkpoint: str) -> None:
    """The plan through the service, one request at a time (each waits for its answer); then save_state."""
    try:
        tc = client.create_lora_training_client(rank=plan.rank, alpha=plan.alpha, seed=plan.seed)
        out.model_id = tc.model_id
        for k in range(plan.steps):
            data = [Datum(model_input=d["model_input"], loss_fn_inputs=d["loss_fn_inputs"]) for d in plan.batch(k)]
            out.losses.append(tc.forward_backward(data).result()["metrics"]["loss:sum"])
            out.done += 1
            tc.optim_step(ADAM).result()
            out.done += 1
        tc.save_state(checkpoint).result()
    except BaseException as exc:  # noqa: BLE001 - the test thread reports it
        out.errors.append(exc)


def reference(stack: Stack, plans: list[Plan]) -> tuple[dict[int, CheckpointState], dict[int, list[float]]]:
    """The plans on a local engine built like the pool's (same model, slots, max rank, modules), each request alone,
    no fault: each tenant's final state and its losses."""
    s = stack.settings
    threads = torch.get_num_threads()
    torch.set_num_threads(s.resolved_pool_cpu_threads)  # as the pool's rank: the sums' order follows the threads
    try:
        return _reference(s, plans)
    finally:
        torch.set_num_threads(threads)


def _reference(s: Settings, plans: list[Plan]) -> tuple[dict[int, CheckpointState], dict[int, list[float]]]:
    model, _ = load_base_model(s.base_model, s.resolved_model_cache, dtype=torch.float32)
    config = EngineConfig(num_slots=len(plans), max_rank=s.max_rank, target_modules=tuple(s.target_modules),
                          microbatch_tokens=s.microbatch_tokens)  # fmt: skip
    engine = build_engine(model, config)
    states, losses = {}, {}
    for p in plans:
        m = f"ref-{p.tenant}"
        engine.create_adapter(m, p.rank, p.alpha, p.seed)
        losses[p.tenant] = []
        for k in range(p.steps):
            item = engine.prepare(m, datums(p.batch(k)), "cross_entropy", None, False)
            losses[p.tenant].append(engine.forward_backward([item])[0]["metrics"]["loss:sum"])
            (res,) = engine.optim_step([(m, ADAM)])
            assert not isinstance(res, BaseException), res
        states[p.tenant] = state_from_engine(engine, m, base_model=s.base_model, with_optimizer=True)
    return states, losses


def saved_state(stack: Stack, model_id: str, name: str) -> CheckpointState:
    (folder,) = glob.glob(str(stack.settings.resolved_blob_root / "*" / model_id / "state" / name))
    return read_checkpoint(Path(folder))


def assert_same_state(got: CheckpointState, want: CheckpointState) -> None:
    """Bit for bit: every module's A and B, both Adam moments, and the step count."""
    assert got.step == want.step
    assert got.weights.keys() == want.weights.keys()
    for module, (a, b) in want.weights.items():
        assert torch.equal(got.weights[module][0], a) and torch.equal(got.weights[module][1], b), module
    assert got.optimizer is not None and want.optimizer is not None
    for module, moments in want.optimizer.items():
        assert all(torch.equal(x, y) for x, y in zip(got.optimizer[module], moments, strict=True)), module


def wait_restarted(stack: Stack, old_pid: int, timeout_s: float = 120.0) -> int:
    """Wait until a new pool process (not `old_pid`) is ready; its pid."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        proc = stack.child("pool").proc
        if proc is not None and proc.pid != old_pid:
            stack.wait_pool_ready(max(1.0, deadline - time.monotonic()))
            return proc.pid
        time.sleep(0.05)
    raise TimeoutError(f"no new pool process within {timeout_s} s")


def assert_close_state(got: CheckpointState, want: CheckpointState, rtol: float = 1e-3, atol: float = 1e-4) -> None:
    """Equal up to fp32 rounding (plans that mixed adapters: the CPU matmuls are not batch-invariant, and Adam's
    m / sqrt(v) magnifies a 1e-7 gradient difference to ~3e-6 on small weights), step exact. A request applied twice or
    lost moves weights by a whole Adam step (~the learning rate, 2e-2 here), far outside this."""
    assert got.step == want.step
    for module, (a, b) in want.weights.items():
        torch.testing.assert_close(got.weights[module][0], a, rtol=rtol, atol=atol)
        torch.testing.assert_close(got.weights[module][1], b, rtol=rtol, atol=atol)
