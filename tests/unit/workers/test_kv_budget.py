"""The sampler's KV budget (workers/sampling/kv_budget.py): blocks from the memory training leaves, rows from the
blocks at the expected row length, the ceilings, forced rows, errors naming the settings; and the pool's sizing of a
real tiny engine on the CPU (pool/process.sampler_budget), its rows reaching the dispatcher's config."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.dispatch.hooks import DispatchConfig
from loraplex.errors import InvalidRequestError
from loraplex.pool.process import sampler_budget, sampler_rows
from loraplex.settings import Settings
from loraplex.workers.sampling import kv_budget
from loraplex.workers.sampling.kv_budget import KvShape, plan_kv_budget
from loraplex.workers.sampling.paged_kv import PagedKvCache
from loraplex.workers.sampling.sampler import Sampler
from loraplex.workers.sampling.step import SampleStep
from tests.helpers.lora import make_engine

QWEN3_4B = KvShape(layers=36, kv_heads=8, head_dim=128, dtype_bytes=2)  # bf16
GIB = 2**30


def test_bytes_per_block_equals_the_paged_cache_on_random_shapes() -> None:
    rng = random.Random(0)
    for _ in range(50):
        layers, heads, dim, tokens = rng.randint(1, 64), rng.randint(1, 16), rng.choice([16, 64, 128]), rng.choice([8, 16, 32])
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
        shape = KvShape(layers, heads, dim, torch.empty((), dtype=dtype).element_size())
        assert shape.bytes_per_block(tokens) == PagedKvCache.bytes_per_block(layers, tokens, heads, dim, dtype)


def test_an_h100_sized_budget_gives_hundreds_of_rows_and_keeps_the_rest_for_training() -> None:
    # Qwen3-4B bf16: 144 KiB a position, 2.25 MiB a block; 70 GiB free -> 35 GiB of blocks, 32 blocks a 512-token row
    assert plan_kv_budget(QWEN3_4B, free_bytes=70 * GIB).cache_bytes <= 70 * GIB / 4  # the default fraction
    assert plan_kv_budget(QWEN3_4B, free_bytes=63 * GIB).rows == 448  # the H100's pool: 7,168 blocks, 16 a row
    budget = plan_kv_budget(QWEN3_4B, free_bytes=70 * GIB, fraction=0.5, row_tokens=512)
    assert budget.bytes_per_block == 2 * 36 * 16 * 8 * 128 * 2
    assert budget.blocks == (35 * GIB) // budget.bytes_per_block == 15928
    assert budget.cache_bytes <= 35 * GIB and budget.rows == 496 and not budget.rows_forced  # 497 fit, rounded to 8
    assert plan_kv_budget(QWEN3_4B, free_bytes=70 * GIB, fraction=0.5, row_tokens=384).rows == 656  # 128 + 256
    assert plan_kv_budget(QWEN3_4B, free_bytes=130 * GIB, fraction=0.5, row_tokens=256).rows == 1024  # the ceiling


def test_rows_follow_the_blocks_at_the_expected_length_rounded_to_eight() -> None:
    per_block = QWEN3_4B.bytes_per_block()
    budget = plan_kv_budget(QWEN3_4B, free_bytes=4 * 300 * per_block, row_tokens=384)  # a quarter: 300 blocks, 24 a row
    assert budget.blocks == 300 and budget.rows == 8  # 12 rows fit, rounded down to a multiple of 8
    small = plan_kv_budget(QWEN3_4B, free_bytes=4 * 100 * per_block, row_tokens=384)
    assert small.rows == 4  # under 8: as many as fit
    longer = plan_kv_budget(QWEN3_4B, free_bytes=4 * 300 * per_block, row_tokens=385)  # 25 blocks a row
    assert longer.rows == 8 and plan_kv_budget(QWEN3_4B, free_bytes=4 * 300 * per_block, row_tokens=16).rows == 296


def test_random_budgets_never_promise_more_than_the_blocks_hold() -> None:
    rng = random.Random(1)
    for _ in range(500):
        shape = KvShape(rng.randint(1, 48), rng.randint(1, 8), rng.choice([64, 128]), rng.choice([1, 2, 4]))
        free = rng.randint(1, 80 * GIB)
        fraction, reserve = rng.uniform(0.05, 0.95), rng.choice([0, rng.randint(0, 80 * GIB)])
        row_tokens, ceiling = rng.randint(1, 4096), rng.choice([32, 1024])
        try:
            b = plan_kv_budget(shape, free_bytes=free, fraction=fraction, reserve_bytes=reserve, row_tokens=row_tokens,
                               ceiling=ceiling)  # fmt: skip
        except InvalidRequestError:
            assert min(int(fraction * free), free - reserve) < kv_budget.blocks_per_row(row_tokens) * shape.bytes_per_block()
            continue
        assert b.cache_bytes <= fraction * free and b.cache_bytes <= free - reserve  # training keeps its share
        assert 1 <= b.rows <= ceiling
        assert b.rows * kv_budget.blocks_per_row(row_tokens) <= b.blocks  # every row's expected length fits
        assert b.rows < 8 or b.rows % 8 == 0


def test_a_measured_reserve_wins_over_the_fraction_when_larger() -> None:
    budget = plan_kv_budget(QWEN3_4B, free_bytes=40 * GIB, fraction=0.5, reserve_bytes=30 * GIB)
    assert budget.cache_bytes <= 10 * GIB and budget.blocks == (10 * GIB) // budget.bytes_per_block


def test_configured_bytes_and_forced_rows() -> None:
    tiny = KvShape(layers=2, kv_heads=2, head_dim=16, dtype_bytes=4)  # 8 KiB a block
    cpu = plan_kv_budget(tiny, free_bytes=None, configured_bytes=kv_budget.CPU_KV_BYTES,
                         ceiling=kv_budget.CPU_ROWS_CEILING)  # fmt: skip
    assert cpu.blocks == 8192 and cpu.rows == 32 and cpu.free_bytes is None
    forced = plan_kv_budget(tiny, free_bytes=None, configured_bytes=2**20, forced_rows=3)
    assert (forced.rows, forced.blocks, forced.rows_forced) == (3, 128, True)
    assert "3 rows (forced), 128 KV blocks" in forced.describe()


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"free_bytes": 2**20}, "LORAPLEX_SAMPLER_KV_MEMORY_FRACTION"),  # too small for one 512-token row
        ({"free_bytes": None}, "LORAPLEX_SAMPLER_KV_BYTES"),
        ({"free_bytes": GIB, "fraction": 1.5}, "LORAPLEX_SAMPLER_KV_MEMORY_FRACTION"),
        ({"free_bytes": GIB, "row_tokens": 0}, "LORAPLEX_SAMPLER_ROW_TOKENS"),
        ({"free_bytes": GIB, "forced_rows": 0}, "LORAPLEX_SAMPLER_MAX_ROWS"),
        ({"free_bytes": None, "configured_bytes": -1}, "LORAPLEX_SAMPLER_KV_BYTES"),
    ],
)
def test_bad_budgets_are_typed_errors_naming_the_setting(kwargs: dict, names: str) -> None:
    with pytest.raises(InvalidRequestError, match=names):
        plan_kv_budget(QWEN3_4B, **kwargs)


def test_settings_take_auto_or_a_positive_integer_and_name_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().sampler_max_rows == "auto"
    monkeypatch.setenv("LORAPLEX_SAMPLER_MAX_ROWS", "48")
    assert Settings().sampler_max_rows == 48
    for bad in ("0", "many", "-2"):
        monkeypatch.setenv("LORAPLEX_SAMPLER_MAX_ROWS", bad)
        with pytest.raises(ValueError, match="LORAPLEX_SAMPLER_MAX_ROWS"):
            Settings()
    monkeypatch.delenv("LORAPLEX_SAMPLER_MAX_ROWS")
    with pytest.raises(ValueError, match="sampler_kv_memory_fraction"):
        Settings(sampler_kv_memory_fraction=1.0)


def test_the_pool_sizes_a_tiny_cpu_engine_and_the_dispatcher_takes_its_rows(tiny_dir) -> None:
    engine = make_engine(tiny_dir, max_rank=4, microbatch_tokens=256)
    budget = sampler_budget(Settings(), engine)
    config = engine.model.config
    assert budget.bytes_per_block == 2 * config.num_hidden_layers * 16 * config.num_key_value_heads * 16 * 4
    assert budget.rows == kv_budget.CPU_ROWS_CEILING and budget.cache_bytes <= kv_budget.CPU_KV_BYTES
    small = sampler_budget(Settings(sampler_kv_bytes=40 * budget.bytes_per_block, sampler_row_tokens=64), engine)
    assert (small.blocks, small.rows) == (40, 8)  # 10 rows of 4 blocks fit, rounded to 8
    assert sampler_budget(Settings(sampler_max_rows=5), engine).rows == 5
    assert DispatchConfig.from_settings(Settings(), sample_rows=budget.rows).sample_rows == 32
    assert DispatchConfig.from_settings(Settings(sampler_max_rows=12)).sample_rows == 12
    assert DispatchConfig.from_settings(Settings()).sample_rows == 64  # auto without a native sampler (vLLM)
    step = SampleStep(Sampler(engine, max_rows=small.rows, kv_blocks=small.blocks), None)
    assert sampler_rows(step, 1) == 8 and sampler_rows(step, 2) == 16  # every rank decodes its share
    assert sampler_rows(None, 1) is None


def test_the_shape_read_from_a_model_config_is_the_qwen3_4b_one() -> None:
    from loraplex.models.presets import SHAPE_PRESETS, qwen3_config

    assert KvShape.of(qwen3_config(SHAPE_PRESETS["qwen3-4b-shape"]), torch.bfloat16.itemsize) == QWEN3_4B
