"""A streamed chat completion as the Responses API's server-sent events.

An engine streams ``data: {chunk}`` lines (OpenAI's chat chunks, usage in the
last when asked); a Responses client reads typed events: ``response.created``,
then per output item ``response.output_item.added``, its deltas
(``response.output_text.delta``, ``response.function_call_arguments.delta``)
and ``...done`` events, and last ``response.completed`` with the whole response
(what the OpenAI Agents SDK keeps), or ``response.failed`` when the engine
failed mid-stream. Every event carries its ``sequence_number``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from memkv.api.responses.items import (
    Item,
    call_item,
    message_item,
    new_item_id,
    response_object,
    usage_of,
)

__all__ = ["ResponseEvents", "chat_chunks"]


async def chat_chunks(raw: AsyncIterator[bytes]) -> AsyncIterator[Item]:
    """The JSON objects of a server-sent event stream's ``data:`` lines, until ``[DONE]``
    (lines may be split across chunks)."""
    pending = b""
    async for chunk in raw:
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            try:
                event = json.loads(data)
            except ValueError:
                continue  # (a keep-alive, or a line some proxy added)
            if isinstance(event, dict):
                yield event


class ResponseEvents:
    """Turns one streamed chat completion into a response's events.

    ``response`` is the finished response object once the stream has ended
    (completed, incomplete or failed), for the caller to store.
    """

    def __init__(self, response_id: str, body: Item,
                 created_at: int) -> None:
        self._id, self._body, self._created = response_id, body, created_at
        self._seq = 0
        self._output: list[Item] = []
        self._text: Item | None = None  # the message item being written, if any
        self._texts: list[str] = []
        self._calls: dict[int, Item] = {}  # a chat tool call's index -> its item
        self._usage: Item | None = None
        self._finish: str | None = None
        self.response: Item | None = None

    def _event(self, kind: str, **fields: Any) -> bytes:
        document = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(document)}\n\n".encode()

    def _snapshot(self, status: str, **extra: Any) -> Item:
        return response_object(self._id, self._body, list(self._output), self._usage,
                               status=status, created_at=self._created, **extra)

    async def translate(self, chunks: AsyncIterator[Item],
                        on_finished: Callable[[Item], Any] | None = None
                        ) -> AsyncIterator[bytes]:
        """The events of ``chunks``; ``on_finished(response)`` is awaited (when it
        returns an awaitable) before the last event, so a stored response exists
        by the time its client reads ``response.completed``."""
        yield self._event("response.created", response=self._snapshot("in_progress"))
        yield self._event("response.in_progress", response=self._snapshot("in_progress"))
        error: Item | None = None
        async for chunk in chunks:
            if "error" in chunk:
                error = chunk["error"] if isinstance(chunk["error"], dict) else {
                    "message": str(chunk["error"])}
                break
            if chunk.get("usage"):
                self._usage = usage_of(chunk["usage"])
            for choice in chunk.get("choices") or []:
                for event in self._choice(choice):
                    yield event
        for event in self._close_items():
            yield event
        if error is not None:
            self.response = self._snapshot("failed", error={
                "code": "server_error", "message": str(error.get("message", error))})
            kind = "response.failed"
        else:
            self.response = self._snapshot("completed", finish_reason=self._finish)
            kind = ("response.incomplete" if self.response["status"] == "incomplete"
                    else "response.completed")
        if on_finished is not None:
            done = on_finished(self.response)
            if hasattr(done, "__await__"):
                await done
        yield self._event(kind, response=self.response)

    def _choice(self, choice: Item) -> list[bytes]:
        events: list[bytes] = []
        delta = choice.get("delta") or {}
        if delta.get("content"):
            if self._text is None:
                self._text = message_item("", status="in_progress")
                self._text["content"] = []
                events.append(self._added(self._text))
                events.append(self._event(
                    "response.content_part.added", item_id=self._text["id"],
                    output_index=self._index(self._text), content_index=0,
                    part={"type": "output_text", "text": "", "annotations": []}))
            self._texts.append(delta["content"])
            events.append(self._event(
                "response.output_text.delta", item_id=self._text["id"],
                output_index=self._index(self._text), content_index=0,
                delta=delta["content"], logprobs=[]))
        for call in delta.get("tool_calls") or []:
            index = call.get("index", len(self._calls))
            item = self._calls.get(index)
            if item is None:
                item = self._calls[index] = call_item(
                    {"id": call.get("id"), "function": {
                        "name": (call.get("function") or {}).get("name", ""),
                        "arguments": ""}}, status="in_progress")
                events.append(self._added(item))
            fragment = (call.get("function") or {}).get("arguments") or ""
            if fragment:
                item["arguments"] += fragment
                events.append(self._event(
                    "response.function_call_arguments.delta", item_id=item["id"],
                    output_index=self._index(item), delta=fragment))
        if choice.get("finish_reason"):
            self._finish = choice["finish_reason"]
        return events

    def _added(self, item: Item) -> bytes:
        self._output.append(item)
        return self._event("response.output_item.added", output_index=self._index(item),
                           item=dict(item))

    def _index(self, item: Item) -> int:
        return next(i for i, held in enumerate(self._output) if held is item)

    def _close_items(self) -> list[bytes]:
        events: list[bytes] = []
        if self._text is not None:
            text = "".join(self._texts)
            index = self._index(self._text)
            done = message_item(text, item_id=self._text["id"])
            events.append(self._event("response.output_text.done", item_id=done["id"],
                                      output_index=index, content_index=0, text=text,
                                      logprobs=[]))
            events.append(self._event("response.content_part.done", item_id=done["id"],
                                      output_index=index, content_index=0,
                                      part=done["content"][0]))
            self._output[index] = done
            events.append(self._event("response.output_item.done", output_index=index,
                                      item=done))
        for item in self._calls.values():
            index = self._index(item)
            item["status"] = "completed"
            item.setdefault("call_id", new_item_id("call"))
            events.append(self._event("response.function_call_arguments.done",
                                      item_id=item["id"], output_index=index,
                                      arguments=item["arguments"]))
            events.append(self._event("response.output_item.done", output_index=index,
                                      item=dict(item)))
        return events
