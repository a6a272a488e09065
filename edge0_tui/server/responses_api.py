"""OpenAI's Responses API (`POST /v1/responses`): requests checked, replies shaped, responses kept.

A request is turned into the chat request the chat endpoint takes (openai_shapes.parse_chat), so
the chat template, the engine, the reasoning split, the tool-call parsers, the limits, the log and
/metrics are the same; only the shapes differ:
- `input` (a string, or items: messages whose content is a string or `input_text` /
  `output_text` parts, `function_call` and `function_call_output` items; earlier `reasoning`
  items are dropped as chat templates drop reasoning) becomes the conversation, after
  `instructions` as its system turn;
- `tools` of type function ({type, name, description, parameters}) are handed to the template as
  the chat endpoint's `{"type": "function", "function": {...}}`; `tool_choice` auto, none,
  required or a named function (forced as the chat endpoint forces a call: a grammar);
- `previous_response_id` continues a response this server gave (`ResponseStore`: its input and
  output, kept in memory while the server runs, the oldest dropped past a count or a size);
- the reply is a `response` object with `message`, `reasoning` and `function_call` output items,
  whole or streamed as the API's own events (response.created ... response.completed), each with
  its `sequence_number`;
- errors are OpenAI's `{"error": {message, type, param, code}}`, naming the field as this API
  calls it (`input[2].call_id`, `max_output_tokens`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field, fields

from .openai_replies import sse
from .openai_shapes import (
    ApiError,
    GenerationRequest,
    bad,
    check_template_value,
    check_text,
    parse_chat,
)
from .tool_calls import ToolCall

# Past responses kept for `previous_response_id`: at most this many, and at most this many
# characters of conversation in all (each response keeps its whole conversation, so a long
# chain counts its history once per response); the oldest are dropped first.
MAX_STORED_RESPONSES = 1000
MAX_STORED_CHARS = 64 * 1024 * 1024

# The Responses API's fields edge0 honours, and edge0's own per-request extras (as the chat
# endpoint takes them). Fields checked here for a value edge0 can give (`truncation`, `text`,
# `background`, `top_logprobs`) or that change nothing here (`metadata`, `user`, `include`, ...)
# are in ACCEPTED; any other field (`conversation`, `prompt`, a field of a newer API) would change
# the reply in a way edge0 cannot: refused, naming it, never ignored.
HONOURED = frozenset(
    {
        "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools",
        "tool_choice", "stream", "store", "previous_response_id",
        # edge0's extras, as the chat endpoint takes them
        "k", "mode", "top_k", "min_p", "repetition_penalty", "seed", "enable_thinking",
        "chat_template_kwargs", "draft", "draft_max",
    }
)  # fmt: skip
ACCEPTED = frozenset(
    {
        "metadata", "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
        "prompt_cache_options", "service_tier", "include", "parallel_tool_calls", "reasoning",
        "stream_options", "truncation", "text", "background", "top_logprobs",
    }
)  # fmt: skip
# Passed on to parse_chat under the same name, checked there.
CHAT_FIELDS = (
    "model", "stream", "temperature", "top_p", "k", "mode", "top_k", "min_p",
    "repetition_penalty", "seed", "enable_thinking", "chat_template_kwargs", "draft", "draft_max",
)  # fmt: skip
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text")


@dataclass(frozen=True)
class ResponsesTurn:
    """What a Responses request asked besides the chat request: echoed in its reply, and the
    conversation kept for the next request (`history`: without `instructions`, which a
    continuing request does not inherit)."""

    history: tuple[dict, ...]
    history_chars: int
    instructions: str | None
    previous_response_id: str | None
    max_output_tokens: int | None
    tools: tuple[dict, ...]
    tool_choice: object  # "auto", "none", "required" or {"type": "function", "name": ...}
    store: bool
    metadata: dict
    parallel_tool_calls: bool


@dataclass(frozen=True)
class ResponsesRequest(GenerationRequest):
    """The chat request a Responses request stands for, and what else it asked."""

    turn: ResponsesTurn | None = None


class ResponseStore:
    """Past responses' conversations by id, kept in memory: the newest MAX_STORED_RESPONSES, and
    no more than MAX_STORED_CHARS characters of them (the oldest are dropped first)."""

    def __init__(self, max_count: int = MAX_STORED_RESPONSES, max_chars: int = MAX_STORED_CHARS):
        self.max_count = max_count
        self.max_chars = max_chars
        self.chars = 0
        self._kept: OrderedDict[str, tuple[tuple[dict, ...], int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def get(self, response_id: str) -> tuple[tuple[dict, ...], int] | None:
        """The conversation up to and including that response, and its size in characters."""
        return self._kept.get(response_id)

    def put(self, response_id: str, history: tuple[dict, ...], chars: int) -> None:
        if chars > self.max_chars:
            return  # it would push out everything else and still not fit
        self._kept[response_id] = (history, chars)
        self.chars += chars
        while len(self._kept) > self.max_count or self.chars > self.max_chars:
            _, (_, dropped) = self._kept.popitem(last=False)
            self.chars -= dropped


# -- requests -----------------------------------------------------------------------------------


def _chars(messages) -> int:
    """A conversation's size as the store counts it (as engine_worker.request_chars does)."""
    return sum(len(str(message)) for message in messages)


def _string(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise bad(f"{where} must be a string", where)
    return check_text(value, where)


def _text_parts(content: object, where: str) -> str:
    """A message's content: a string, or text parts (`input_text`, `output_text`) joined."""
    if isinstance(content, str):
        return check_text(content, where)
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or an array of content parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise bad(
                f"{where}[{j}]: a {kind!r} part is not supported (input_text and output_text are)",
                f"{where}[{j}]",
            )
        texts.append(_string(part.get("text"), f"{where}[{j}].text"))
    return "".join(texts)


def _call(item: dict, where: str) -> dict:
    """A `function_call` item as the chat endpoint's history call (arguments as an object)."""
    name = _string(item.get("name"), f"{where}.name")
    call_id = _string(item.get("call_id"), f"{where}.call_id")
    arguments = _string(item.get("arguments", "{}"), f"{where}.arguments")
    try:
        value = json.loads(arguments or "{}")
    except (ValueError, RecursionError):
        raise bad(f"{where}.arguments is not JSON", f"{where}.arguments") from None
    check_template_value(value, f"{where}.arguments")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": value}}


def _input_messages(items: object) -> list[dict]:
    """`input` as the chat endpoint's messages: a string is one user turn; function_call items
    join the assistant turn before them (or make one), function_call_output items are `tool`
    turns."""
    if isinstance(items, str):
        return [{"role": "user", "content": check_text(items, "input")}]
    if not isinstance(items, list) or not items:
        raise bad("input must be a string or a non-empty array of items", "input")
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(f"{where} must be an object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad(f"{where}.role must be one of {', '.join(ROLES)}", f"{where}.role")
            content = _text_parts(item.get("content"), f"{where}.content")
            messages.append({"role": ROLES[role], "content": content})
        elif kind == "function_call":
            call = _call(item, where)
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _string(item.get("call_id"), f"{where}.call_id"),
                    "content": _text_parts(output, f"{where}.output"),
                }
            )
        elif kind == "reasoning":
            continue  # earlier reasoning: chat templates drop it from the history
        else:
            raise bad(
                f"{where}: a {kind!r} item is not supported here (message, function_call, "
                "function_call_output and reasoning are)",
                f"{where}.type",
            )
    return messages


def _tools(body: dict) -> tuple[tuple[dict, ...], list[dict] | None]:
    """The request's tools as given (echoed in the reply), and as the chat endpoint takes them."""
    tools = body.get("tools")
    if tools is None:
        return (), None
    if not isinstance(tools, list):
        raise bad("tools must be an array", "tools")
    chat = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad(f"{where}: a {kind!r} tool is not supported (function tools are)", where)
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise bad(f"{where} needs a name", f"{where}.name")
        check_template_value(tool, where)  # all of it: the reply echoes it
        # In the order OpenAI's chat clients send a function: the same tool renders the same
        # prompt through either endpoint.
        keys = ("name", "description", "parameters", "strict")
        function = {key: tool[key] for key in keys if tool.get(key) is not None}
        chat.append({"type": "function", "function": function})
    return tuple(tools), chat


def _tool_choice(body: dict) -> tuple[object, object]:
    """(the chat request's tool_choice, the Responses API's to echo): "required" and a named
    function force a call as the chat endpoint forces one (a grammar)."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto", "auto"
    if choice in ("auto", "none", "required"):
        return choice, choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if isinstance(name, str):
            return {"type": "function", "function": {"name": name}}, {
                "type": "function",
                "name": name,
            }
    raise bad(
        'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}',
        "tool_choice",
    )


def _refuse_unless(body: dict, name: str, allowed, why: str) -> None:
    value = body.get(name)
    if value is not None and not allowed(value):
        raise bad(f"{name} is not supported: {why}", name)


def _check_accepted(body: dict) -> None:
    """The ACCEPTED fields that would change the reply with another value than edge0's."""
    _refuse_unless(body, "truncation", lambda v: v == "disabled", "edge0 never drops input")
    _refuse_unless(
        body,
        "text",
        lambda v: isinstance(v, dict) and v.get("format", {"type": "text"}) == {"type": "text"},
        'edge0 has no constrained decoding: only {"format": {"type": "text"}} replies',
    )
    _refuse_unless(body, "background", lambda v: v is False, "replies are made while you wait")
    _refuse_unless(body, "top_logprobs", lambda v: v == 0, "no log-probabilities here")
    for name in ("store", "parallel_tool_calls"):
        _refuse_unless(body, name, lambda v: isinstance(v, bool), "it must be a boolean")
    _refuse_unless(body, "metadata", lambda v: isinstance(v, dict), "it must be an object")
    check_template_value(body.get("metadata"), "metadata")  # the reply echoes it: text only


def _max_output_tokens(body: dict) -> int | None:
    value = body.get("max_output_tokens")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise bad("max_output_tokens must be an integer of at least 1", "max_output_tokens")
    return value


def _history(body: dict, store: ResponseStore) -> tuple[tuple[dict, ...], int]:
    """The conversation `previous_response_id` names (empty without one)."""
    previous = body.get("previous_response_id")
    if previous is None:
        return (), 0
    if not isinstance(previous, str):
        raise bad("previous_response_id must be a string", "previous_response_id")
    kept = store.get(previous)
    if kept is None:
        shown = repr(previous) if len(previous) <= 60 else repr(previous[:57] + "...")
        raise ApiError(
            400,
            f"previous_response_id {shown} names no response this server holds (it keeps its "
            f"latest {store.max_count} stored responses while it runs)",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return kept


def parse_responses(
    body: dict, model_ids: tuple[str, ...], store: ResponseStore, strict: bool = False
) -> ResponsesRequest:
    """A Responses request as a chat request, checked field by field (`model_ids`, `strict`: as
    openai_shapes.parse_chat's); `store` holds the responses `previous_response_id` may name."""
    for name in body:
        if name not in HONOURED and name not in ACCEPTED:
            raise bad(f"{name} is not supported by edge0's Responses API", str(name))
    _check_accepted(body)
    if body.get("input") is None:
        raise bad("input is required", "input")
    new = _input_messages(body["input"])
    instructions = body.get("instructions")
    if instructions is not None:
        instructions = _string(instructions, "instructions")
    max_output_tokens = _max_output_tokens(body)
    given_tools, chat_tools = _tools(body)
    choice, echoed = _tool_choice(body)
    earlier, earlier_chars = _history(body, store)
    history = (*earlier, *new)
    system = [{"role": "system", "content": instructions}] if instructions is not None else []
    chat = {name: body[name] for name in CHAT_FIELDS if body.get(name) is not None}
    chat.update(messages=[*system, *history], tools=chat_tools, tool_choice=choice)
    if max_output_tokens is not None:
        chat["max_tokens"] = max_output_tokens
    request = parse_chat(chat, model_ids, strict)
    turn = ResponsesTurn(
        history=history,
        history_chars=earlier_chars + _chars(new),
        instructions=instructions,
        previous_response_id=body.get("previous_response_id"),
        max_output_tokens=max_output_tokens,
        tools=given_tools,
        tool_choice=echoed,
        store=body.get("store") is not False,
        metadata=body.get("metadata") or {},
        parallel_tool_calls=body.get("parallel_tool_calls") is not False,
    )
    given = {f.name: getattr(request, f.name) for f in fields(GenerationRequest)}
    return ResponsesRequest(**given, turn=turn)


# -- replies ------------------------------------------------------------------------------------


def response_usage(used: dict) -> dict:
    """The Responses API's usage of OpenAI's chat usage (openai_replies.usage): the same counts,
    `cached_tokens` the prompt's tokens the engine's KV cache already held. edge0 does not count
    reasoning tokens apart from the rest of the output."""
    cached = used.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {
        "input_tokens": used["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": used["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": used["prompt_tokens"] + used["completion_tokens"],
    }


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


# A text item of the reply: its output item's type, its id's prefix, and its content part's type.
TEXT_ITEMS = {
    "content": ("message", "msg_", "output_text"),
    "reasoning": ("reasoning", "rs_", "reasoning_text"),
}


def text_part(kind: str, text: str) -> dict:
    """The content part of a text item: `kind` is reply_parts' "content" or "reasoning"."""
    if kind == "content":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}


def text_item(kind: str, item_id: str, text: str, status: str) -> dict:
    """A `message` (kind "content") or `reasoning` output item holding `text` in one part (no
    part yet while in progress, as the API adds it with its own event)."""
    content = [text_part(kind, text)] if status != "in_progress" else []
    if kind == "content":
        return {"id": item_id, "type": "message", "status": status, "role": "assistant",
                "content": content}  # fmt: skip
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def call_item(call: ToolCall, status: str = "completed", arguments: str | None = None) -> dict:
    return {
        "id": "fc_" + call.id.removeprefix("call_"),
        "type": "function_call",
        "status": status,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments_json() if arguments is None else arguments,
    }


def history_turn(content: str, calls: list[ToolCall]) -> dict:
    """The reply as the assistant turn a continuing request's conversation holds."""
    turn: dict = {"role": "assistant", "content": content}
    if calls:
        turn["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
    return turn


@dataclass
class _OpenItem:
    """The text item a stream is writing: reply_parts' kind, its id, its place in `output`."""

    kind: str
    id: str
    index: int
    texts: list[str] = field(default_factory=list)


class ResponsesWriter:
    """A reply in the Responses API's shapes, for app.GenerationResponse: its events as SSE, or
    the response object whole. A finished reply is kept in `store` unless the request said
    `store: false`."""

    def __init__(self, request: ResponsesRequest, store: ResponseStore) -> None:
        self.request = request
        self.turn = request.turn
        self.store = store
        self.id = _new_id("resp_")
        self.created_at = int(time.time())
        self.sequence = 0
        self.open: _OpenItem | None = None  # the streamed text item being written
        self.items: list[dict] = []  # the streamed items done, in order

    # -- the response object

    def _response(
        self, status: str, output: list[dict], used: dict | None, figures: dict | None = None
    ) -> dict:
        turn = self.turn
        body = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": turn.instructions,
            "max_output_tokens": turn.max_output_tokens,
            "model": self.request.model,
            "output": output,
            "parallel_tool_calls": turn.parallel_tool_calls,
            "previous_response_id": turn.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": turn.store,
            "temperature": self.request.generation.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": turn.tool_choice,
            "tools": list(turn.tools),
            "top_p": self.request.generation.top_p,
            "truncation": "disabled",
            "usage": response_usage(used) if used is not None else None,
            "metadata": turn.metadata,
        }
        if figures is not None:
            body["edge0"] = figures
        return body

    def _keep(self, content: str, calls: list[ToolCall]) -> None:
        if not self.turn.store:
            return
        reply = history_turn(content, calls)
        history = (*self.turn.history, reply)
        self.store.put(self.id, history, self.turn.history_chars + _chars([reply]))

    @staticmethod
    def _status(finish_reason: str) -> str:
        return "incomplete" if finish_reason == "length" else "completed"

    def whole(self, content, reasoning, calls, finish_reason, used, figures, logprobs) -> dict:
        status = self._status(finish_reason)
        output = []
        if reasoning:
            output.append(text_item("reasoning", _new_id("rs_"), reasoning, "completed"))
        if content or not calls:
            output.append(text_item("content", _new_id("msg_"), content, status))
        output += [call_item(call) for call in calls]
        self._keep(content, calls)
        return self._response(status, output, used, figures)

    # -- streamed events

    def _event(self, kind: str, **fields) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse(payload, kind)

    def start(self) -> list[bytes]:
        response = self._response("in_progress", [], None)
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def _open_item(self, kind: str) -> list[bytes]:
        """Close the open item; open a text item of `kind` ("content" or "reasoning") and its
        content part."""
        out = self._close_item("completed")
        self.open = _OpenItem(kind, _new_id(TEXT_ITEMS[kind][1]), len(self.items))
        where = {"item_id": self.open.id, "output_index": self.open.index}
        item = text_item(kind, self.open.id, "", "in_progress")
        return out + [
            self._event("response.output_item.added", output_index=self.open.index, item=item),
            self._event(
                "response.content_part.added", **where, content_index=0, part=text_part(kind, "")
            ),
        ]

    def _close_item(self, status: str) -> list[bytes]:
        if self.open is None:
            return []
        kind, text = self.open.kind, "".join(self.open.texts)
        where = {"item_id": self.open.id, "output_index": self.open.index, "content_index": 0}
        part = TEXT_ITEMS[kind][2]
        done = {"logprobs": []} if kind == "content" else {}
        item = text_item(kind, self.open.id, text, status)
        self.items.append(item)
        self.open = None
        return [
            self._event(f"response.{part}.done", **where, text=text, **done),
            self._event("response.content_part.done", **where, part=text_part(kind, text)),
            self._event("response.output_item.done", output_index=where["output_index"], item=item),
        ]

    def delta(self, kind: str, text: str, logprobs) -> list[bytes]:
        out = [] if self.open is not None and self.open.kind == kind else self._open_item(kind)
        self.open.texts.append(text)
        where = {"item_id": self.open.id, "output_index": self.open.index, "content_index": 0}
        done = {"logprobs": []} if kind == "content" else {}
        event = f"response.{TEXT_ITEMS[kind][2]}.delta"
        return out + [self._event(event, **where, delta=text, **done)]

    def _call_events(self, call: ToolCall) -> list[bytes]:
        at = len(self.items)
        arguments = call.arguments_json()
        item = call_item(call)
        item_id = item["id"]
        self.items.append(item)
        return [
            self._event(
                "response.output_item.added",
                output_index=at,
                item=call_item(call, "in_progress", arguments=""),
            ),
            self._event(
                "response.function_call_arguments.delta",
                item_id=item_id,
                output_index=at,
                delta=arguments,
            ),
            self._event(
                "response.function_call_arguments.done",
                item_id=item_id,
                output_index=at,
                arguments=arguments,
                name=call.name,
            ),
            self._event("response.output_item.done", output_index=at, item=item),
        ]

    def end(self, finish_reason: str, calls: list[ToolCall], used: dict, figures: dict) -> list:
        status = self._status(finish_reason)
        out = self._close_item(status)
        if not calls and not any(item["type"] == "message" for item in self.items):
            out += self._open_item("content") + self._close_item(status)  # as a whole reply has
        for call in calls:
            out += self._call_events(call)
        messages = [item for item in self.items if item["type"] == "message"]
        self._keep("".join(part["text"] for item in messages for part in item["content"]), calls)
        response = self._response(status, self.items, used, figures)
        return out + [self._event(f"response.{status}", response=response)]

    def error_event(self, error: ApiError) -> list[bytes]:
        out = self._close_item("incomplete")
        failed = self._response("failed", self.items, None)
        # The response's error has a code of the API's own few (its `error` event has edge0's).
        failed["error"] = {"code": "server_error", "message": error.message}
        return out + [
            self._event("error", code=error.code, message=error.message, param=error.param),
            self._event("response.failed", response=failed),
        ]
