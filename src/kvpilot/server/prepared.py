"""A validated, tokenized request, admitted to the queue: what serving.py hands to the response builders."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvpilot.server.fanout import FanoutShape
from kvpilot.server.core.messages import AddRequest
from kvpilot.server.openai.responses import ResponseShape
from kvpilot.server.openai.chat_output import ChatOutput


@dataclass(frozen=True)
class Prepared:
    """A validated, tokenized request, admitted to the queue: one AddRequest per sub-request (fanout.py: one
    unless n > 1, best_of or several prompts), each holding its own queue slot. Invariants:
    len(messages) == fanout.size; len(echo) == fanout.num_prompts; `prompt_text` is the (first) prompt's
    text for the access log (None without --log-prompts), `prompt_texts` each prompt's."""

    shape: ResponseShape
    messages: tuple[AddRequest, ...]
    tokenize_s: float
    stream: bool
    include_usage: bool
    endpoint: str
    prompt_text: str | None
    fanout: FanoutShape = FanoutShape(1, 1, 1)
    echo: tuple[str, ...] = ("",)  # text put before each choice of prompt i (`echo`), else ""
    show_logprobs: bool = True  # False when logprobs were only asked of the engine to rank best_of
    stage_followers: bool = True  # add each prompt's other candidates after its first (sub_requests.py)
    prompt_texts: tuple[str | None, ...] = ()
    chat_output: ChatOutput | None = None  # a chat's tool calls and reasoning, read out of its text

    @property
    def message(self) -> AddRequest:
        """The first sub-request (the only one of an ordinary request)."""
        return self.messages[0]

    @property
    def request_ids(self) -> tuple[str, ...]:
        return tuple(m.request_id for m in self.messages)

    def for_sub(self, k: int) -> Prepared:
        """Sub-request k seen as a request of its own (its id, prompt and message): what its access-log line
        and trace describe."""
        if self.fanout.size == 1:
            return self
        i = self.fanout.prompt_of(k)
        return dataclasses.replace(self, messages=(self.messages[k],), fanout=FanoutShape(1, 1, 1),
                                   shape=dataclasses.replace(self.shape, request_id=self.messages[k].request_id),
                                   echo=(self.echo[i],), prompt_texts=(),
                                   prompt_text=self.prompt_texts[i] if self.prompt_texts else None)
