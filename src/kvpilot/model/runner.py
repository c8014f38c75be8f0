"""ModelRunner: executes the scheduler's step diffs over the paged KV cache.

One step: apply the diff to the persistent batch -> gather inputs (vectorized) -> attention backend builds
its metadata -> forward -> logits processors -> sample on the device. The sampled ids go to the host in one
copy, when the engine reads the step's result (StepResult.result()), which it may do after launching the
next step (async scheduling): the next step takes those ids on the device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

import numpy as np
import torch

from kvpilot.engine.kv_groups import KVGroupPlan
from kvpilot.engine.scheduler_output import NewRequestData, RunnerOutput, SchedulerOutput
from kvpilot.model.attention import StepAttention
from kvpilot.model.attention.layout import StepLayout
from kvpilot.model.attention.selector import model_attention_features, select_attention_backend
from kvpilot.model.cuda_graphs import DecodeGraphs
from kvpilot.model.piecewise_graphs import PiecewiseGraphs
from kvpilot.model.device_staging import PackedArrays
from kvpilot.model.errors import ModelLoadError
from kvpilot.model.grammar_compiler import GrammarCompiler
from kvpilot.model.grammar_state import GrammarState
from kvpilot.model.host_copy import HostCopy
from kvpilot.model.input_batch import BatchLimits, InputBatch
from kvpilot.model.kv_cache import allocate_kv_cache
from kvpilot.model.kv_dtype import FP8_DTYPES
from kvpilot.model.kv_offload import BesideCopy, KVOffloadStore, OffloadSpec
from kvpilot.model.kv_scales import KvScales, make_kv_scales
from kvpilot.model.kv_transfer import write_blocks
from kvpilot.model.loader import LoadedModel
from kvpilot.model.logit_bias import LogitBiasState
from kvpilot.model.logits_processors import PenaltyState, apply_min_tokens
from kvpilot.model.sampler import (Logprobs, SamplingBatch, compute_logprobs, greedy_ids_of, sample,
                                   sampled_logprobs)
from kvpilot.model.step_inputs import PreviousSample, StepInputs, build_step_inputs
from kvpilot.model.verification import (Verification, expanded_generators, finish_verification,
                                        plan_verification)
from kvpilot.model.verify_inputs import build_verify_inputs

if TYPE_CHECKING:
    from kvpilot.model.parallel.group import TPGroup


@dataclass(frozen=True)
class RunnerLimits:
    """Sizes the runner's persistent buffers are allocated for (the scheduler never exceeds them)."""

    max_num_seqs: int = 256
    max_model_len: int | None = None  # None: the model's max_position_embeddings


class DraftFiller(Protocol):
    """A model-side proposer whose drafts are computed when the step runs (model/draft_proposer.py): fill()
    writes them into the step's SchedulerOutput.draft_token_ids lists, in place, before the verification. One
    with an observe(chunks, draft_token_ids, hidden, aux_hidden) method (model/eagle_proposer.py) is also
    handed each step's hidden states after the forward."""

    def fill(self, draft_token_ids: dict[str, list[int]]) -> None: ...


class StepResult:
    """A launched step. Its sampled ids (and logprobs) start for the host when it launches (HostCopy);
    result() waits for them, commits them to the persistent batch and returns the RunnerOutput; later calls
    return the same object. `failed`: the requests the runner failed alone in this step (request id -> why),
    set before result() is first called. `verification`: a step that verified drafts (its sampled ids hold
    several rows per such request: model/verification.py decides what is accepted)."""

    def __init__(self, runner: "ModelRunner | None" = None, request_ids: Sequence[str] = (),
                 rows: np.ndarray | None = None, positions: np.ndarray | None = None,
                 token_ids: torch.Tensor | None = None, num_top: Sequence[int] = (),
                 logprobs: Logprobs | None = None, num_removed: int | None = None,
                 verification: Verification | None = None) -> None:
        self.failed: dict[str, str] = {}
        self.draft_seconds = 0.0  # what the draft model's fill took in this step (RunnerOutput.draft_seconds)
        self.beside_seconds = 0.0  # what the step's beside loads' copy took (RunnerOutput.beside_seconds)
        self._verification = verification
        self._runner, self._request_ids, self._rows, self._positions = runner, list(request_ids), rows, positions
        self._num_removed = num_removed  # the batch's count of freed rows at launch (InputBatch.commit)
        # num_top: per sampled row, the top-N logprobs it asked for (-1: none); read only with logprobs
        self._num_top, self._has_logprobs = list(num_top), logprobs is not None
        tensors = [] if token_ids is None else [token_ids]
        if logprobs is not None:
            tensors += [logprobs.chosen, logprobs.top_values, logprobs.top_ids]
        self._copy = HostCopy(tensors) if tensors else None
        self._output: RunnerOutput | None = None

    def result(self) -> RunnerOutput:
        if self._output is None and not self._request_ids:
            self._output = RunnerOutput(failed=self.failed, draft_seconds=self.draft_seconds,
                                        beside_seconds=self.beside_seconds)
        if self._output is None:
            assert self._copy is not None and self._positions is not None and self._rows is not None \
                and self._runner is not None
            host = self._copy.wait()  # the step's one wait for the device
            ids, verification = host[0].tolist(), self._verification
            first = host[0].numpy() if verification is None else np.array(
                [ids[o] for o in verification.offsets], dtype=np.int64)
            batch = self._runner.batch
            batch.commit(self._request_ids, self._rows, self._positions, first, self._num_removed)
            verified = {} if verification is None else finish_verification(
                batch, verification, self._request_ids, self._rows, self._positions, ids, self._runner.device)
            ids = ids if verification is None else first.tolist()
            logprobs = sampled_logprobs(self._request_ids, ids, self._num_top, Logprobs(*host[1:])) \
                if self._has_logprobs else {}
            self._output = RunnerOutput(dict(zip(self._request_ids, ids)), logprobs, self.failed, verified,
                                        self.draft_seconds, self.beside_seconds)
        return self._output


class ModelRunner:
    """Owns the model, its KV cache and the persistent batch. Not thread-safe: one engine loop drives it.

    Invariants: block ids in the diffs are < num_blocks (the KV manager owns which block is whose); the
    persistent batch holds exactly the requests scheduled since their admission and not yet reported
    finished or preempted.
    """

    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int,
                 kv_dtype: torch.dtype | None = None, *, limits: RunnerLimits = RunnerLimits(),
                 attention_backend: str = "auto", eos_token_ids: Sequence[int] = (),
                 tp: "TPGroup | None" = None, offload: OffloadSpec | None = None,
                 kv_groups: KVGroupPlan | None = None, calibrate_kv_scales: bool = True) -> None:
        """kv_dtype: how K/V are stored (None: the model's dtype). eos_token_ids: masked until min_tokens.
        tp: the tensor-parallel group of a sharded model: every rank takes rank 0's sampled ids.
        offload: the KV offload tiers to allocate (model/kv_offload.py; each TP rank its own share).
        kv_groups: how layers share the cache (engine/kv_groups.py; None: one group, the engine's plan must
        then be one group too): a cache tensor per slot, layer i's the one of its slot. An fp8 cache gets
        per-layer, per-head scales (model/kv_scales.py): the checkpoint's (loaded.kv_cache_scales), else from the
        first serving step's K/V unless calibrate_kv_scales is False (then 1: K/V another process writes or
        reads, or vLLM's default)."""
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_dtype = kv_dtype or loaded.dtype
        self.vocab_size = loaded.config.vocab_size
        # a backend that cannot compute a layer's variant (window, soft-cap, sinks) is refused here, at load
        self.attention = select_attention_backend(attention_backend, loaded.device, loaded.dtype, self.kv_dtype,
                                                  needed=model_attention_features(loaded.model))
        config = loaded.config
        shape = self.attention.kv_cache_shape(num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.kv_groups = kv_groups or config.kv_group_plan(hybrid=False)
        slots = allocate_kv_cache(shape, self.kv_groups.num_slots, self.kv_dtype, loaded.device)
        self.kv_caches = [slots[slot] for slot in self.kv_groups.layer_slots]
        self._kv_scales = make_kv_scales(self.model, loaded.dtype, loaded.device,
                                         frozen_at_one=not calibrate_kv_scales,
                                         checkpoint=loaded.kv_cache_scales) if self.kv_dtype in FP8_DTYPES else {}
        self.offload = KVOffloadStore(self.kv_caches, offload) if offload is not None else None
        max_model_len = limits.max_model_len or config.max_position_embeddings
        self.batch = InputBatch(BatchLimits(limits.max_num_seqs, max_model_len, block_size,
                                            self.kv_groups.num_groups))
        self.penalties = PenaltyState(limits.max_num_seqs, self.vocab_size, loaded.device)
        self.eos_token_ids = tuple(t for t in eos_token_ids if 0 <= t < self.vocab_size)
        self.logit_bias = LogitBiasState(limits.max_num_seqs)
        self.grammars = GrammarState(limits.max_num_seqs,
                                     GrammarCompiler(loaded.tokenizer, self.vocab_size, self.eos_token_ids),
                                     loaded.device)
        self._generators: dict[str, torch.Generator] = {}  # per-request seeded streams
        self._previous: PreviousSample | None = None
        self.graphs: DecodeGraphs | None = None  # set by capture_decode_graphs (CUDA)
        self.piecewise: PiecewiseGraphs | None = None  # set by capture_piecewise_graphs (CUDA)
        self.drafter: DraftFiller | None = None  # the draft model's proposer (speculative_config draft_model)
        self.tp = tp
        # CUDA: a step's integer inputs travel in one asynchronous copy (no wait for the step before)
        self._staging = PackedArrays(loaded.device) if loaded.device.type == "cuda" else None
        self._sampling_staging = PackedArrays(loaded.device, dtype=torch.float32) if self._staging else None

    # ---- the diff -----------------------------------------------------------------------------------

    def _add(self, new: NewRequestData) -> None:
        row = self.batch.add(new)
        self.penalties.add(row, new.sampling_params, new.prompt_token_ids, new.output_token_ids)
        params = new.sampling_params
        self.logit_bias.add(row, params)
        self.grammars.add(row, new.request_id, params, new.output_token_ids)  # a failure: reported, never raised
        if params.seed is not None and not params.is_greedy and new.request_id not in self._generators:
            self._generators[new.request_id] = torch.Generator(device=self.device).manual_seed(params.seed)

    def _drop(self, request_ids: Sequence[str], finished: bool) -> None:
        """Frees the rows; a preempted request keeps its seeded stream, to continue it when resumed."""
        for request_id in request_ids:
            row = self.batch.remove(request_id)
            if row is not None:
                self.penalties.remove(row)
                self.logit_bias.remove(row)
                self.grammars.remove(row)
            if finished:
                self._generators.pop(request_id, None)

    def apply_diff(self, output: SchedulerOutput) -> np.ndarray:
        """Updates the persistent batch; returns the persistent rows of the step's chunks, in chunk order."""
        self._drop(output.finished_request_ids, finished=True)
        self._drop(output.preempted_request_ids, finished=False)
        for new in output.new_requests:
            self._add(new)
        if output.trimmed_tables:  # before this step's new blocks are appended
            self.batch.trim_blocks(output.trimmed_tables)
        running_rows = self.batch.update(output.running_requests)
        if len(running_rows) == len(output.chunks):  # the running requests' chunks, in order (SchedulerOutput)
            return running_rows
        rows = self.batch.rows
        return np.fromiter((rows[c.request_id] for c in output.chunks), dtype=np.int64, count=len(output.chunks))

    # ---- one step -----------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, output: SchedulerOutput) -> StepResult:
        """Applies the diff and launches the step (on CPU it runs to completion here). Requests whose grammar
        failed in it are failed alone (StepResult.failed), not raised: their step mates go on."""
        self._draft_seconds = 0.0
        beside = self._copy_offload(output)
        beside_seconds = 0.0
        try:
            step = self._execute(output)
        finally:
            if beside is not None:  # a prefetch's loads ran beside the forward (model/kv_offload.py)
                beside_seconds = beside.wait()
        step.failed = self.grammars.take_failures()
        step.draft_seconds = self._draft_seconds
        step.beside_seconds = beside_seconds
        return step

    def _execute(self, output: SchedulerOutput) -> StepResult:
        rows = self.apply_diff(output)
        if not output.chunks:
            return StepResult()
        verification = None
        if self.drafter is not None:  # every step: proposals the scheduler did not schedule are dropped too
            start = time.perf_counter()
            self.drafter.fill(output.draft_token_ids)
            self._draft_seconds = time.perf_counter() - start
        if output.draft_token_ids:  # speculative decoding: verify the drafts (model/verify_inputs.py)
            inputs = build_verify_inputs(self.batch, output.chunks, rows, output.draft_token_ids, self.device,
                                         self._staging)
            assert inputs.sample_counts is not None
            verification = plan_verification(inputs.sample_counts, inputs.sample_request_ids,
                                             output.draft_token_ids, self._generators)
        else:
            inputs = build_step_inputs(self.batch, output.chunks, rows, self._previous, self.device, self._staging,
                                       decodes=output.is_all_decode)
        hidden = self._forward_hidden(inputs, calibrate=True)
        observe = getattr(self.drafter, "observe", None)
        if observe is not None:  # an EAGLE head drafts from the target's hidden states (model/eagle_proposer.py)
            observe(output.chunks, output.draft_token_ids, hidden, getattr(self.model, "aux_hidden", None))
        if not inputs.sample_request_ids:
            return StepResult()
        sampled = hidden[inputs.sample_rows]
        if self._argmax_only():  # the common case: a few checks instead of nine no-op calls a step
            return self._greedy(inputs, sampled, verification)
        return self._sample(inputs, self.model.logits(sampled), verification)

    def _copy_offload(self, output: SchedulerOutput) -> BesideCopy | None:
        """The step's KV offload copies (saves of blocks about to be reused, loads of prefix hits found in a
        tier), then K/V pulled from a prefill worker (disaggregation, model/kv_transfer.py: after the saves,
        which read what its new blocks held), before anything of the step writes or reads the cache; then
        starts the loads that run beside the forward (a waiting request's prefetch), whose copy the caller
        waits for."""
        beside = None
        if output.offload is not None:
            if self.offload is None:
                raise RuntimeError("the scheduler ordered KV offload copies, but this runner has no offload tier")
            self.offload.execute(self.kv_caches, output.offload)
            if output.offload.has_beside_loads:
                beside = self.offload.start_beside(self.kv_caches, output.offload)
        for load in output.kv_loads:
            write_blocks(self.kv_caches, load.block_ids, load.data)
        return beside

    @torch.inference_mode()
    def forward_logits(self, output: SchedulerOutput) -> tuple[list[str], torch.Tensor]:
        """Applies the diff and runs the forward only: (request ids needing a sample, float32 logits [N, V]).
        For tests and memory profiling; the sampled tokens are not recorded."""
        beside = self._copy_offload(output)
        if beside is not None:
            beside.wait()
        rows = self.apply_diff(output)
        inputs = build_step_inputs(self.batch, output.chunks, rows, self._previous, self.device, self._staging)
        return inputs.sample_request_ids, self._forward_logits(inputs)

    def capture_decode_graphs(self, sizes: Sequence[int], max_num_batched_tokens: int) -> None:
        """Captures CUDA graphs of decode steps at these batch sizes (kvpilot.model.cuda_graphs); later decode
        steps of at most max(sizes) rows replay them. Needs a backend that packs its metadata at fixed
        addresses (triton); ModelLoadError otherwise."""
        if not hasattr(self.attention, "freeze"):
            raise ModelLoadError(f"CUDA graphs need the triton attention backend, not {self.attention.name}: "
                                 "use --attention-backend triton (or auto), or --enforce-eager")
        limits = self.batch.limits
        self.attention.reserve(limits.max_num_seqs, max_num_batched_tokens, limits.max_blocks_per_seq, self.device)
        graphs = DecodeGraphs(self.model, self.attention, self.kv_caches, sizes, self.block_size,
                              limits.max_blocks_per_seq, limits.max_model_len, self.device,
                              kv_scales=self._kv_scales or None)
        graphs.capture()
        self.graphs = graphs

    def capture_piecewise_graphs(self, sizes: Sequence[int]) -> None:
        """Captures the forward's pieces between attention calls at these token counts
        (kvpilot.model.piecewise_graphs); later steps the decode graphs do not take, of at most max(sizes)
        tokens, replay them with attention run eagerly. Any attention backend."""
        piecewise = PiecewiseGraphs(self.model, self.kv_caches, sizes, self.device)
        piecewise.capture()
        piecewise.check(self.step_attention, self.block_size, self.vocab_size)
        self.piecewise = piecewise

    def _forward_hidden(self, inputs: StepInputs, calibrate: bool = False) -> torch.Tensor:
        """The last layer's normed hidden states [T, hidden] of the step's tokens (calibrate: a serving step,
        whose K/V may set the fp8 KV scales in its attention: eager, also between piecewise graphs; a replayed
        decode graph never does, but the first step, which has a prompt, is not one)."""
        size = self.graphs.size_for(inputs.layout) if self.graphs is not None else None
        if size is not None:
            return self.graphs.forward(inputs.token_ids, inputs.positions, inputs.layout, size)
        attn = self.step_attention(inputs.layout, calibrate)
        bucket = self.piecewise.size_for(inputs.layout.num_tokens) if self.piecewise is not None else None
        if bucket is not None:
            return self.piecewise.forward(inputs.token_ids, inputs.positions, attn, bucket)
        return self.model(inputs.token_ids, inputs.positions, self.kv_caches, attn)

    def step_attention(self, layout: StepLayout, calibrate: bool = False) -> StepAttention:
        """The attention backend bound to this step's metadata: one per KV group when there are several."""
        scales = self._kv_scales or None
        if layout.num_groups == 1:
            return StepAttention(self.attention, self.attention.build(layout, self.device), kv_scales=scales,
                                 calibrate=calibrate)
        metas = [self.attention.build(layout.for_group(g), self.device, group=g) for g in range(layout.num_groups)]
        return StepAttention(self.attention, metas[0], metas, kv_scales=scales, calibrate=calibrate)

    @property
    def kv_scales(self) -> list[KvScales]:
        """The fp8 KV cache's scales, one per layer in layer order ([] for another KV dtype)."""
        return list(self._kv_scales.values())

    def _forward_logits(self, inputs: StepInputs) -> torch.Tensor:
        hidden = self._forward_hidden(inputs)
        if not inputs.sample_request_ids:
            return hidden.new_empty((0, self.vocab_size), dtype=torch.float32)
        return self.model.logits(hidden[inputs.sample_rows])

    def _greedy(self, inputs: StepInputs, hidden: torch.Tensor, verification: Verification | None) -> StepResult:
        """_argmax_only steps: the output head's argmax of the sampled rows' hidden states, straight from the head
        where it can (a packed tiled head: no [rows, vocab] logits written and read back), else of the logits."""
        token_ids = self.model.greedy_ids(hidden) if self.tp is None else None
        if token_ids is None:
            token_ids = greedy_ids_of(self.model.logits(hidden))
        if self.tp is not None:
            self.tp.broadcast(token_ids)
        return self._launched(inputs, token_ids, verification=verification)

    def _sample(self, inputs: StepInputs, logits: torch.Tensor, verification: Verification | None) -> StepResult:
        """Processors and sampling over the sampled rows (a verification's: one per position, each its
        request's settings and, seeded, the next uniform of its stream)."""
        rows, batch = inputs.logit_batch_rows, self.batch
        logits = self.penalties.apply(logits, rows)
        logits = self.logit_bias.apply(logits, rows)
        logits = apply_min_tokens(logits, self._banned(rows))
        logits = self.grammars.apply(logits, rows)  # last: a disallowed token stays -inf whatever the bias
        generators = self._row_generators(inputs, verification)
        if batch.num_sampling:
            sampling = SamplingBatch.from_columns(batch.temperature[rows], batch.top_k[rows], batch.top_p[rows],
                                                  batch.min_p[rows], generators, self.vocab_size, self.device,
                                                  self._sampling_staging)
        else:  # every held row is greedy: no columns to gather
            sampling = SamplingBatch.greedy(generators, self.device)
        token_ids = sample(logits, sampling)
        if self.tp is not None:  # the ranks' persistent batches must see the same tokens
            self.tp.broadcast(token_ids)
        self.penalties.record(rows, token_ids)  # (never a verifying request's: speculator.speculation_eligible)
        self.grammars.record(rows, token_ids)
        if batch.num_with_logprobs:
            num_top = batch.num_logprobs[inputs.sample_batch_rows].tolist()
            if verification is not None:  # a request with logprobs has no drafts: its one row is its first
                first = torch.tensor(verification.offsets, device=logits.device)
                logits, chosen = logits[first], token_ids[first]
            else:
                chosen = token_ids
            logprobs = compute_logprobs(logits, chosen, max(num_top)) if max(num_top) >= 0 else None
        else:
            num_top, logprobs = [], None
        return self._launched(inputs, token_ids, num_top, logprobs, verification)

    def _row_generators(self, inputs: StepInputs, verification: Verification | None) -> dict[int, torch.Generator]:
        """Sampled row -> its request's seeded generator (rows of unseeded requests draw from the global one)."""
        if not self._generators:
            return {}
        if verification is not None:
            return expanded_generators(verification, inputs.sample_request_ids, self._generators)
        return {i: self._generators[r] for i, r in enumerate(inputs.sample_request_ids) if r in self._generators}

    def _argmax_only(self) -> bool:
        """Every held row greedy, with no penalties, logit bias, min_tokens, grammar or logprobs: the sampled
        tokens are the logits' argmax, whatever the rows."""
        batch = self.batch
        return not (batch.num_sampling or batch.num_min_tokens or batch.num_with_logprobs or self.penalties.num_active
                    or self.logit_bias.num_active or self.grammars.num_active)

    def _launched(self, inputs: StepInputs, token_ids: torch.Tensor, num_top: Sequence[int] = (),
                  logprobs: Logprobs | None = None, verification: Verification | None = None) -> StepResult:
        """Records the step's sampled tokens as placeholders in the persistent batch (one per request: a
        verification's further tokens are appended when its result is read); their ids reach the host
        through the returned StepResult."""
        rows, batch = inputs.sample_batch_rows, self.batch
        # a verifying step is never followed by one launched before its result is read (synchronous scheduling)
        self._previous = PreviousSample(token_ids, rows) if verification is None else None
        positions = batch.append_placeholders(rows)
        return StepResult(self, inputs.sample_request_ids, rows, positions, token_ids, num_top, logprobs,
                          batch.num_removed, verification)

    def _banned(self, rows: np.ndarray) -> list[list[int]]:
        """Per sampled row, the tokens min_tokens forbids now (EOS unless ignore_eos, and stop tokens)."""
        if not self.batch.num_min_tokens:
            return []
        short = self.batch.num_output[rows] < self.batch.min_tokens[rows]
        if not short.any():
            return []
        banned: list[list[int]] = []
        for i, row in enumerate(rows.tolist()):
            params = self.batch.params[row]
            if not short[i] or params is None:
                banned.append([])
                continue
            ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
            banned.append(sorted(t for t in ids if 0 <= t < self.vocab_size))
        return banned
