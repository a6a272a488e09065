"""The OpenAI API's reply shapes: a chat completion or text completion, whole or streamed.

A reply carries the text, and where the request asked or the model wrote them, the reasoning
(`reasoning_content`, split out by reply_parts.py), tool calls (tool_calls.py) and the tokens'
log-probabilities; `edge0` holds the request's own figures (tokens, speed, the profile).
"""

from __future__ import annotations

import json
import time
import uuid

from .openai_shapes import GenerationRequest
from .tool_calls import ToolCall


class ReplyShapes:
    """The JSON of one reply, streamed chunk by chunk or whole, in the request's kind."""

    def __init__(self, request: GenerationRequest, fingerprint: str | None = None) -> None:
        self.request = request
        self.fingerprint = fingerprint  # the reply's system_fingerprint
        chat = request.kind == "chat"
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.chat = chat
        self._offset = 0  # completions' text_offset: characters of reply before the next token

    def _head(self, object_name: str) -> dict:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.request.model,
            "system_fingerprint": self.fingerprint,
        }

    def _usage_field(self) -> dict:
        return {"usage": None} if self.request.include_usage else {}

    def _logprobs(self, entries: tuple[dict, ...] | list[dict]) -> dict | None:
        """The `logprobs` of a choice: chat's {"content": [...]}, or completions' parallel
        lists; None when the request did not ask for them."""
        if self.request.generation.logprobs is None:
            return None
        if self.chat:
            return {"content": list(entries), "refusal": None}
        offsets = []
        for entry in entries:
            offsets.append(self._offset)
            self._offset += len(entry["token"])
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [
                {t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries
            ],
            "text_offset": offsets,
        }

    def chunk(
        self,
        text: str = "",
        finish_reason: str | None = None,
        role: bool = False,
        figures: dict | None = None,
        logprobs: tuple[dict, ...] = (),
        reasoning: str = "",
        tool_calls: list[dict] | None = None,
    ) -> dict:
        """A streamed chunk: the role first (chat), then text (or reasoning, or tool calls),
        then an empty one that finishes, with the request's figures in `edge0`."""
        shown = self._logprobs(logprobs) if logprobs or finish_reason is None else None
        if self.chat:
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
            if text or role:
                delta["content"] = text
            if reasoning:
                delta["reasoning_content"] = reasoning
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": 0, "delta": delta, "logprobs": shown, "finish_reason": finish_reason}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text, "logprobs": shown, "finish_reason": finish_reason}
            out = {**self._head("text_completion"), "choices": [choice]}
        out.update(self._usage_field())
        if figures is not None:
            out["edge0"] = figures
        return out

    def usage_chunk(self, usage: dict, figures: dict) -> dict:
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return {**head, "choices": [], "usage": usage, "edge0": figures}

    def whole(
        self,
        text: str,
        finish_reason: str,
        usage: dict,
        figures: dict,
        logprobs: list[dict] | tuple = (),
        reasoning: str | None = None,
        tool_calls: list[dict] | None = None,
    ) -> dict:
        if self.chat:
            message: dict = {"role": "assistant", "content": text}
            if reasoning:  # an empty think block is no reasoning
                message["reasoning_content"] = reasoning
            if tool_calls:
                message["tool_calls"] = tool_calls
                message["content"] = text or None
            choice = {
                "index": 0,
                "message": message,
                "logprobs": self._logprobs(logprobs),
                "finish_reason": finish_reason,
            }
            head = self._head("chat.completion")
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": self._logprobs(logprobs),
                "finish_reason": finish_reason,
            }
            head = self._head("text_completion")
        return {**head, "choices": [choice], "usage": usage, "edge0": figures}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; `cached_tokens`: the prompt's tokens the engine's KV cache already held
    (not computed again: the prompt-cache reuse the engine measures)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def system_fingerprint(model_fingerprint: str | None, k: int | None) -> str:
    """What OpenAI's `system_fingerprint` stands for here: the weights (the model's fingerprint:
    its config and routed experts' tensors) and the K profile a reply runs with, e.g.
    `edge0-1a2b3c4d5e6f7a8b-k4`."""
    weights = model_fingerprint or "unknown"
    return f"edge0-{weights}" + (f"-k{k}" if k is not None else "")


def model_card(model_id: str, created: int, details: dict) -> dict:
    return {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": "edge0",
        "edge0": details,
    }


def sse(payload: dict, event: str | None = None) -> bytes:
    """One server-sent event: `data: JSON` (after `event: NAME` where the API names events)."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + data + b"\n\n"


def tool_call_json(call: ToolCall, index: int | None = None) -> dict:
    out = {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments_json()},
    }
    return out if index is None else {"index": index, **out}


class OpenAIWriter:
    """A reply in OpenAI's shapes, for app.GenerationResponse: SSE chunks or one body."""

    def __init__(self, request: GenerationRequest, fingerprint: str | None = None) -> None:
        self.shapes = ReplyShapes(request, fingerprint)
        self.request = request

    def start(self) -> list[bytes]:
        return [sse(self.shapes.chunk(role=True))] if self.shapes.chat else []

    def delta(self, kind: str, text: str, logprobs: tuple[dict, ...]) -> list[bytes]:
        if kind == "reasoning":
            return [sse(self.shapes.chunk(reasoning=text, logprobs=logprobs))]
        return [sse(self.shapes.chunk(text, logprobs=logprobs))]

    def end(self, finish_reason: str, calls: list[ToolCall], used: dict, figures: dict) -> list:
        out = []
        if calls:  # each call whole in one delta: a client joins the pieces it gets
            deltas = [tool_call_json(call, i) for i, call in enumerate(calls)]
            out.append(sse(self.shapes.chunk(tool_calls=deltas)))
        out.append(sse(self.shapes.chunk(finish_reason=finish_reason, figures=figures)))
        if self.request.include_usage:
            out.append(sse(self.shapes.usage_chunk(used, figures)))
        return out + [DONE]

    def error_event(self, error) -> list[bytes]:
        return [sse(error.body()), DONE]

    def whole(self, content, reasoning, calls, finish_reason, used, figures, logprobs) -> dict:
        tool_calls = [tool_call_json(call) for call in calls] or None
        return self.shapes.whole(
            content, finish_reason, used, figures, logprobs, reasoning, tool_calls
        )


# What an SSE client sees after the last chunk.
DONE = b"data: [DONE]\n\n"
