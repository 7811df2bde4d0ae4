"""OpenAI's Responses API in chat-completion terms: a request's input items and tools
as the messages and tools of a chat completion, and the completion's choice as a
response's output items.

memkv sends every Responses request to its engines as a chat completion (every
``vllm serve`` speaks it, with memkv's connector saving and loading its KV), so
a response chain is held by memkv, not by the engine that served its first turn.
What a chat completion cannot say is refused with 400, naming the item or field
(hosted tools such as ``web_search``, ``item_reference`` inputs, background
responses), rather than dropped.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from memkv.errors import InvalidInputError
from memkv.protocol.responses import OpenAIDocument

__all__ = [
    "chat_request",
    "input_items",
    "output_items",
    "response_object",
    "usage_of",
]

Item = OpenAIDocument

#: The Responses fields that have no meaning for the engine (memkv answers them).
_OURS = frozenset({
    "input", "instructions", "previous_response_id", "conversation", "store", "include",
    "tools", "tool_choice", "text", "max_output_tokens", "metadata", "truncation",
    "reasoning", "background", "prompt", "prompt_cache_key", "prompt_cache_retention",
    "prompt_cache_options", "context_management", "service_tier", "stream_options",
    "memkv", "parallel_tool_calls", "top_logprobs", "safety_identifier",
})
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def input_items(value: Any) -> list[Item]:
    """A request's ``input`` as a list of items (a string is one user message).

    Raises:
        InvalidInputError: not a string or a list of items (names the bad one).
    """
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise InvalidInputError("'input' must be a string or a list of input items")
    items: list[Item] = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise InvalidInputError(f"input[{i}] must be an object (an input item)")
        if "type" not in item and "role" in item:
            item = {"type": "message", **item}
        kind = item.get("type")
        if kind == "message":
            _role(item, i)
            _text_of(item.get("content"), f"input[{i}].content")  # checks the parts
        elif kind == "function_call":
            for name in ("call_id", "name", "arguments"):
                if not isinstance(item.get(name), str):
                    raise InvalidInputError(f"input[{i}].{name} must be a string")
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise InvalidInputError(f"input[{i}].call_id must be a string")
            _text_of(item.get("output"), f"input[{i}].output")
        elif kind != "reasoning":
            raise InvalidInputError(
                f"input[{i}] is a {kind!r} item: memkv's /v1/responses takes message, "
                "function_call, function_call_output and reasoning items")
        items.append(item)
    return items


def _role(item: Item, i: int) -> str:
    role = item.get("role")
    if role not in _ROLES:
        raise InvalidInputError(f"input[{i}].role must be one of {sorted(_ROLES)}, got {role!r}")
    return _ROLES[role]


def _text_of(content: Any, where: str) -> str:
    """A message's (or a tool output's) text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidInputError(f"{where} must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise InvalidInputError(f"{where}[{j}] is a {kind!r} part: memkv's engines take "
                                    f"text parts ({', '.join(_TEXT_PARTS)})")
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise InvalidInputError(f"{where}[{j}].text must be a string")
        texts.append(text)
    return "".join(texts)


def chat_messages(items: list[Item], instructions: str | None) -> list[Item]:
    """The chat messages of ``items`` (checked by :func:`input_items`), after a system
    message of ``instructions``. Function calls that follow one another (a parallel
    plan) are one assistant message's tool calls; reasoning items are not sent."""
    messages: list[Item] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for i, item in enumerate(items):
        kind = item["type"]
        if kind == "message":
            messages.append({"role": _role(item, i),
                             "content": _text_of(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and (
                    last.get("tool_calls") or i > 0 and items[i - 1]["type"] == "message"):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text_of(item.get("output"), f"input[{i}].output")})
    return messages


def _tools(tools: Any) -> list[Item]:
    if not isinstance(tools, list):
        raise InvalidInputError("'tools' must be a list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise InvalidInputError(f"tools[{i}] is a {kind!r} tool: memkv's engines call "
                                    "function tools only")
        if not isinstance(tool.get("name"), str):
            raise InvalidInputError(f"tools[{i}].name must be a string")
        function = {"name": tool["name"],
                    "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(
            choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidInputError("'tool_choice' must be auto, none, required or "
                            f"{{'type': 'function', 'name': ...}}, got {choice!r:.80}")


def _response_format(text: Any) -> Item | None:
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    raise InvalidInputError(f"text.format must be text, json_object or json_schema, "
                            f"got {fmt!r:.80}")


def chat_request(body: Item, items: list[Item]) -> Item:
    """The chat completion that answers the Responses request ``body`` whose whole
    input (its chain's items, then its own) is ``items``.

    Raises:
        InvalidInputError: a field a chat completion cannot carry (named).
    """
    if body.get("background"):
        raise InvalidInputError("background responses are not served: leave 'background' out")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidInputError("'instructions' must be a string")
    chat: Item = {k: v for k, v in body.items() if k not in _OURS}
    chat["messages"] = chat_messages(items, instructions)
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
        if "parallel_tool_calls" in body:
            chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    if chat.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    return chat


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def message_item(text: str, item_id: str | None = None, status: str = "completed") -> Item:
    return {"type": "message", "id": item_id or new_item_id("msg"), "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def call_item(call: Item, item_id: str | None = None, status: str = "completed") -> Item:
    function = call.get("function") or {}
    return {"type": "function_call", "id": item_id or new_item_id("fc"),
            "call_id": call.get("id") or new_item_id("call"), "name": function.get("name", ""),
            "arguments": function.get("arguments") or "", "status": status}


def output_items(choice: Item) -> list[Item]:
    """A chat completion's choice as a response's output items: the assistant's text
    as a message, each tool call as a function call."""
    message = choice.get("message") or {}
    items: list[Item] = []
    if message.get("content"):
        items.append(message_item(message["content"]))
    items += [call_item(call) for call in message.get("tool_calls") or []]
    return items


def usage_of(usage: Item | None) -> Item | None:
    """A chat completion's usage in a response's terms."""
    if not usage:
        return None
    details = usage.get("prompt_tokens_details") or {}
    return {"input_tokens": usage.get("prompt_tokens", 0),
            "input_tokens_details": {"cached_tokens": details.get("cached_tokens") or 0},
            "output_tokens": usage.get("completion_tokens", 0),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.get("total_tokens", 0)}


def response_object(response_id: str, body: Item, output: list[Item], usage: Item | None, *,
                    status: str = "completed", finish_reason: str | None = None,
                    error: Item | None = None, created_at: int | None = None) -> Item:
    """The response object of OpenAI's Responses API."""
    incomplete = None
    if status == "completed" and finish_reason == "length":
        status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    return {
        "id": response_id, "object": "response",
        "created_at": created_at if created_at is not None else int(time.time()),
        "status": status, "error": error, "incomplete_details": incomplete,
        "model": body.get("model"), "output": output, "usage": usage,
        "instructions": body.get("instructions"),
        "previous_response_id": body.get("previous_response_id"),
        "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {}, "store": body.get("store", True) is not False,
        "text": body.get("text") or {"format": {"type": "text"}},
        "truncation": body.get("truncation") or "disabled", "background": False,
        "reasoning": None, "user": body.get("user"),
    }
