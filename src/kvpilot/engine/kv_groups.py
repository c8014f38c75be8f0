"""KV cache groups: how the layers of a model with full-attention and sliding-window layers share one block pool.

A model whose layers all attend alike (all full, or all sliding) has one group: a block id names the block's
slots in every layer's cache. An interleaved model (Gemma 2/3, gpt-oss: local layers with a window W, global
layers over the whole context) gets several groups, as vLLM's hybrid KV cache manager does, so the sliding
layers' blocks that fell out of the window can be freed while the full layers keep theirs:

- layers of one kind (one window, or none) are cut into groups of `group_size` layers, `group_size` being
  the layer count of the rarest kind, so every group has the same size (the last of a kind may be short:
  its missing layers' slots go unused);
- the cache holds `group_size` tensors ("slots"), each with every block id; layer j of any group reads and
  writes slot j, so a block id belongs to one group at a time and its memory serves that group's layers;
- each request has one block table per group, all the same length (index = position // block_size); a
  sliding group's leading blocks outside its window are placeholders (kv_manager.py);
- group 0 is a full-attention group whenever the model has one, then the sliding kinds, smallest window first.

A block of the pool therefore costs `group_size` layers of K/V (fit/kv_cache.py counts it that way).
Beyond MAX_KV_GROUPS groups (a model with one odd layer among many: each group pays per-block bookkeeping on
every allocation) the model falls back to one group with no freeing, which is always correct.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MAX_KV_GROUPS = 8


@dataclass(frozen=True)
class KVGroupPlan:
    """Which group and cache slot each layer uses.

    Invariants: len(layer_groups) == len(layer_slots) == the model's layers; 0 <= layer_slots[i] < num_slots;
    group_windows[g] is the window of every layer of group g (None: full attention), one per group; no two
    layers share a (group, slot) pair; with one group, layer_slots[i] == i and num_slots == the layers.
    """

    group_windows: tuple[int | None, ...]
    layer_groups: tuple[int, ...]
    layer_slots: tuple[int, ...]
    num_slots: int

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def is_hybrid(self) -> bool:
        """Whether the layers form several groups (each with its own block table per request)."""
        return len(self.group_windows) > 1


def single_group(num_layers: int, window: int | None) -> KVGroupPlan:
    """One group over every layer: a block names its slots in all of them."""
    return KVGroupPlan((window,), (0,) * num_layers, tuple(range(num_layers)), num_layers)


def plan_kv_groups(layer_windows: Sequence[int | None], *, hybrid: bool = True) -> KVGroupPlan:
    """The group plan for a model whose layer i attends to the last layer_windows[i] keys (None: the whole
    context). Uniform layers, `hybrid=False`, or a split into more than MAX_KV_GROUPS groups: one group, whose
    window is the largest when every layer slides (a block outside it is outside every layer's), else None."""
    num_layers = len(layer_windows)
    kinds = sorted(set(layer_windows), key=lambda w: (w is not None, w or 0))
    if len(kinds) <= 1 or not hybrid:
        sliding = bool(layer_windows) and all(w is not None for w in layer_windows)
        return single_group(num_layers, max(w for w in layer_windows if w is not None) if sliding else None)
    members = {kind: [i for i, w in enumerate(layer_windows) if w == kind] for kind in kinds}
    group_size = min(len(layers) for layers in members.values())
    windows: list[int | None] = []
    groups, slots = [0] * num_layers, [0] * num_layers
    for kind in kinds:
        layers = members[kind]
        for start in range(0, len(layers), group_size):
            for slot, layer in enumerate(layers[start:start + group_size]):
                groups[layer], slots[layer] = len(windows), slot
            windows.append(kind)
    if len(windows) > MAX_KV_GROUPS:
        return plan_kv_groups(layer_windows, hybrid=False)
    return KVGroupPlan(tuple(windows), tuple(groups), tuple(slots), group_size)


_GROUP_SALT = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: spreads the groups' keys apart


def group_block_hash(block_hash: int, group: int) -> int:
    """The key under which KV group `group` caches the block whose chained hash is block_hash (group 0: the
    hash itself, what KV events report). The pool still checks a hit's token ids and parent hash."""
    return block_hash if group == 0 else (block_hash + group * _GROUP_SALT) % 2**64
