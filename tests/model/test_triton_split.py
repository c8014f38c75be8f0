"""The decode split policy (flash-decoding): small batches with long contexts spread over many programs,
a batch that fills the GPU alone is not split, and every split is large enough to pay for itself."""

from __future__ import annotations

import pytest

from kvpilot.model.attention.triton_split import MAX_SPLITS, MIN_PARTITION, PARTITION_ALIGN, choose_decode_split

H100_SMS = 132


def test_batch_one_long_context_fills_the_gpu():
    split = choose_decode_split(num_decodes=1, num_kv_heads=8, max_context=32768, num_sms=H100_SMS)
    assert split.num_splits * 8 >= min(4 * H100_SMS, 8 * MAX_SPLITS)  # 4 programs per SM, or the split limit
    assert split.partition_size >= MIN_PARTITION and split.partition_size % PARTITION_ALIGN == 0
    assert split.num_splits * split.partition_size >= 32768


def test_large_batch_is_not_split():
    split = choose_decode_split(num_decodes=256, num_kv_heads=8, max_context=2048, num_sms=H100_SMS)
    assert split.single and split.partition_size >= 2048


@pytest.mark.parametrize("max_context", [1, 17, 255, 256, 1000, 10**6])
def test_splits_cover_the_context_within_the_limits(max_context):
    split = choose_decode_split(num_decodes=1, num_kv_heads=1, max_context=max_context, num_sms=H100_SMS)
    assert 1 <= split.num_splits <= MAX_SPLITS
    assert (split.num_splits - 1) * split.partition_size < max_context <= split.num_splits * split.partition_size
    assert split.num_splits == 1 or split.partition_size >= MIN_PARTITION


def test_forced_partition_is_a_power_of_two_and_respects_the_split_limit():
    assert choose_decode_split(4, 2, 40, 1, forced_partition=10).partition_size == 16
    split = choose_decode_split(4, 2, 100_000, 1, forced_partition=32)
    assert split.num_splits <= MAX_SPLITS and split.partition_size & (split.partition_size - 1) == 0
