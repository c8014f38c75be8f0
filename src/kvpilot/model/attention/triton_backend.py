"""The Triton backend (--attention-backend triton; `auto` on CUDA when triton imports): K/V read in place
through block tables by Triton kernels, with no gathered copies.

Per layer: one kernel writes the step's K/V through the slot mapping (triton_kv_write); one launch runs
every prompt chunk of the step (triton_prefill: variable length, cached prefix + causal new tokens); one
launch (plus a reduce when split) runs every decode (triton_decode: split-KV). The cache layout is the
torch backend's ([2, kv_heads, num_blocks, block_size, head_dim]), so both read the same cache. Per-step
metadata is packed into one persistent device buffer (triton_metadata), built once per step for all layers.

Every LayerAttention variant (sliding window, logit soft-cap, sinks) runs in the same kernels. Sliding window
invariant: a block-table entry whose block lies wholly before the window of every query of the step is never
read: decode programs start at their window's first key (whole splits before it do nothing), prefill tiles at
their first query's.
"""

from __future__ import annotations

import numpy as np
import torch

from kvpilot.model.attention.base import LayerAttention, as_layer_attention
from kvpilot.model.attention.layout import StepLayout
from kvpilot.model.attention.triton_decode import decode_attention
from kvpilot.model.attention.triton_kv_write import write_kv_triton
from kvpilot.model.attention.triton_metadata import PACKED_ARRAYS, TritonAttentionMetadata, pack_layout
from kvpilot.model.attention.triton_prefill import prefill_attention
from kvpilot.model.attention.triton_split import DecodeSplit, choose_decode_split
from kvpilot.model.attention.triton_support import TRITON_FEATURES
from kvpilot.model.device_staging import PackedArrays
from kvpilot.model.errors import ModelLoadError

MAX_SLOTS = 2 ** 31  # slots travel as int32
DEFAULT_KV_HEADS = 8  # for the split policy until kv_cache_shape tells the real count


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


class TritonAttentionBackend:
    """k_scale / v_scale: per-tensor scales of an fp8 KV cache (stored = value / scale; 1.0 otherwise).
    decode_partition: force the keys per decode split (tests use it to exercise the split path on tiny
    shapes); None lets the split policy fill the GPU."""

    name = "triton"
    features: frozenset[str] = TRITON_FEATURES

    def __init__(self, k_scale: float = 1.0, v_scale: float = 1.0, decode_partition: int | None = None) -> None:
        if k_scale <= 0 or v_scale <= 0:
            raise ModelLoadError(f"KV cache scales must be positive, got k_scale={k_scale}, v_scale={v_scale}")
        self.k_scale, self.v_scale = float(k_scale), float(v_scale)
        self.decode_partition = decode_partition
        self.num_kv_heads = DEFAULT_KV_HEADS
        # each KV group's metadata buffer (engine/kv_groups.py: a step's groups' metadata live side by side)
        self._packed: dict[int, PackedArrays] = {}

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        if num_blocks * block_size >= MAX_SLOTS:
            raise ModelLoadError(f"{num_blocks} blocks of {block_size} tokens exceed the Triton backend's "
                                 f"{MAX_SLOTS} slots: lower kv_cache_memory or gpu_memory_utilization")
        self.num_kv_heads = num_kv_heads
        return (2, num_kv_heads, num_blocks, block_size, head_dim)

    def reserve(self, max_num_seqs: int, max_num_tokens: int, max_blocks_per_seq: int, device: torch.device) -> None:
        """Allocates the metadata buffer for the largest step up front (before a CUDA graph capture)."""
        self._buffers(device).reserve(4 * max_num_seqs + 1 + max_num_tokens + max_num_seqs * max_blocks_per_seq,
                                      num_arrays=PACKED_ARRAYS)

    def _buffers(self, device: torch.device, group: int = 0) -> PackedArrays:
        packed = self._packed.get(group)
        if packed is None or packed.device != device:
            packed = self._packed[group] = PackedArrays(device)
        return packed

    def freeze(self) -> None:
        """The metadata buffer stays where it is from now on (CUDA graphs read it): a step that would need
        more than was reserved raises instead of moving it."""
        if 0 in self._packed:  # group 0's: CUDA graphs run models of one group
            self._packed[0].freeze()

    def decode_split_for(self, num_decodes: int, max_context: int, device: torch.device) -> DecodeSplit:
        return choose_decode_split(num_decodes, self.num_kv_heads, max_context, _num_sms(device),
                                   self.decode_partition)

    def build(self, layout: StepLayout, device: torch.device, table_width: int | None = None,
              decode_split: DecodeSplit | None = None, group: int = 0) -> TritonAttentionMetadata:
        """table_width: block-table columns to send (None: the step's widest need; a CUDA graph passes its
        fixed width, so the metadata lands at the same addresses every replay). decode_split: None chooses
        one for the step's decodes; a CUDA graph fixes one per batch size. group: the KV group whose layout
        this is (each group's metadata in its own buffers, so all of a step's stay valid together)."""
        if decode_split is None:
            decodes = layout.is_decode
            max_decode_context = int(layout.context_lens[decodes].max()) if decodes.any() else 1
            decode_split = self.decode_split_for(int(np.count_nonzero(decodes)), max_decode_context, device)
        return pack_layout(layout, self._buffers(device, group), decode_split, table_width)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: TritonAttentionMetadata, layer: LayerAttention | float) -> torch.Tensor:
        """layer: the layer's LayerAttention (a bare scale: plain causal attention)."""
        layer = as_layer_attention(layer)
        # the prefill reads its own new K/V from k/v and only earlier tokens from the cache, so writing first
        # is not needed for it; decode reads its new key from the cache
        write_kv_triton(kv_cache, k, v, meta.slot_mapping, self.k_scale, self.v_scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        prefill_attention(q, k, v, kv_cache, out, meta.prefill_seqs, meta.query_start, meta.seq_lens,
                          meta.block_tables, meta.max_prefill_len, layer, self.k_scale, self.v_scale)
        decode_attention(q, kv_cache, out, meta.decode_seqs, meta.query_start, meta.seq_lens, meta.block_tables,
                         meta.decode_split, layer, self.k_scale, self.v_scale)
        return out
