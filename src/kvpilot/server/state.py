"""ServerState: everything the route handlers share, created once per app (no module globals)."""

from __future__ import annotations

import logging

from dataclasses import dataclass, field
from typing import Any

from kvpilot.server.admission import AdmissionController
from kvpilot.server.config import ServerArgs
from kvpilot.server.core.engine_client import EngineClient
from kvpilot.server.core.engine_info import EngineInfo
from kvpilot.server.openai.auto_tool_choice import AutoToolChoice, decide_auto_tool_choice
from kvpilot.server.openai.errors import APIError
from kvpilot.server.openai.harmony_parser import HARMONY_REASONING_PARSER, harmony_start_note, has_harmony_markers
from kvpilot.server.observe.metrics import ServerMetrics
from kvpilot.server.tokenizer_pool import TokenizerPool
from kvpilot.server.observe.tracing import NullTracer
from kvpilot.structured_outputs.admission import GrammarAdmission


MAX_ECHOED_MODEL_CHARS = 256  # an unknown model name is echoed back at most this long (it is client input)


logger = logging.getLogger("kvpilot.server")

class NotReadyError(RuntimeError):
    """A handler read the engine's facts before the engine was ready: call check_serving() first."""


@dataclass
class ServerState:
    """Invariant: `draining` only goes False -> True; once True, no request is admitted. `info` and
    `tokenizer` are read only after the engine is ready (check_serving)."""

    args: ServerArgs
    client: EngineClient
    metrics: ServerMetrics
    admission: AdmissionController
    draining: bool = False
    tokenizer_pool: TokenizerPool = field(default_factory=TokenizerPool)  # shut down by the app's lifespan
    tracer: NullTracer = field(default_factory=NullTracer)  # RequestTracer with --otlp-traces-endpoint
    _grammars: GrammarAdmission | None = field(default=None, repr=False)
    _auto_tool_choice: AutoToolChoice | None = field(default=None, repr=False)

    @property
    def info(self) -> EngineInfo:
        if self.client.info is None:
            raise NotReadyError("the engine is not ready: check_serving() first")
        return self.client.info

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer, sent by the core at start (None for a model without one)."""
        return self.client.tokenizer

    def grammar_admission(self) -> GrammarAdmission:
        """Structured-outputs admission for the engine's tokenizer (made on first use, once the engine is ready;
        its tokenizer view is built by its first probe, in the tokenizer pool)."""
        if self._grammars is None:
            tokenizer = self.tokenizer
            self._grammars = GrammarAdmission(tokenizer, self.info.vocab_size, getattr(tokenizer, "eos_token_ids", ()))
        return self._grammars

    def warm_grammars(self) -> None:
        """GrammarAdmission's one-time set-up, run as the engine turns ready (before /health says 200)."""
        self.grammar_admission().warm()

    def auto_tool_choice(self) -> AutoToolChoice:
        """Whether chat tool_choice "auto" is served and by which parser: decided on first use, once the engine
        is ready, from the flags and the model's chat template (auto_tool_choice.py)."""
        if self._auto_tool_choice is None:
            args = self.args
            self._auto_tool_choice = decide_auto_tool_choice(args.enable_auto_tool_choice, args.tool_call_parser,
                                                             self.tokenizer)
        return self._auto_tool_choice

    def reasoning_parser(self) -> str | None:
        """--reasoning-parser; without it, openai_gptoss for a model whose tokenizer has harmony's markers
        (gpt-oss: vLLM reads its channels without a flag too). Read only once the engine is ready."""
        if self.args.reasoning_parser is None and has_harmony_markers(self.tokenizer):
            return HARMONY_REASONING_PARSER
        return self.args.reasoning_parser

    def _note_harmony(self) -> None:
        """Says once at start which flags apply to a gpt-oss model."""
        if has_harmony_markers(self.tokenizer):
            note = harmony_start_note(self.args.reasoning_parser, self.auto_tool_choice().parser)
            if note is not None:
                logger.info("kvpilot serve: %s", note)

    def on_engine_ready(self) -> None:
        """Runs as the engine turns ready, just before /health says 200: the grammar set-up, the tool_choice
        "auto" decision, then the one line that tells a user the server answers now."""
        try:
            self.warm_grammars()
            self._note_harmony()
            logger.info("kvpilot serve: %s", self.auto_tool_choice().log_line())
        finally:
            args, info = self.args, self.info
            logger.info("kvpilot serve: ready at http://%s:%d/v1 (model %s, max_model_len %d, %d KV blocks of %d "
                        "tokens)", args.host, args.port, args.model_name, info.max_model_len, info.kv.num_blocks,
                        info.kv.block_size)

    def check_serving(self) -> None:
        """503 while the engine loads, after it failed, or while draining."""
        if self.draining:
            self.metrics.reject("draining")
            raise APIError(503, "the server is shutting down (draining): send the request to another replica",
                           code="draining")
        self.check_ready()

    def check_ready(self) -> None:
        """503 while the engine loads or after it failed (ops endpoints keep working while draining)."""
        if self.client.error is not None:
            raise APIError(503, f"the engine failed: {self.client.error}; restart the server", code="engine_failed")
        if not self.client.ready.is_set():
            self.metrics.reject("loading")
            raise APIError(503, "the model is still loading: retry when GET /health returns 200", code="loading",
                           headers={"Retry-After": "5"})

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.args.served_model_names:
            self.metrics.reject("unknown_model")
            shown = model if len(model) <= MAX_ECHOED_MODEL_CHARS else model[:MAX_ECHOED_MODEL_CHARS] + "..."
            raise APIError(404, f"the model {shown!r} does not exist here; this server serves "
                                f"{', '.join(self.args.served_model_names)} (see GET /v1/models)",
                           param="model", code="model_not_found")
