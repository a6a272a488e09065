"""Anthropic's Messages API (`POST /v1/messages`): requests checked, replies and errors shaped.

A request is turned into the same `GenerationRequest` an OpenAI chat request makes (the
conversation for the chat template, tools as the template reads them), so the engine, the stop
sequences, the reasoning split and the tool-call parsers are the same; only the shapes differ:
- `system` (a string or text blocks) becomes the system message; content blocks are `text`,
  `tool_use` (an assistant's call) and `tool_result` (the tool's answer, a `tool` message);
- `tools` ({name, description, input_schema}) are handed to the template as functions;
  `tool_choice` auto, none, `any` (OpenAI's "required") or a named tool (`{"type": "tool",
  "name": ...}`: OpenAI's named function), the last two forcing a call under a grammar;
- `thinking: {"type": "enabled"}` turns the template's thinking on, and reasoning comes back as
  `thinking` blocks;
- replies stream as message_start, content_block_start/delta/stop, message_delta, message_stop;
- `POST /v1/messages/count_tokens` takes a request's prompt fields and counts the tokens that
  request's prompt would be encoded to (`parse_count_tokens`);
- errors are `{"type": "error", "error": {"type": ..., "message": ...}}`, naming the field as
  this API calls it (`stop_sequences`, `messages[1].content[0].input`): every field is checked
  here, with the checks the OpenAI API uses, before it is given OpenAI's shape.
"""

from __future__ import annotations

import uuid
from dataclasses import replace

from .openai_replies import sse
from .openai_shapes import (
    ApiError,
    GenerationRequest,
    bad,
    check_stop,
    check_template_value,
    check_text,
    parse_chat,
)
from .tool_calls import ToolCall

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def use_id(call: ToolCall) -> str:
    """A call's id as Anthropic writes a tool_use id (`toolu_...`, where OpenAI's are `call_`)."""
    return "toolu_" + call.id.removeprefix("call_")


def error_body(error: ApiError) -> dict:
    kind = ERROR_TYPES.get(
        error.status, "api_error" if error.status >= 500 else "invalid_request_error"
    )
    message = error.message if error.param is None else f"{error.message} ({error.param})"
    return {"type": "error", "error": {"type": kind, "message": message}}


def _text_of(blocks: object, where: str) -> str:
    """A string, or text blocks joined."""
    if isinstance(blocks, str):
        return check_text(blocks, where)
    if not isinstance(blocks, list):
        raise bad(f"{where} must be a string or an array of content blocks", where)
    parts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise bad(f"{where}: only text blocks are supported here", where)
        if not isinstance(block.get("text"), str):
            raise bad(f"{where}: a text block needs a string `text`", where)
        parts.append(check_text(block["text"], f"{where}[{j}].text"))
    return "".join(parts)


def _tool_use(block: dict, where: str) -> dict:
    """An assistant's `tool_use` block as an OpenAI tool call (arguments as an object)."""
    arguments = block.get("input")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise bad(f"{where}.input must be an object", f"{where}.input")
    check_template_value(arguments, f"{where}.input")
    return {
        "id": check_text(str(block.get("id", "")), f"{where}.id"),
        "type": "function",
        "function": {"name": check_text(block["name"], f"{where}.name"), "arguments": arguments},
    }


def _turns(message: dict, i: int) -> list[dict]:
    """One Anthropic message as OpenAI-style messages (a user turn with tool results becomes
    one `tool` message per result, then the text)."""
    where = f"messages[{i}]"
    role = message.get("role")
    if role not in ("user", "assistant"):
        raise bad(f"{where}.role must be user or assistant", f"{where}.role")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": check_text(content, f"{where}.content")}]
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a string or an array of blocks", f"{where}.content")
    texts, calls, results = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(check_text(block["text"], f"{at}.text"))
        elif kind == "tool_use" and role == "assistant" and isinstance(block.get("name"), str):
            calls.append(_tool_use(block, at))
        elif kind == "tool_result" and role == "user":
            result = block.get("content", "")
            results.append(
                {
                    "role": "tool",
                    "tool_call_id": check_text(
                        str(block.get("tool_use_id", "")), f"{at}.tool_use_id"
                    ),
                    "content": _text_of(result, f"{at}.content"),
                }
            )
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier reasoning: chat templates drop it from the history
        else:
            raise bad(
                f"{where}.content: a {kind!r} block is not supported here (text, tool_use in "
                "assistant turns, tool_result in user turns)",
                f"{where}.content",
            )
    turn = {"role": role, "content": "".join(texts)}
    if calls:
        turn["tool_calls"] = calls
    return results + ([turn] if texts or calls or not results else [])


def _tool_choice(choice: object) -> str | dict | None:
    """Anthropic's tool_choice in OpenAI's terms: auto, none, "required" (`any`), or a named
    function (`{"type": "tool", "name": ...}`)."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    if choice is None or kind == "auto":
        return None
    if kind == "none":
        return "none"
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad(
        'tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "none"} or '
        '{"type": "tool", "name": ...}',
        "tool_choice",
    )


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("tools must be an array", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise bad(f"tools[{i}] needs a name", "tools")
        check_template_value(tool, f"tools[{i}]")
        # In the order OpenAI clients send a function (templates write tools as JSON): the same
        # tool renders the same prompt through either API.
        function = {"name": tool["name"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        function["parameters"] = tool.get("input_schema") or {}
        out.append({"type": "function", "function": function})
    return out


# The Messages API's fields edge0 honours, those that change nothing here (`metadata`: a user id
# for the provider's abuse checks; `service_tier`: the provider's capacity), and edge0's own
# per-request profile (`k`, `mode`) and drafts (`draft`, `draft_max`). Any other field (`mcp_servers`, `container`, a field of a
# newer API) would change the reply in a way edge0 cannot: refused, naming it, never ignored.
MESSAGES_FIELDS = frozenset(
    {
        "model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature",
        "top_p", "top_k", "tools", "tool_choice", "thinking", "metadata", "service_tier", "k",
        "mode", "draft", "draft_max",
    }
)  # fmt: skip


# What `POST /v1/messages/count_tokens` takes: the prompt's fields of a Messages request.
COUNT_TOKENS_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking"})


def parse_count_tokens(
    body: dict, model_ids: tuple[str, ...], strict: bool = False
) -> GenerationRequest:
    """A count_tokens request, checked as a Messages request with the same prompt is: its
    tokens are those that request's prompt would be encoded to."""
    for name in body:
        if name not in COUNT_TOKENS_FIELDS:
            raise bad(f"{name} is not supported by count_tokens", str(name))
    return parse_messages({**body, "max_tokens": 1}, model_ids, strict)


def parse_messages(
    body: dict, model_ids: tuple[str, ...], strict: bool = False
) -> GenerationRequest:
    """An Anthropic Messages request as a chat request, checked field by field (`model_ids`,
    `strict`: as openai_shapes.parse_chat's)."""
    for name in body:
        if name not in MESSAGES_FIELDS:
            raise bad(f"{name} is not supported by edge0's Messages API", str(name))
    if not isinstance(body.get("max_tokens"), int) or isinstance(body.get("max_tokens"), bool):
        raise bad("max_tokens is required: an integer", "max_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty array", "messages")
    turns = []
    if body.get("system") is not None:
        turns.append({"role": "system", "content": _text_of(body["system"], "system")})
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad(f"messages[{i}] must be an object", f"messages[{i}]")
        turns += _turns(message, i)
    choice = _tool_choice(body.get("tool_choice"))
    thinking = body.get("thinking")
    stop = list(check_stop(body.get("stop_sequences"), "stop_sequences")) or None
    chat = {
        "model": body.get("model"),
        "messages": turns,
        "max_tokens": body["max_tokens"],
        "stream": body.get("stream"),
        "stop": stop,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "top_k": body.get("top_k"),
        "tools": _tools(body),
        "tool_choice": choice,
        "k": body.get("k"),  # edge0's per-request profile, checked as the OpenAI API checks it
        "mode": body.get("mode"),
        "draft": body.get("draft"),  # edge0's speculative decoding, checked likewise
        "draft_max": body.get("draft_max"),
    }
    if isinstance(thinking, dict):
        chat["enable_thinking"] = thinking.get("type") == "enabled"
    request = parse_chat({k: v for k, v in chat.items() if v is not None}, model_ids, strict)
    return replace(request, include_usage=False)


def _usage(used: dict) -> dict:
    """Anthropic's usage of OpenAI's (openai_replies.usage), in Anthropic's meaning: the prompt
    is `input_tokens` plus `cache_read_input_tokens`, the part of it the engine's KV cache already
    held (the prompt-cache reuse it measures), so a client adding them counts it once. (The
    message_start event, sent before the prompt is computed, counts the whole prompt as input.)"""
    cached = used.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {
        "input_tokens": used["prompt_tokens"] - cached,
        "output_tokens": used["completion_tokens"],
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


class AnthropicWriter:
    """A reply in Anthropic's shapes, for app.GenerationResponse: SSE events or one body."""

    def __init__(self, request: GenerationRequest, stopped_at_text, prompt_tokens: int = 0) -> None:
        self.request = request
        self.prompt_tokens = prompt_tokens  # known before the first token: message_start says it
        self.id = "msg_" + uuid.uuid4().hex
        self.stopped_at_text = stopped_at_text  # () -> bool: a stop sequence ended the reply
        self.block: str | None = None  # the open block's kind
        self.index = -1

    def _message(self, content: list, stop_reason, used: dict) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.request.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": self._stop_sequence(stop_reason),
            "usage": _usage(used),
        }

    def _stop_reason(self, finish_reason: str) -> str:
        if finish_reason == "stop" and self.stopped_at_text():
            return "stop_sequence"
        return STOP_REASONS.get(finish_reason, "end_turn")

    def _stop_sequence(self, stop_reason) -> str | None:
        # Which sequence matched is not kept; the one stop sequence asked for is it.
        stops = self.request.stop
        return stops[0] if stop_reason == "stop_sequence" and len(stops) == 1 else None

    def start(self) -> list[bytes]:
        used = {"prompt_tokens": self.prompt_tokens, "completion_tokens": 0}
        message = self._message([], None, used)
        return [sse({"type": "message_start", "message": message}, "message_start")]

    def _open(self, kind: str, block: dict) -> list[bytes]:
        out = self._close()
        self.block, self.index = kind, self.index + 1
        event = {"type": "content_block_start", "index": self.index, "content_block": block}
        return out + [sse(event, "content_block_start")]

    def _close(self) -> list[bytes]:
        if self.block is None:
            return []
        self.block = None
        event = {"type": "content_block_stop", "index": self.index}
        return [sse(event, "content_block_stop")]

    def _delta(self, delta: dict) -> bytes:
        event = {"type": "content_block_delta", "index": self.index, "delta": delta}
        return sse(event, "content_block_delta")

    def delta(self, kind: str, text: str, logprobs) -> list[bytes]:
        out = []
        if kind == "reasoning":
            if self.block != "thinking":
                out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            return out + [self._delta({"type": "thinking_delta", "thinking": text})]
        if self.block != "text":
            out += self._open("text", {"type": "text", "text": ""})
        return out + [self._delta({"type": "text_delta", "text": text})]

    def end(self, finish_reason: str, calls: list[ToolCall], used: dict, figures: dict) -> list:
        out = []
        for call in calls:
            block = {"type": "tool_use", "id": use_id(call), "name": call.name, "input": {}}
            out += self._open("tool_use", block)
            out.append(
                self._delta({"type": "input_json_delta", "partial_json": call.arguments_json()})
            )
        out += self._close()
        stop_reason = self._stop_reason(finish_reason)
        delta = {
            "type": "message_delta",
            "delta": {
                "stop_reason": stop_reason,
                "stop_sequence": self._stop_sequence(stop_reason),
            },
            "usage": _usage(used),
            "edge0": figures,
        }
        return out + [sse(delta, "message_delta"), sse({"type": "message_stop"}, "message_stop")]

    def error_event(self, error: ApiError) -> list[bytes]:
        return [sse(error_body(error), "error")]

    def whole(self, content, reasoning, calls, finish_reason, used, figures, logprobs) -> dict:
        blocks: list[dict] = []
        if reasoning:
            blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
        if content:
            blocks.append({"type": "text", "text": content})
        blocks += [
            {"type": "tool_use", "id": use_id(call), "name": call.name, "input": call.arguments}
            for call in calls
        ]
        message = self._message(blocks, self._stop_reason(finish_reason), used)
        return {**message, "edge0": figures}
