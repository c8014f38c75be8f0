"""KV-cache events: which prefix blocks the engine holds, as they change (vLLM's `--kv-events-config` model).

An external router (llm-d's KV-cache indexer, a Ray Serve request router) subscribes to them to know which
replica already has a prompt's leading blocks. The block pool records an event when it registers a full
block for prefix reuse (BlockStored) and when such a block loses its hash (BlockRemoved: evicted for new
data, or dropped by a prefix-cache reset). Replaying the events in order gives exactly the pool's set of
cached hashes. With KV offload (kv_offload.py) the tiers record theirs too, each event naming where the block
is in vLLM's `medium` field: "GPU" for the pool's own blocks (vLLM's name for its primary tier, on a CPU engine
too), "CPU" for the host-memory tier, "STORAGE" for the local-disk tier (vLLM's name for a storage tier);
replaying one medium's events gives that tier's hashes. Hashes are the pool's own chained block hashes
(block_pool.chained_block_hash: sha256 of the parent hash and the token ids), equal across processes and restarts.

Torch- and transport-free: the engine core drains the log after each step and a publisher (server/) sends it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

POOL_MEDIUM = "GPU"


@dataclass(slots=True)
class BlockStored:
    """Consecutive blocks of one sequence became reusable. `parent_block_hash` is the hash of the block before
    the first one (None: the first is a sequence's first block); `token_ids` are all the blocks' tokens, in
    order (block_size per block)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str = POOL_MEDIUM


@dataclass(slots=True)
class BlockRemoved:
    """These blocks no longer hold a reusable prefix (in `medium`)."""

    block_hashes: list[int]
    medium: str = POOL_MEDIUM


@dataclass(slots=True)
class AllBlocksCleared:
    """Forget everything this engine said before (sent first by a publisher: a fresh engine holds nothing)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class KVEventLog:
    """Events in the order they happened, merged where that keeps them equivalent: a stored block whose parent
    is the last block of the previous BlockStored of the same medium extends it; removals in a row from one
    medium become one BlockRemoved."""

    block_size: int
    events: list[KVCacheEvent] = field(default_factory=list)

    def stored(self, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...],
               medium: str = POOL_MEDIUM) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockStored) and parent_hash is not None and last.block_hashes[-1] == parent_hash \
                and last.medium == medium:
            last.block_hashes.append(block_hash)
            last.token_ids.extend(token_ids)
            return
        self.events.append(BlockStored([block_hash], parent_hash, list(token_ids), self.block_size, medium))

    def removed(self, block_hash: int, medium: str = POOL_MEDIUM) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(block_hash)
            return
        self.events.append(BlockRemoved([block_hash], medium))

    def take(self) -> list[KVCacheEvent]:
        """The events since the last take, oldest first; the log is empty afterwards."""
        events, self.events = self.events, []
        return events
