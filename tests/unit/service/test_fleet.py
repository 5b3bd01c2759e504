"""Which base models a deployment serves (service/fleet.py), from the registry's live pools and the gateway's own
pool: pure, no services."""

from __future__ import annotations

import pytest

from loraplex.errors import InvalidRequestError
from loraplex.queue.pool_registry import PoolRegistration
from loraplex.service.fleet import fleet_of

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


def pool(name: str, base_model: str, **fields) -> PoolRegistration:
    return PoolRegistration(name=name, base_model=base_model, slots=4, max_rank=16, target_modules=MODULES, **fields)


HOME = pool("default", "tiny", state="unregistered", published_at=0.0)


def test_every_base_model_of_a_live_pool_is_served_with_its_pools_by_name() -> None:
    fleet = fleet_of([pool("b", "tiny"), pool("moe", "tiny-moe"), pool("a", "tiny")], HOME)
    assert fleet.names == ["tiny", "tiny-moe"]
    assert fleet.model("tiny").pool_names == ("a", "b")  # the home pool is left out: live pools serve its model
    assert fleet.model("tiny-moe").pool_names == ("moe",)


def test_the_gateways_own_pool_stands_in_for_its_model_while_no_live_pool_serves_it() -> None:
    assert fleet_of([], HOME).model("tiny").pool_names == ("default",)
    fleet = fleet_of([pool("moe", "tiny-moe")], HOME)
    assert fleet.names == ["tiny", "tiny-moe"] and fleet.model("tiny").pool_names == ("default",)


def test_a_registration_outranks_the_gateways_settings_for_its_own_pool_name() -> None:
    fleet = fleet_of([pool("default", "tiny-moe")], HOME)
    assert fleet.names == ["tiny-moe"]  # the pool named default serves tiny-moe now; nothing serves tiny


def test_a_model_nobody_serves_is_a_400_naming_the_served_ones() -> None:
    fleet = fleet_of([pool("moe", "tiny-moe")], HOME)
    with pytest.raises(InvalidRequestError, match=r"'Qwen/Qwen3-8B' is not served here; served: 'tiny', 'tiny-moe'"):
        fleet.model("Qwen/Qwen3-8B")


def test_a_models_rank_and_modules_are_what_every_one_of_its_pools_takes() -> None:
    wide = PoolRegistration(name="a", base_model="tiny", max_rank=32, target_modules=(*MODULES, "gate_proj"))
    narrow = PoolRegistration(name="b", base_model="tiny", max_rank=8, target_modules=("v_proj", "q_proj"))
    model = fleet_of([wide, narrow], HOME).model("tiny")
    assert model.max_rank == 8
    assert model.target_modules == ("q_proj", "v_proj")  # in the first pool's order


def test_a_model_samples_when_any_of_its_live_pools_does_and_the_stand_in_is_marked() -> None:
    fleet = fleet_of([pool("a", "tiny", sampleable=False), pool("b", "tiny"), pool("c", "x", sampleable=False)], HOME)
    assert fleet.model("tiny").sampleable_live and not fleet.model("x").sampleable_live
    assert not fleet.model("tiny").stand_in
    alone = fleet_of([], HOME).model("tiny")
    assert alone.stand_in and not alone.sampleable_live  # the gateway decides from its settings (service/sampling.py)


def test_a_registration_round_trips_and_an_unreadable_one_is_none() -> None:
    registration = pool("a", "tiny", free_memory_bytes=2**30, queued_tokens=7, state="ready")
    assert PoolRegistration.decode(registration.encode()) == registration
    assert PoolRegistration.decode(b"not json") is None
    assert PoolRegistration.decode(b'{"base_model": "tiny"}') is None  # no name
    newer = registration.encode().replace(b'{"name"', b'{"from_a_newer_build": 1, "name"')
    assert PoolRegistration.decode(newer) == registration
