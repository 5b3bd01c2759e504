"""workers/body_graphs.pad_microbatch and capture_fits (pure): the bucketed layout a CUDA graph replays, and when a
bucket may be captured (the graphs themselves run on the GPU: tests/gpu/test_body_graphs_cuda.py)."""

from __future__ import annotations

import pytest

from loraplex.workers.engine.body_graphs import GraphKey, capture_fits, pad_microbatch


def test_pad_tokens_form_their_own_sequence_and_zero_scale_group() -> None:
    p = pad_microbatch([100, 30, 70], [3, 5], [8, 16], [2.0, 1.0], [130, 70], elementwise=True)
    assert p.key == GraphKey(tokens=256, groups=4, boundaries=8, max_length=128, elementwise=True)
    assert p.pad_tokens == 56
    assert p.cu_seqlens == [0, 100, 130, 200, 256, 256, 256, 256]  # pad sequence, then empty ones
    assert p.slots == [3, 5, 5, 5] and p.ranks == [8, 16, 16, 16]
    assert p.scales == [2.0, 1.0, 0.0, 0.0] and p.group_rows == [130, 70, 56, 0]


def test_a_full_bucket_needs_no_pad_group_and_shapes_share_a_key() -> None:
    p = pad_microbatch([512] * 8, [0, 1, 2, 3], [32] * 4, [2.0] * 4, [1024] * 4, elementwise=False)
    assert p.pad_tokens == 0 and p.group_rows == [1024] * 4 and p.scales == [2.0] * 4
    assert p.key == GraphKey(tokens=4096, groups=4, boundaries=16, max_length=512, elementwise=False, uniform=True)
    q = pad_microbatch([500] * 8, [7, 6, 5, 4], [8] * 4, [1.0] * 4, [1000] * 4, elementwise=False)
    assert q.pad_tokens == 96 and q.key == GraphKey(4096, 8, 16, 512, False)  # + pad group: 5 -> 8 groups


def test_only_sequences_of_one_length_filling_the_bucket_take_the_dense_attention() -> None:
    """Uniform: the exact length is the key's max_length (the dense attention's sequence length), not a bound."""
    p = pad_microbatch([64] * 4, [2], [8], [1.0], [256], elementwise=False)
    assert p.key.uniform and p.key.max_length == 64 and p.pad_tokens == 0
    assert not pad_microbatch([64] * 3, [2], [8], [1.0], [192], elementwise=False).key.uniform  # a pad sequence
    assert not pad_microbatch([100, 156], [2], [8], [1.0], [256], elementwise=False).key.uniform


def test_the_bound_on_sequence_length_never_exceeds_the_bucket() -> None:
    assert pad_microbatch([10], [0], [4], [1.0], [10], elementwise=False).key.max_length == 256  # the pad sequence
    assert pad_microbatch([3000], [0], [4], [1.0], [3000], elementwise=False).key.max_length == 3072


def test_groups_must_cover_the_sequences() -> None:
    with pytest.raises(ValueError, match="cover"):
        pad_microbatch([10, 10], [0], [4], [1.0], [15], elementwise=False)


GiB = 1 << 30


def test_a_capture_must_leave_the_eager_path_room_for_a_full_microbatch() -> None:
    # A 4,096-token bucket holding 10 GiB: the capture keeps 12.5 GiB (with the backward's temporaries), the eager path
    # then needs another 12.5 GiB for a full microbatch, and the margin 4 GiB: 29 GiB free is exactly enough.
    assert capture_fits(10 * GiB, 4096, 4096, free=29 * GiB, margin=4 * GiB)
    assert not capture_fits(10 * GiB, 4096, 4096, free=29 * GiB - 1, margin=4 * GiB)
    # A small bucket is scaled up to the full microbatch it must leave room for (per token, 8x here).
    assert capture_fits(1 * GiB, 512, 4096, free=1.25 * GiB * 9 + 4 * GiB, margin=4 * GiB)
    assert not capture_fits(1 * GiB, 512, 4096, free=1.25 * GiB * 9 + 4 * GiB - 1, margin=4 * GiB)
    # A bucket larger than the microbatch cap (a long sequence) leaves room for itself once more.
    assert capture_fits(GiB, 8192, 4096, free=2.5 * GiB, margin=0) and not capture_fits(GiB, 8192, 4096, 2.4 * GiB, 0)
