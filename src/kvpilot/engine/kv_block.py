"""KVBlock: one block of the paged KV cache as the block pool and KV manager see it (never the scheduler)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class KVBlock:
    """One block of block_size token slots in the paged KV cache.

    ref_cnt counts the requests whose block table holds it. A block with a hash holds the K/V of exactly
    `token_ids` (a full block) following the prefix whose chained hash is `parent_hash`, for the layers of KV
    group `kv_group` (engine/kv_groups.py; its hash then salted with the group, and not announced in KV events).
    prev/next link it into the free queue while ref_cnt == 0 (None otherwise, except at the ends).
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    kv_group: int = 0
    prev: KVBlock | None = field(default=None, repr=False)
    next: KVBlock | None = field(default=None, repr=False)
    in_free_queue: bool = field(default=False, repr=False)

    def clear_hash(self) -> None:
        self.block_hash = None
        self.parent_hash = None
        self.token_ids = ()
        self.kv_group = 0
