"""FSDP2 across 2 ranks on CPU (gloo), through the real rank loop: rank 0 broadcasts each plan and executes it, rank 1
follows. One spawn of two processes serves every test here (importing torch + transformers costs seconds per process);
the world-size-1 reference runs in the test process on the same plans.

Compared with world size 1: per-datum logprobs and loss:sum of every request, every optimizer result, and the adapters'
weights after 5 mixed steps (3 adapters of ranks 2, 4, 8; uneven datums; an odd number of sequences; a forward-only
request; several microbatches per rank, so one rank runs dummy microbatches). Also: the banks (and Adam state) are
bit-identical on both ranks, base weights are sharded DTensors while the banks are plain Parameters, a plan with fewer
sequences than ranks works, and a bad request fails alone with the ranks still in step for the next plan.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from loraplex.protocol import BatchPlan
from loraplex.workers.ranks.rank_loop import EngineSpec
from tests.helpers.distributed import (
    ENGINE_CONFIG,
    TinyLoader,
    assert_same_run,
    make_plans,
    run_one_process,
    run_ranks,
)

pytestmark = [pytest.mark.timeout(180)]

WORLD = 2


@pytest.fixture(scope="module")
def plans() -> list[BatchPlan]:
    return make_plans()


@pytest.fixture(scope="module")
def two_ranks(tiny_dir: Path, plans: list[BatchPlan], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    spec = EngineSpec(TinyLoader(str(tiny_dir)), "cpu", ENGINE_CONFIG)
    return run_ranks(WORLD, "cpu", spec, plans, tmp_path_factory.mktemp("ranks"))


@pytest.fixture(scope="module")
def one_rank(tiny_dir: Path, plans: list[BatchPlan]) -> dict[str, Any]:
    return run_one_process(EngineSpec(TinyLoader(str(tiny_dir)), "cpu", ENGINE_CONFIG), plans)


def test_two_ranks_match_one_rank_outputs_and_weights(
    two_ranks: list[dict[str, Any]], one_rank: dict[str, Any]
) -> None:
    assert two_ranks[1]["followed"] == len(one_rank["outcomes"])
    assert_same_run(two_ranks[0], one_rank)


def test_banks_and_adam_state_are_bit_identical_across_ranks(two_ranks: list[dict[str, Any]]) -> None:
    r0, r1 = (r["state"] for r in two_ranks)
    for name, (a0, b0) in r0["banks"].items():
        a1, b1 = r1["banks"][name]
        assert torch.equal(a0, a1) and torch.equal(b0, b1), name
    assert all(torch.equal(x, y) for x, y in zip(r0["adam"], r1["adam"], strict=True))
    assert r0["steps"] == r1["steps"]


def test_base_weights_are_sharded_and_banks_are_plain_replicated(two_ranks: list[dict[str, Any]]) -> None:
    for report in two_ranks:
        base, lora = report["state"]["base"], report["state"]["lora"]
        assert base and all(sharded for sharded, _, _ in base.values()), [n for n, v in base.items() if not v[0]]
        for name, (_, full, local) in base.items():
            assert local is not None and local[0] <= -(-full[0] // WORLD), name
        assert any("embed_tokens" in n for n in base) and any("lm_head" in n for n in base)
        assert len(lora) == 2 * 7 * 2  # A and B of 7 projections x 2 layers
        assert all(kind == "Parameter" and not sharded for kind, sharded, _ in lora.values())
        assert all(shape[0] == ENGINE_CONFIG.num_slots for _, _, shape in lora.values())  # every slot, whole


def test_fewer_sequences_than_ranks_and_forward_only_plans(two_ranks: list[dict[str, Any]]) -> None:
    by_id = {o.request_id: o for plan in two_ranks[0]["outcomes"] for o in plan}
    assert by_id["d-a"].ok and by_id["d-oa"].ok and by_id["d-fwd"].ok
    assert len(by_id["d-a"].result.to_wire()["loss_fn_outputs"][0]["logprobs"]) == 11  # type: ignore[union-attr]


def test_bad_request_fails_alone_and_ranks_stay_in_step(two_ranks: list[dict[str, Any]]) -> None:
    by_id = {o.request_id: o for plan in two_ranks[0]["outcomes"] for o in plan}
    assert by_id["e-bad"].error_name == "InvalidRequestError" and "out of range" in (by_id["e-bad"].error or "")
    assert all(by_id[r].ok for r in ("e-a", "e-c", "e-oa", "e-oc", "f-b", "f-ob"))
