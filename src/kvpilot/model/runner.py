"""ModelRunner: one step = scheduled chunks -> flattened tensors -> forward over the paged KV cache -> logits."""

from __future__ import annotations

from typing import Sequence

import torch

from kvpilot.model.batch_builder import ChunkLike, build_model_input
from kvpilot.model.kv_cache import allocate_kv_cache
from kvpilot.model.layers.cpu_decode_kernel import kernel_applies
from kvpilot.model.loader import LoadedModel
from kvpilot.model.logits_processors import TokenHistory, apply_min_tokens, apply_penalties
from kvpilot.model.sampler import SampleResult, SamplingBatch, gather_logprobs, sample
from kvpilot.sampling_params import SamplingParams


class ModelRunner:
    """Owns the model and its KV cache. Not thread-safe: one engine loop drives it.

    Invariant: block ids in chunks are < num_blocks; the caller (KV manager) owns which block is whose.
    """

    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int,
                 kv_dtype: torch.dtype | None = None) -> None:
        """kv_dtype: how K/V are stored (None: the model's dtype)."""
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_dtype = kv_dtype or loaded.dtype
        self.kv_caches = allocate_kv_cache(loaded.config, num_blocks, block_size, self.kv_dtype, loaded.device)
        self.decode_kernel = kernel_applies(loaded.device, loaded.dtype, self.kv_dtype)  # decode attention in C++
        self._generators: dict[str, torch.Generator] = {}  # per-request seeded streams
        tokenizer_eos = loaded.tokenizer.eos_token_ids if loaded.tokenizer else ()
        self.eos_token_ids = tuple(dict.fromkeys([*tokenizer_eos, *loaded.config.eos_token_ids]))

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator | None:
        if params.seed is None or params.is_greedy:
            return None
        generator = self._generators.get(request_id)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
            self._generators[request_id] = generator
        return generator

    def release(self, request_ids: Sequence[str]) -> None:
        """Drops per-request state (seeded generators) of finished requests."""
        for request_id in request_ids:
            self._generators.pop(request_id, None)

    def execute_and_sample(self, chunks: Sequence[ChunkLike],
                           requests: dict[str, TokenHistory]) -> dict[str, SampleResult]:
        """Runs one step and samples a token for every chunk that needs one: {request_id: SampleResult}.

        `requests` gives each request's sampling params and token history (for penalties and min_tokens).
        """
        request_ids, logits = self.execute(chunks)
        if not request_ids:
            return {}
        histories = [requests[r] for r in request_ids]
        params = [h.sampling_params for h in histories]
        logits = apply_penalties(logits, histories)
        logits = apply_min_tokens(logits, histories, self.eos_token_ids)
        batch = SamplingBatch.build(params, [self._generator(r, p) for r, p in zip(request_ids, params)],
                                    logits.shape[-1], logits.device)
        results = gather_logprobs(logits, sample(logits, batch), [p.logprobs for p in params])
        return dict(zip(request_ids, results))

    @torch.inference_mode()
    def execute(self, chunks: Sequence[ChunkLike]) -> tuple[list[str], torch.Tensor]:
        """Runs the chunks; returns (request ids needing a sample, their float32 logits [N, vocab])."""
        inp = build_model_input(chunks, self.block_size, self.device, self.decode_kernel)
        hidden = self.model(inp.token_ids, inp.positions, self.kv_caches, inp.meta)
        if not inp.sample_request_ids:
            return [], hidden.new_empty((0, self.loaded.config.vocab_size), dtype=torch.float32)
        return inp.sample_request_ids, self.model.logits(hidden[inp.sample_rows])
