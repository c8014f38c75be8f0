"""Host-to-device transfer of a step's small arrays without a device sync.

A plain `torch.from_numpy(a).to("cuda")` copies from pageable memory, which waits for every kernel queued
before it: with async scheduling, building step N+1's inputs would wait for step N to finish. Here a step's
arrays are written into pinned host staging and sent in one asynchronous copy into one device buffer, of
which they are views. On a CPU the same object does the same copies (tests exercise it there).

Every view starts on a 16-byte boundary: Triton compiles a kernel variant per combination of its pointer
arguments' 16-byte alignment, so views at offsets that follow the step's counts compiled a new variant on
step after step (on a GPU that compiling cost more than the steps: docs/benchmark-log.md, "Figures moved out of
the code").
"""

from __future__ import annotations

import numpy as np
import torch

ALIGN_BYTES = 16


class FrozenBufferError(RuntimeError):
    """A step outgrew a buffer that captured CUDA graphs read (so it may not move)."""


class PackedArrays:
    """One growable device buffer of one dtype, filled from pinned host staging by a single copy a step."""

    def __init__(self, device: torch.device, capacity: int = 0, dtype: torch.dtype = torch.int32) -> None:
        self.device = device
        self.dtype = dtype
        self._pinned = device.type == "cuda"
        self._staging: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event | None] = []
        self._turn = 0
        self._frozen = False
        self.buffer = torch.empty(0, dtype=dtype, device=device)
        self.reserve(capacity)

    def freeze(self) -> None:
        """From now on the device buffer never moves (captured CUDA graphs hold its address)."""
        self._frozen = True

    def reserve(self, num_values: int, num_arrays: int = 1) -> None:
        """Makes room for num_values in num_arrays arrays (each padded to 16 bytes; rounded up to a power of
        two, at least 2); no-op when it fits already. FrozenBufferError once frozen: the graphs would read a
        freed buffer."""
        step = max(ALIGN_BYTES // self.buffer.element_size(), 1)
        num_values += num_arrays * (step - 1)
        if num_values <= self.buffer.numel() and self._staging:
            return
        if self._frozen:
            raise FrozenBufferError(
                f"a step needs {num_values} values but {self.buffer.numel()} were reserved before the "
                "CUDA graphs were captured: a runner bug (reserve for max_num_seqs, the token budget and "
                "max_model_len); --enforce-eager avoids it")
        size = 1 << max(num_values - 1, 1).bit_length()
        self.buffer = torch.empty(size, dtype=self.dtype, device=self.device)
        copies = 2 if self._pinned else 1
        self._staging = [torch.empty(size, dtype=self.dtype, pin_memory=self._pinned) for _ in range(copies)]
        self._events = [None] * copies

    def _aligned(self, num_values: int) -> int:
        step = max(ALIGN_BYTES // self.buffer.element_size(), 1)
        return -(-num_values // step) * step

    def pack(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Device views holding `arrays` (cast to the buffer's dtype), in order, each starting 16-byte aligned:
        equal sizes land at equal addresses. The copy is asynchronous on CUDA (pinned staging, two turns: a
        turn is rewritten only after the copy that read it last has finished)."""
        total = sum(self._aligned(int(a.size)) for a in arrays)
        self.reserve(total, 0)
        turn = self._turn
        self._turn = (turn + 1) % len(self._staging)
        event = self._events[turn]
        if event is not None:
            event.synchronize()  # the copy that last read this staging buffer (normally long finished)
        host = self._staging[turn].numpy()
        offset, spans = 0, []
        for array in arrays:
            host[offset: offset + array.size] = array.ravel()
            spans.append((offset, array.size))
            offset += self._aligned(int(array.size))
        self.buffer[:total].copy_(self._staging[turn][:total], non_blocking=self._pinned)
        if self._pinned:
            event = torch.cuda.Event()
            event.record()
            self._events[turn] = event
        return [self.buffer[o: o + n] for o, n in spans]
