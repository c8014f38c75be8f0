"""SubRequests: the engine requests of one fanned-out HTTP request (fanout.py), added to the engine client and
read as one stream of (k, item).

Prefix sharing. The scheduler registers a prompt's full blocks in the prefix cache only once the step that
computed them has run, so n copies of a prompt admitted together would each compute it. Each prompt's
followers (candidates 1..m-1) are therefore added once its leader (candidate 0) has produced its first output:
its prompt blocks are cached then, and the followers' prefill hits them (all but the last partial block). With
prefix caching off there is nothing to share, and all are added at once. The cost is the followers' wait of
one prefill.

Coalescing. When the event loop falls behind the engine's steps (hundreds of streams at thousands of tokens
a second), one sub-request's running outputs queue up; `get()` hands them over merged into one, whose
`delta_*` fields cover them all, so the response writes one chunk for several steps instead of falling
further behind (vLLM's front end merges the same way). Under light load nothing queues and every step is
its own chunk.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Sequence

from kvpilot.outputs import CompletionOutput, RequestOutput
from kvpilot.server.core.engine_client import EngineClient, Item
from kvpilot.server.fanout import FanoutShape
from kvpilot.server.item_stream import ItemStream
from kvpilot.server.core.messages import AddRequest


class SubRequests:
    """Invariants: every sub-request is added to the client at most once, and `get()` yields exactly one final
    item (a finished RequestOutput or an exception) per sub-request: a follower that is never added (its
    leader ended without a token, e.g. aborted) yields a synthetic finished output with finish_reason "abort"
    and no tokens. Only used on the event loop."""

    def __init__(self, client: EngineClient, shape: FanoutShape, messages: Sequence[AddRequest],
                 stage_followers: bool) -> None:
        self._client, self._shape, self._messages = client, shape, list(messages)
        self._stage = stage_followers and shape.candidates > 1
        self._merged: ItemStream[tuple[int, Item]] = ItemStream()
        # A lone sub-request is read straight from its stream: no pump task, one task switch less per step.
        self._direct: ItemStream[Item] | None = None
        self._held: tuple[int, Item] | None = None  # read while coalescing, another sub-request's: next get()
        self._pumps: list[asyncio.Future[None]] = []
        self._added: set[int] = set()
        self._released: set[int] = set()  # leaders whose followers were added (or given up)
        self._finished: set[int] = set()
        self._closed = False

    def start(self) -> None:
        """Adds the leaders (every sub-request when not staging)."""
        for k in range(self._shape.size):
            if not self._stage or self._shape.is_leader(k):
                self._add(k)

    @property
    def lone_stream(self) -> ItemStream[Item] | None:
        """The stream of a request with one sub-request, once added (None otherwise): read by get() directly."""
        return self._direct

    async def get(self) -> tuple[int, Item]:
        """The next item of any sub-request, with its k; a running output merged with the running (or final)
        outputs of the same sub-request queued right behind it (see Coalescing). Items keep their order, and
        every final item or exception is returned (never merged into a later one)."""
        if self._held is not None:
            (k, item), self._held = self._held, None
        elif self._direct is not None and self._merged.empty():  # a lone sub-request: straight from its stream
            k, item = self._note(await self._direct.get())
            if self._direct.empty():
                return k, item
        else:
            k, item = await self._next()
        while isinstance(item, RequestOutput) and not item.finished:
            following = self._next_nowait()
            if following is None:
                break
            if following[0] != k or not isinstance(following[1], RequestOutput):
                self._held = following
                break
            item = _merge(item, following[1])
        return k, item

    async def _next(self) -> tuple[int, Item]:
        if self._direct is None or not self._merged.empty():
            return await self._merged.get()
        return self._note(await self._direct.get())

    def _next_nowait(self) -> tuple[int, Item] | None:
        if not self._merged.empty():
            return self._merged.get_nowait()
        if self._direct is not None and not self._direct.empty():
            return self._note(self._direct.get_nowait())
        return None

    def _note(self, item: Item) -> tuple[int, Item]:
        """The lone sub-request's item, read from its stream (what _pump does for the others)."""
        if not isinstance(item, RequestOutput) or item.finished:
            self._finished.add(0)
        return 0, item

    def close(self) -> None:
        """Aborts the sub-requests still running (the client went away, or another one failed) and stops
        reading; idempotent."""
        self._closed = True
        live = [self._messages[k].request_id for k in self._added - self._finished]
        if live:
            self._client.abort(live)
        for pump in self._pumps:
            pump.cancel()

    def _after_leader(self, k: int, item: Item) -> None:
        """Adds leader k's followers once its prompt is cached: its first token, or its end with tokens. A
        leader that failed fails the whole request (no followers); one that was aborted (drain) ends its
        followers the same way, never started."""
        if isinstance(item, RequestOutput) and not item.outputs[0].token_ids and not item.finished:
            return  # no token yet (a step that produced none): the prompt is not computed
        self._released.add(k)
        if isinstance(item, BaseException):
            return
        started = bool(item.outputs[0].token_ids) and item.outputs[0].finish_reason != "abort"
        for follower in self._shape.followers(k):
            if started and not self._closed:
                self._add(follower)
            else:
                self._merged.put_nowait((follower, _never_started(self._messages[follower])))

    def _add(self, k: int) -> None:
        self._added.add(k)
        try:
            stream = self._client.add(self._messages[k])
        except Exception as exc:  # noqa: BLE001 - the engine is gone: this sub-request ends with the cause
            self._finished.add(k)
            self._merged.put_nowait((k, exc))
            return
        if self._shape.size == 1:
            self._direct = stream
        else:
            self._pumps.append(asyncio.ensure_future(self._pump(k, stream)))

    async def _pump(self, k: int, stream: ItemStream[Item]) -> None:
        """Moves sub-request k's items to the merged queue as they arrive (not as the consumer reads them: a
        slow client must not hold the followers back)."""
        while True:
            item = await stream.get()
            self._merged.put_nowait((k, item))
            ended = not isinstance(item, RequestOutput) or item.finished
            if ended:
                self._finished.add(k)
            if self._stage and self._shape.is_leader(k) and k not in self._released:
                self._after_leader(k, item)
            if ended:
                return


def _merge(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """`later` (the sub-request's newer state) with the new tokens and text of both steps as its delta."""
    return dataclasses.replace(later, delta_text=earlier.delta_text + later.delta_text,
                               delta_token_ids=earlier.delta_token_ids + later.delta_token_ids)


def _never_started(message: AddRequest) -> RequestOutput:
    return RequestOutput(request_id=message.request_id, prompt=message.prompt,
                         prompt_token_ids=message.prompt_token_ids,
                         outputs=[CompletionOutput(index=0, text="", token_ids=[], finish_reason="abort")],
                         finished=True)
