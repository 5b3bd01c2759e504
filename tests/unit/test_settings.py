"""Settings from the environment, and the stack handing its whole Settings object to its child processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.launch.embedded import Stack
from loraplex.settings import Settings


def test_target_modules_read_as_a_comma_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_TARGET_MODULES", "q_proj, v_proj")
    assert Settings().target_modules == ("q_proj", "v_proj")


def test_children_see_every_setting_of_the_stack(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    given = Settings(
        home=tmp_path, plan_tokens=123, slots=3, host_budget_mb=7.5, target_modules=("q_proj", "v_proj"), world_size=2
    )
    env = Stack(given, api_port=9123).child_env()
    for key, value in env.items():
        if key.startswith("LORAPLEX_"):
            monkeypatch.setenv(key, value)
    seen = Settings()
    assert (seen.plan_tokens, seen.slots, seen.host_budget_mb, seen.world_size) == (123, 3, 7.5, 2)
    assert seen.target_modules == ("q_proj", "v_proj") and seen.api_port == 9123
    assert seen.resolved_database_url == given.resolved_database_url
    assert seen.resolved_blob_root == given.resolved_blob_root and seen.spill_dir == tmp_path / "spill"


def test_a_stack_of_several_base_models_runs_one_named_pool_each_and_one_pool_by_default(tmp_path: Path) -> None:
    one = Stack(Settings(home=tmp_path, base_model="tiny"))
    assert one.pools == {"pool": {"LORAPLEX_POOL": "default", "LORAPLEX_BASE_MODEL": "tiny"}}
    fleet = Stack(Settings(home=tmp_path, pool_metrics_port=9300), pool_models=["tiny-moe", "tiny", "tiny-moe"])
    assert fleet.settings.base_model == "tiny-moe"  # the first pool's: the gateway's own
    assert fleet.pools == {
        "pool": {"LORAPLEX_POOL": "default", "LORAPLEX_BASE_MODEL": "tiny-moe", "LORAPLEX_POOL_METRICS_PORT": "9300"},
        "pool-default-2": {"LORAPLEX_POOL": "default-2", "LORAPLEX_BASE_MODEL": "tiny",
                           "LORAPLEX_POOL_METRICS_PORT": "9301"},
        "pool-default-3": {"LORAPLEX_POOL": "default-3", "LORAPLEX_BASE_MODEL": "tiny-moe",
                           "LORAPLEX_POOL_METRICS_PORT": "9302"},
    }  # fmt: skip


def test_the_cuda_speed_switches_reach_the_pools_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from loraplex.pool.process import engine_spec

    switches = ("cuda_graphs", "fused_elementwise", "fused_head", "shard_base")
    assert {k: getattr(engine_spec(Settings()).config, k) for k in switches} == dict.fromkeys(switches, True)
    assert engine_spec(Settings()).config.shared_lora_inputs is None  # the engine's default
    monkeypatch.setenv("LORAPLEX_CUDA_GRAPHS", "false")
    monkeypatch.setenv("LORAPLEX_FUSED_KERNELS", "false")
    monkeypatch.setenv("LORAPLEX_POOL_LAYOUT", "replicate")
    monkeypatch.setenv("LORAPLEX_SHARED_LORA_INPUTS", "false")
    config = engine_spec(Settings()).config
    assert not any(getattr(config, k) for k in switches) and config.shared_lora_inputs is False
    monkeypatch.setenv("LORAPLEX_POOL_LAYOUT", "ring")
    with pytest.raises(ValueError, match="pool_layout"):
        Settings()


def test_a_cpu_pool_leaves_a_core_to_the_gateway_and_redis(monkeypatch: pytest.MonkeyPatch) -> None:
    from loraplex.pool.process import engine_spec

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert engine_spec(Settings()).cpu_threads == 1
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert Settings().resolved_pool_cpu_threads == 15 and Settings(world_size=2).resolved_pool_cpu_threads == 7
    assert Settings(pool_cpu_threads=3).resolved_pool_cpu_threads == 3


def test_plans_are_answered_by_round_on_cuda_pools_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    from loraplex.dispatch.hooks import DispatchConfig

    assert not DispatchConfig.from_settings(Settings(device="cpu")).answer_rounds
    assert DispatchConfig.from_settings(Settings(device="cuda")).answer_rounds
    assert DispatchConfig.from_settings(Settings(device="cuda:1")).answer_rounds
    monkeypatch.setenv("LORAPLEX_ANSWER_ROUNDS", "true")
    assert DispatchConfig.from_settings(Settings(device="cpu")).answer_rounds
    monkeypatch.setenv("LORAPLEX_ANSWER_ROUNDS", "false")
    assert not DispatchConfig.from_settings(Settings(device="cuda")).answer_rounds
