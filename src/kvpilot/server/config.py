"""ServerArgs: the HTTP-side settings of `kvpilot serve` (the engine's live in EngineArgs)."""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1024 * 1024
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * MIB  # ~8M tokens of text: far above any max_model_len kvpilot serves
DEFAULT_MAX_NUM_QUEUED_REQS = 512  # `kvpilot serve` derives its default from --max-num-seqs (cli.py)
DEFAULT_MAX_TOKENS_DEFAULT = 1024  # a request without max_tokens stops here (vLLM: all of max_model_len)


def served_names(names: list[str] | None, model: str | None) -> tuple[str, ...]:
    """vLLM's default: the --model argument as given; for the embedded model, its name."""
    if names:
        return tuple(names)
    if model is None:
        from kvpilot.model.default_model import DEFAULT_MODEL_NAME

        return (DEFAULT_MODEL_NAME,)
    return (model.removeprefix("dummy:") if model.startswith("dummy:") else model,)


class ServerConfigError(ValueError):
    """A server flag is out of range; the message names the flag and what to change."""


@dataclass(frozen=True, kw_only=True)
class ServerArgs:
    """Server settings, named like `vllm serve`'s flags where the concept is the same.

    Invariants: max_num_queued_reqs / max_num_queued_tokens are None (unbounded) or >= 1 and bound the
    requests admitted but not yet running; drain_timeout >= 0 seconds; served_model_names is non-empty
    (the first is the one reported); stats_interval > 0 seconds. engine_process: the engine core runs in its
    own process (default); False runs it in a thread of the server process (`--no-engine-process`), as does
    a factory holding weights already loaded in this process (engine_factory(args, loaded)).

    api_key is None (no auth) or a non-empty string: with it every route but /health needs
    `Authorization: Bearer <key>`, /metrics and /dashboard too unless metrics_public. max_request_body_bytes >= 1 bounds a
    request body (413 beyond it); a client has header_timeout_s to send its request line and headers and
    body_timeout_s to send its whole body (then 408 and the connection is closed); keep_alive_timeout_s is
    how long an idle connection stays open between requests.
    otlp_traces_endpoint is None (no tracing) or the URL of an OTLP/HTTP collector that gets one span per
    finished request (checked, with the packages it needs, when the app is created: tracing.py).

    max_tokens_default is None (no cap: a request without max_tokens may fill max_model_len, as in vLLM) or
    >= 1: the most tokens a request that names no max_tokens generates (finish_reason "length" there).

    enable_auto_tool_choice: whether chat tool_choice "auto" (the default with tools) is served, the output left
    free and tool calls read out of it by a parser. True needs `tool_call_parser` (a key of
    tool_parsers.TOOL_CALL_PARSERS); False: "auto" is a 400, as in vLLM without the flag; None (the default):
    on with `tool_call_parser` when it is set, else as the model's chat template allows (auto_tool_choice.py,
    decided when the engine is ready).

    reasoning_parser: None (a chat's text is its content; for a model with harmony's markers, gpt-oss, the
    harmony reading: ServerState.reasoning_parser) or a key of reasoning_parser.REASONING_PARSERS (a chat's
    `<think>` block is split off as `reasoning` / `reasoning_content`: openai/chat_output.py) or
    `openai_gptoss` (gpt-oss's analysis channel is the reasoning: openai/harmony_parser.py).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = ("kvpilot",)
    api_key: str | None = None
    metrics_public: bool = False
    max_num_queued_reqs: int | None = DEFAULT_MAX_NUM_QUEUED_REQS
    max_num_queued_tokens: int | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0
    drain_timeout: float = 30.0
    log_prompts: bool = False
    stats_interval: float = 5.0
    engine_process: bool = True
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP collector for request spans (tracing.py)
    max_tokens_default: int | None = DEFAULT_MAX_TOKENS_DEFAULT
    enable_auto_tool_choice: bool | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                flag = "--" + name.replace("_", "-")
                raise ServerConfigError(f"{flag} must be >= 1 (or 0 for no limit), got {value}")
        if self.api_key is not None and not self.api_key.strip():
            raise ServerConfigError("--api-key is empty: give a non-empty key (e.g. `openssl rand -hex 16`), or "
                                    "leave --api-key out (and KVPILOT_API_KEY unset) to serve without auth")
        if self.max_tokens_default is not None and self.max_tokens_default < 1:
            raise ServerConfigError(f"--max-tokens-default must be >= 1 (or 0 for no cap), got "
                                    f"{self.max_tokens_default}")
        if self.max_request_body_bytes < 1:
            raise ServerConfigError(f"--max-request-body-bytes must be >= 1, got {self.max_request_body_bytes}")
        for name, flag in (("header_timeout_s", "--header-timeout"), ("body_timeout_s", "--body-timeout"),
                           ("keep_alive_timeout_s", "--keep-alive-timeout")):
            if getattr(self, name) <= 0:
                raise ServerConfigError(f"{flag} must be > 0 seconds, got {getattr(self, name)}")
        if self.drain_timeout < 0:
            raise ServerConfigError(f"--drain-timeout must be >= 0 seconds, got {self.drain_timeout}")
        if not self.served_model_names:
            raise ServerConfigError("--served-model-name needs at least one name")
        if self.stats_interval <= 0:
            raise ServerConfigError(f"stats_interval must be > 0 seconds, got {self.stats_interval}")
        self._check_tool_call_parser()
        self._check_reasoning_parser()

    def _check_tool_call_parser(self) -> None:
        from kvpilot.server.openai.tool_parsers import TOOL_CALL_PARSERS

        known = ", ".join(TOOL_CALL_PARSERS)
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ServerConfigError(f"--tool-call-parser {self.tool_call_parser!r} is not one kvpilot has: use "
                                    f"one of {known}")
        if self.enable_auto_tool_choice is True and self.tool_call_parser is None:
            raise ServerConfigError(f"--enable-auto-tool-choice needs --tool-call-parser too (one of {known}): "
                                    "it reads the tool calls out of the model's text")

    def _check_reasoning_parser(self) -> None:
        from kvpilot.server.openai.harmony_parser import HARMONY_REASONING_PARSER
        from kvpilot.server.openai.reasoning_parser import REASONING_PARSERS

        known = (*REASONING_PARSERS, HARMONY_REASONING_PARSER)
        if self.reasoning_parser is not None and self.reasoning_parser not in known:
            raise ServerConfigError(f"--reasoning-parser {self.reasoning_parser!r} is not one kvpilot has: use one "
                                    f"of {', '.join(known)}")
        if self.tool_call_parser == "openai" and self.reasoning_parser not in (None, HARMONY_REASONING_PARSER):
            raise ServerConfigError(f"--tool-call-parser openai reads gpt-oss's harmony messages, which "
                                    f"--reasoning-parser {self.reasoning_parser} does not: leave the reasoning "
                                    f"parser out or use {HARMONY_REASONING_PARSER}")

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]
