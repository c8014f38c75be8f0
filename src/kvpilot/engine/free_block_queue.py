"""The free block queue: a doubly-linked LRU list of KVBlocks with O(1) removal of any block."""

from __future__ import annotations

from collections.abc import Iterator

from kvpilot.engine.kv_block import KVBlock


class FreeBlockQueue:
    """Blocks with ref_cnt 0, least recently freed first.

    popleft takes the next block to reuse (the eviction candidate); append puts a freed block last;
    appendleft puts a block that holds nothing worth keeping first; remove takes out any block in O(1)
    (a prefix-cache hit reviving a cached block). Sentinels at both ends keep the link code branch-free.
    """

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head = KVBlock(block_id=-1)
        self._tail = KVBlock(block_id=-2)
        self._head.next = self._tail
        self._tail.prev = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next
        while node is not None and node is not self._tail:
            yield node
            node = node.next

    def block_ids(self) -> list[int]:
        """Block ids in eviction order (next to be reused first)."""
        return [block.block_id for block in self]

    def append(self, block: KVBlock) -> None:
        self._insert_after(self._tail.prev, block)  # type: ignore[arg-type]

    def appendleft(self, block: KVBlock) -> None:
        self._insert_after(self._head, block)

    def popleft(self) -> KVBlock:
        first = self._head.next
        if first is None or first is self._tail:
            raise IndexError("the free block queue is empty")
        self.remove(first)
        return first

    def remove(self, block: KVBlock) -> None:
        if not block.in_free_queue or block.prev is None or block.next is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        block.prev.next = block.next
        block.next.prev = block.prev
        block.prev = block.next = None
        block.in_free_queue = False
        self._len -= 1

    def _insert_after(self, anchor: KVBlock, block: KVBlock) -> None:
        if block.in_free_queue:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        after = anchor.next
        assert after is not None  # sentinel invariant: every linked node has a successor
        block.prev, block.next = anchor, after
        anchor.next = block
        after.prev = block
        block.in_free_queue = True
        self._len += 1
