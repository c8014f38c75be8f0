"""PackedArrays (model/device_staging.py) and HostCopy (model/host_copy.py), on the CPU (and a GPU when
there is one): values land where the views say, every view starts on a 16-byte boundary whatever the sizes
before it (Triton compiles a kernel variant per pointer alignment: unaligned metadata views compiled new
variants step after step on an H100), also in the Triton backend's metadata for random step layouts; a
host copy holds the values of its launch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpilot.model.attention.layout import StepLayout
from kvpilot.model.attention.triton_metadata import PACKED_ARRAYS, pack_layout
from kvpilot.model.attention.triton_split import DecodeSplit
from kvpilot.model.device_staging import PackedArrays


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


@pytest.mark.parametrize("dtype", [torch.int32, torch.float32, torch.int64])
def test_views_hold_the_arrays_each_16_byte_aligned(dtype):
    packed = PackedArrays(torch.device("cpu"), dtype=dtype)
    rng = np.random.default_rng(0)
    for _ in range(20):
        arrays = [rng.integers(0, 1000, size=int(n)) for n in rng.integers(0, 9, size=5)]
        views = packed.pack(arrays)
        assert all(_aligned(v) for v in views)
        assert [v.tolist() for v in views] == [a.astype(np.float32 if dtype.is_floating_point else np.int64).tolist()
                                              for a in arrays]


def test_reserved_room_takes_the_padding_of_every_array():
    packed = PackedArrays(torch.device("cpu"))
    packed.reserve(60, num_arrays=6)  # 60 values would fit 64 unpadded: 76 padded do not
    packed.freeze()
    arrays = [np.arange(n, dtype=np.int32) for n in (1, 1, 1, 1, 1, 55)]
    assert [v.tolist() for v in packed.pack(arrays)] == [a.tolist() for a in arrays]


def _layout(rng: np.random.Generator, block_size: int = 16) -> StepLayout:
    num_seqs = int(rng.integers(1, 12))
    query_lens = np.where(rng.random(num_seqs) < 0.6, 1, rng.integers(2, 40, size=num_seqs))
    starts = rng.integers(0, 100, size=num_seqs)
    width = int(-(-(starts + query_lens).max() // block_size))
    tables = rng.integers(0, 500, size=(num_seqs, width))
    query_start = np.concatenate([[0], np.cumsum(query_lens)[:-1]])
    positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, query_lens)])
    rows = np.repeat(np.arange(num_seqs), query_lens)
    slots = tables[rows, positions // block_size] * block_size + positions % block_size
    return StepLayout(query_start=query_start, query_lens=query_lens, start_positions=starts, block_tables=tables,
                      slot_mapping=slots, block_size=block_size)


def test_triton_metadata_views_are_aligned_for_any_step():
    packed = PackedArrays(torch.device("cpu"))
    rng = np.random.default_rng(1)
    split = DecodeSplit(partition_size=64, num_splits=1)
    for _ in range(50):
        layout = _layout(rng)
        meta = pack_layout(layout, packed, split)
        views = [meta.query_start, meta.seq_lens, meta.decode_seqs, meta.prefill_seqs, meta.slot_mapping,
                 meta.block_tables]
        assert len(views) == PACKED_ARRAYS and all(_aligned(v) for v in views)
        assert meta.slot_mapping.tolist() == layout.slot_mapping.tolist()
        assert meta.query_start.tolist() == [*layout.query_start.tolist(), layout.num_tokens]


def test_host_copy_holds_the_values_of_its_launch():
    from kvpilot.model.host_copy import HostCopy

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ids = torch.arange(6, device=device)
    values = torch.linspace(0, 1, 6, device=device)
    copy = HostCopy([ids, values])
    ids.add_(100)  # the next step's work, queued behind the copy
    values.mul_(0)
    host_ids, host_values = copy.wait()
    assert host_ids.device.type == "cpu" and host_ids.tolist() == list(range(6))
    assert host_values.tolist() == torch.linspace(0, 1, 6).tolist()
