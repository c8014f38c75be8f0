"""How a decode step splits each sequence's context across programs (flash-decoding): enough programs to
fill the GPU when the batch is small and contexts long, none wasted when the batch alone fills it.

Each split of one (sequence, KV head) covers `partition_size` consecutive key positions; a reduce kernel
then merges the splits' partial softmaxes. Torch-free and triton-free: plain integer policy."""

from __future__ import annotations

from dataclasses import dataclass

MIN_PARTITION = 256  # keys per split: below this a split's fixed cost (load q, write partials) dominates
PARTITION_ALIGN = 64  # partitions are multiples of this, so any power-of-two key tile up to it divides them
MAX_SPLITS = 64  # the reduce kernel holds every split of a head at once
PROGRAMS_PER_SM = 4  # resident programs per SM that hide memory latency


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class DecodeSplit:
    """Invariants: partition_size is a multiple of PARTITION_ALIGN or a power of two >= 16 (so a power-of-
    two key tile no larger than it divides it); num_splits * partition_size >= the longest context of the
    step, so split s of a sequence covers keys [s * partition_size, (s + 1) * partition_size)."""

    partition_size: int
    num_splits: int

    @property
    def single(self) -> bool:
        """One split: the decode kernel writes the final output, no reduce."""
        return self.num_splits == 1


def choose_decode_split(num_decodes: int, num_kv_heads: int, max_context: int, num_sms: int,
                        forced_partition: int | None = None) -> DecodeSplit:
    """Splits per sequence so that decodes x kv_heads x splits reaches PROGRAMS_PER_SM x num_sms, each split
    at least MIN_PARTITION keys. forced_partition (for tests: splits on tiny shapes) is rounded up to a
    power of two >= 16 (the kernel's key tile shrinks to it when smaller)."""
    max_context = max(1, max_context)
    if forced_partition is not None:
        partition = max(16, 1 << (max(forced_partition, 1) - 1).bit_length())
        while _cdiv(max_context, partition) > MAX_SPLITS:
            partition *= 2
        return DecodeSplit(partition, _cdiv(max_context, partition))
    wanted = _cdiv(PROGRAMS_PER_SM * max(num_sms, 1), max(num_decodes * num_kv_heads, 1))
    splits = max(1, min(wanted, _cdiv(max_context, MIN_PARTITION), MAX_SPLITS))
    partition = _cdiv(_cdiv(max_context, splits), PARTITION_ALIGN) * PARTITION_ALIGN
    return DecodeSplit(partition, _cdiv(max_context, partition))
