"""`--tool-call-parser NAME`: the parsers that read tool calls out of a model's free text (tool_choice "auto").

Each takes the finished text and the offered function names and returns ExtractedToolCalls. vLLM names
its parsers after the model family whose format they read: `hermes` (the format most open models share) and
`openai` (gpt-oss's harmony calls, as the harmony reading leaves them in the answer).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from kvpilot.server.openai import harmony_tool_parser
from kvpilot.server.openai.harmony_parser import CALL_OPEN
from kvpilot.server.openai.hermes_tool_parser import OPEN, ExtractedToolCalls, extract_tool_calls

ToolCallParser = Callable[[str, Collection[str]], ExtractedToolCalls]
TOOL_CALL_PARSERS: dict[str, ToolCallParser] = {"hermes": extract_tool_calls,
                                                "openai": harmony_tool_parser.extract_tool_calls}
TOOL_CALL_MARKERS: dict[str, str] = {"hermes": OPEN, "openai": CALL_OPEN}
"""What starts a call in each parser's format: text before it can stream as content."""
