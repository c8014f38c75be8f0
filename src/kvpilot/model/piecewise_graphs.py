"""Piecewise CUDA graphs: a step's work except attention replayed from graphs, one set per token-count bucket.

A step with prompt tokens (decodes beside a prompt chunk, speculative verify steps, prompts alone) cannot
replay one graph of the whole forward: its attention grid and metadata change with the prompt lengths. All
the rest of a layer (norms, projections, rotary, SiLU-and-mul, MoE routing and experts) works row by row on
T tokens, so it can be captured once for T padded up to a bucket. The forward is captured in pieces split at
its attention calls: piece 0 runs from the embedding to the first layer's q/k/v, piece i from attention i-1's
output to attention i's inputs, the last one to the final norm. A replay runs piece 0, attention 0 eagerly on
the step's real rows (its metadata built per step as in an eager step: any backend, KV groups, fp8 KV
scales), piece 1, ... vLLM's piecewise mode without torch.compile: the attention call itself marks the split.

Invariants: a piece reads only static memory: the token-id and position buffers (rows past the step's n keep
earlier valid values), the outputs of earlier pieces of the same replay, and one attention-output buffer shared
by every layer and bucket (each piece consumes it before the next attention overwrites it). Rows past n are
computed and never read, and never reach the KV cache (attention, which writes K/V, sees the real rows only).
Buckets are captured largest first in one memory pool, and a bucket's pieces replay in capture order (the
pool's rule for sharing memory between graphs). On a CPU (tests) `forward` runs the model eagerly through the
same breakpoints and buffers, so everything but the capture itself is checked in CI.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from kvpilot.model.attention.base import LayerAttention, StepAttention
from kvpilot.model.attention.layout import StepLayout

logger = logging.getLogger(__name__)
# check(): a replay may differ from the eager forward by rounding (padded rows change GEMM tiles), not more
CHECK_TOLERANCE = 0.05


@dataclass
class _Break:
    """One attention call of a captured forward: the inputs the piece before it leaves, the output buffer
    the piece after it reads."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_cache: torch.Tensor
    layer: float | LayerAttention
    out: torch.Tensor


@dataclass
class _Pieces:
    size: int
    graphs: list[Any] = field(default_factory=list)  # torch.cuda.CUDAGraph, len(breaks) + 1; [] on a CPU
    breaks: list[_Break] = field(default_factory=list)
    hidden: torch.Tensor | None = None  # the last piece's output [size, hidden]


class PiecewiseGraphs:
    """The pieces of `model`'s forward for every token count in `sizes`, over shared static inputs."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], sizes: Sequence[int],
                 device: torch.device) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"piecewise CUDA graphs need positive token counts, got {list(sizes)}")
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.sizes = sorted(set(sizes))
        self.token_ids = torch.zeros(self.sizes[-1], dtype=torch.long, device=device)
        self.positions = torch.zeros(self.sizes[-1], dtype=torch.long, device=device)
        self._attention_out: torch.Tensor | None = None  # flat; sized by the first (largest) warm-up
        self._pieces: dict[int, _Pieces] = {}
        self._capturing = False

    def size_for(self, num_tokens: int) -> int | None:
        """The bucket a step of num_tokens replays, or None (eager: more tokens than the largest bucket)."""
        if not self._pieces or num_tokens < 1 or num_tokens > self.sizes[-1]:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, num_tokens)]

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every bucket, largest first (one memory pool: smaller buckets reuse its blocks)."""
        began = time.perf_counter()
        if self.device.type != "cuda":  # CPU: the eager forward through the same breakpoints
            self._pieces = {size: _Pieces(size) for size in self.sizes}
            return
        before = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for size in reversed(self.sizes):
            self._pieces[size] = self._capture_one(size, pool, stream)
        torch.cuda.empty_cache()  # the warm-ups' activations, cached for the side stream alone
        num_graphs = sum(len(p.graphs) for p in self._pieces.values())
        logger.info("CUDA graphs: %d piecewise token counts (%d-%d, %d graphs) captured in %.1f s, %.0f MiB",
                    len(self.sizes), self.sizes[0], self.sizes[-1], num_graphs, time.perf_counter() - began,
                    (torch.cuda.memory_reserved(self.device) - before) / 2**20)

    def _capture_one(self, size: int, pool: Any, stream: "torch.cuda.Stream") -> _Pieces:
        token_ids, positions = self.token_ids[:size], self.positions[:size]
        current = torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):  # compiles the kernels and settles the allocator before capture
            for _ in range(2):
                self.model(token_ids, positions, self.kv_caches, _Breakpoints(self, size))
        current.wait_stream(stream)
        torch.cuda.synchronize(self.device)
        pieces = _Pieces(size)
        recorder = _Breakpoints(self, size, record=(pieces, pool))
        with torch.cuda.stream(stream):
            self._begin_piece(pieces, pool)
            try:
                hidden = self.model(token_ids, positions, self.kv_caches, recorder)
            finally:
                self._end_piece(pieces)
        pieces.hidden = hidden
        return pieces

    def _begin_piece(self, pieces: _Pieces, pool: Any) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool)
        self._capturing = True
        pieces.graphs.append(graph)

    def _end_piece(self, pieces: _Pieces) -> None:
        if self._capturing:
            self._capturing = False
            pieces.graphs[-1].capture_end()

    def attention_out(self, q: torch.Tensor, size: int) -> torch.Tensor:
        """The shared attention-output buffer as [size, *q's head shape] (grown only outside a capture)."""
        needed = size * q[0].numel()
        buffer = self._attention_out
        if buffer is None or buffer.numel() < needed or buffer.dtype != q.dtype:
            if self._capturing:
                raise RuntimeError("piecewise capture: the attention-output buffer must be sized by the warm-up")
            buffer = self._attention_out = torch.zeros(needed, dtype=q.dtype, device=q.device)
        return buffer[:needed].view(size, *q.shape[1:])

    @torch.inference_mode()
    def check(self, step_attention: Callable[[StepLayout], StepAttention], block_size: int, vocab_size: int) -> None:
        """One short prompt through the eager forward and through the smallest bucket's pieces (its K/V written
        into block 0, which nothing holds before the engine's first step): RuntimeError when they differ by more
        than rounding (CHECK_TOLERANCE of the largest value), so a replay that computes something else is never
        served (launch/graphs.py then runs those steps eagerly)."""
        n = max(1, min(self.sizes[0] - 1, block_size))
        layout = StepLayout(np.zeros(1, dtype=np.int64), np.array([n]), np.zeros(1, dtype=np.int64),
                            np.zeros((1, 1), dtype=np.int64), np.arange(n, dtype=np.int64), block_size)
        token_ids = torch.arange(n, device=self.device) % vocab_size
        positions = torch.arange(n, device=self.device)
        eager = self.model(token_ids, positions, self.kv_caches, step_attention(layout)).float()
        replayed = self.forward(token_ids, positions, step_attention(layout), self.sizes[0]).float()
        error = float((replayed - eager).abs().max() / eager.abs().max().clamp_min(1e-6))
        if not error <= CHECK_TOLERANCE:
            raise RuntimeError(f"piecewise graphs replayed a {n}-token prompt {error:.3g} off the eager forward "
                               "(relative to its largest value): not used")

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attn: StepAttention,
                size: int) -> torch.Tensor:
        """Hidden states [n, hidden] of the step's n tokens (n <= size), replaying the pieces of `size` with
        `attn` (the step's eager attention, its metadata built from the real layout) between them."""
        n = token_ids.shape[0]
        self.token_ids[:n].copy_(token_ids)
        self.positions[:n].copy_(positions)
        pieces = self._pieces[size]
        if not pieces.graphs:  # CPU: the same breakpoints, the model run eagerly
            return self.model(self.token_ids[:size], self.positions[:size], self.kv_caches,
                              _Breakpoints(self, size, attn=attn, num_rows=n))[:n]
        for graph, brk in zip(pieces.graphs, pieces.breaks):
            graph.replay()
            brk.out[:n].copy_(attn(brk.q[:n], brk.k[:n], brk.v[:n], brk.kv_cache, brk.layer))
        pieces.graphs[-1].replay()
        return pieces.hidden[:n]  # type: ignore[index]  # set by the capture with the graphs


class _Breakpoints:
    """What the model calls as its StepAttention inside the pieces. With `attn` (CPU replay): attention on the
    first num_rows rows, written into the shared output buffer; with `record` (capture): ends the running
    piece, keeps the call's inputs and starts the next piece; else (warm-up): the buffer as it is."""

    def __init__(self, owner: PiecewiseGraphs, size: int, *, attn: StepAttention | None = None, num_rows: int = 0,
                 record: tuple[_Pieces, Any] | None = None) -> None:
        self.owner, self.size, self.attn, self.num_rows, self.record = owner, size, attn, num_rows, record
        # what the CPU-only paths read of a step (the int8 gate, the fused decode's check); on CUDA: nothing
        self.meta = attn.meta if attn is not None else None
        self.group_metas = attn.group_metas if attn is not None else ()
        self.backend = attn.backend if attn is not None else None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 layer: float | LayerAttention) -> torch.Tensor:
        if self.record is not None:
            pieces, pool = self.record
            self.owner._end_piece(pieces)
            out = self.owner.attention_out(q, self.size)
            pieces.breaks.append(_Break(q, k, v, kv_cache, layer, out))
            self.owner._begin_piece(pieces, pool)
            return out
        out = self.owner.attention_out(q, self.size)
        if self.attn is not None:
            n = self.num_rows
            out[:n].copy_(self.attn(q[:n], k[:n], v[:n], kv_cache, layer))
        return out
