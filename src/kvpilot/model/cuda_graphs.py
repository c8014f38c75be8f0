"""CUDA graphs for decode steps (off with --enforce-eager; batch sizes from --cuda-graph-sizes).

An eager decode step launches some 50 kernels a layer, each costing host time; on a GPU that host time, not
the kernels, set the pace of small batches (about ten times the kernels' own time at batch 1: docs/benchmark-log.md).
A graph captured at the step's batch size replays them all with one launch. Steps whose batch is not
captured, or that hold prompt tokens, run eagerly.

Each graph reads fixed device buffers: the token ids and positions (static tensors a step copies into) and
the attention metadata, which the Triton backend packs at fixed offsets of one reserved buffer for a given
number of decodes and block-table width (triton_metadata). A batch of n decodes replays the graph of the
smallest captured size >= n; the padding rows have slot -1 (their K/V are not written), a two-token context
read from block 0, and outputs nobody reads.

Invariants: graphs are captured after the KV cache is allocated and are dropped with it; the metadata buffer
never moves after capture (PackedArrays.freeze); a graph runs the decode split chosen for its batch size at
max_model_len (splits past a sequence's context exit at once). On a CPU (tests) `capture` keeps the same
closure over the same static buffers and `forward` calls it, so everything but the capture itself is
checked in CI (Triton's interpreter).
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from kvpilot.model.attention.base import StepAttention
from kvpilot.model.attention.layout import StepLayout
from kvpilot.model.attention.triton_split import DecodeSplit

logger = logging.getLogger(__name__)
PAD_CONTEXT = 2  # padding rows: a decode (one query after one earlier token) that reads block 0, writes nothing


@dataclass
class _Graph:
    size: int
    run: Callable[[], torch.Tensor]  # the eager forward over the static buffers
    split: DecodeSplit  # fixed at capture: each replay packs its metadata for this split
    graph: "torch.cuda.CUDAGraph | None" = None
    hidden: torch.Tensor | None = None  # the graph's output [size, hidden], overwritten by each replay


def padded_decode_layout(layout: StepLayout, size: int) -> StepLayout:
    """`layout` (n decodes) with size - n padding decodes appended (slot -1, context PAD_CONTEXT, table row 0)."""
    n = len(layout.query_lens)
    pad = size - n
    width = layout.block_tables.shape[1]
    return StepLayout(
        query_start=np.arange(size, dtype=np.int64), query_lens=np.ones(size, dtype=np.int64),
        start_positions=np.concatenate([layout.start_positions, np.full(pad, PAD_CONTEXT - 1, dtype=np.int64)]),
        block_tables=np.concatenate([layout.block_tables, np.zeros((pad, width), dtype=layout.block_tables.dtype)]),
        slot_mapping=np.concatenate([layout.slot_mapping, np.full(pad, -1, dtype=np.int64)]),
        block_size=layout.block_size)


def _padding_layout(size: int, block_size: int) -> StepLayout:
    empty = np.zeros(0, dtype=np.int64)
    return padded_decode_layout(StepLayout(empty, empty, empty, np.zeros((0, 1), dtype=np.int64), empty,
                                           block_size), size)


class DecodeGraphs:
    """One captured forward per batch size in `sizes`, over shared static inputs. `backend` must pack its
    metadata at fixed offsets (the Triton backend: build(..., table_width, decode_split), reserve, freeze)."""

    def __init__(self, model: torch.nn.Module, backend, kv_caches: list[torch.Tensor], sizes: Sequence[int],
                 block_size: int, max_blocks_per_seq: int, max_model_len: int, device: torch.device, *,
                 kv_scales: Mapping[int, Any] | None = None) -> None:
        """kv_scales: the runner's fp8 KV scales (model/kv_scales.py): captured as the products that read them,
        so a replay uses the values calibration later writes in place."""
        if not sizes:
            raise ValueError("DecodeGraphs needs at least one batch size")
        self.model, self.backend, self.kv_caches, self.kv_scales = model, backend, kv_caches, kv_scales
        self.sizes = sorted(set(sizes))
        self.block_size, self.width, self.max_model_len = block_size, max_blocks_per_seq, max_model_len
        self.device = device
        self.token_ids = torch.zeros(self.sizes[-1], dtype=torch.long, device=device)
        self.positions = torch.full((self.sizes[-1],), PAD_CONTEXT - 1, dtype=torch.long, device=device)
        self._graphs: dict[int, _Graph] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every size, largest first (one memory pool: the smaller graphs reuse its blocks)."""
        began = time.perf_counter()
        cuda = self.device.type == "cuda"
        before = torch.cuda.memory_reserved(self.device) if cuda else 0
        pool = torch.cuda.graph_pool_handle() if cuda else None
        stream = torch.cuda.Stream(self.device) if cuda else None  # one warm-up stream: its cached blocks reused
        for size in reversed(self.sizes):
            self._graphs[size] = self._capture_one(size, pool, stream)
        self.backend.freeze()
        if cuda:
            grown = torch.cuda.memory_reserved(self.device) - before
            logger.info("CUDA graphs: %d decode batch sizes (%d-%d) captured in %.1f s, %.0f MiB",
                        len(self.sizes), self.sizes[0], self.sizes[-1], time.perf_counter() - began, grown / 2**20)

    def _capture_one(self, size: int, pool, stream: "torch.cuda.Stream | None") -> _Graph:
        split = self.backend.decode_split_for(size, self.max_model_len, self.device)
        meta = self.backend.build(_padding_layout(size, self.block_size), self.device, table_width=self.width,
                                  decode_split=split)
        attn = StepAttention(self.backend, meta, kv_scales=self.kv_scales)
        token_ids, positions = self.token_ids[:size], self.positions[:size]

        def run() -> torch.Tensor:
            return self.model(token_ids, positions, self.kv_caches, attn)

        if stream is None:
            return _Graph(size, run, split)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # compiles the kernels and settles the allocator before capture
            for _ in range(2):
                run()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            hidden = run()
        return _Graph(size, run, split, graph, hidden)

    def size_for(self, layout: StepLayout) -> int | None:
        """The captured size a step replays, or None when it runs eagerly (prompt tokens, or too many rows)."""
        n = len(layout.query_lens)
        if not self._graphs or n == 0 or n > self.sizes[-1] or layout.num_tokens != n:
            return None
        if not layout.all_decode:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, layout: StepLayout,
                size: int) -> torch.Tensor:
        """Hidden states [n, hidden] of the step's n decodes, by replaying the graph of `size` (>= n)."""
        n = len(layout.query_lens)
        entry = self._graphs[size]
        self.backend.build(padded_decode_layout(layout, size), self.device, table_width=self.width,
                           decode_split=entry.split)
        self.token_ids[:n].copy_(token_ids)  # padding rows keep earlier ids/positions: valid, unread
        self.positions[:n].copy_(positions)
        if entry.graph is None or entry.hidden is None:  # CPU: the same closure, run eagerly
            return entry.run()[:n]
        entry.graph.replay()
        return entry.hidden[:n]
