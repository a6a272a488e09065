"""The OpenAI API's shapes: request bodies checked field by field, replies and errors built.

Every check here names the field it refuses (`param` in the error body), so a client sees which
part of its request was wrong. Sampling values go through `GenerationConfig`, the one check the
CLI and the app share; everything else the engine cannot honour (several choices, an echo) is
refused rather than silently ignored. Fields that change nothing (`user`, `metadata`, `store`,
...) are accepted and ignored.

A reply's required form is checked here for its shape (`OutputFormat`: `response_format`
json_object or json_schema, llama.cpp's top-level `json_schema` and `grammar`; `forced_tools`:
`tool_choice` "required" or a named function) and compiled into a grammar for the model's
tokenizer off the event loop (structured.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace

from engine import MODES, Edge0Error, GenerationConfig

# A reply's length when the request does not say (`max_tokens` / `max_completion_tokens`).
DEFAULT_MAX_TOKENS = 512
# OpenAI takes up to 4 stop sequences. Their length is edge0's bound: the reply's last
# characters are held back while they could still begin one, and a stop sequence longer than any
# reply would only hold text back.
MAX_STOP = 4
MAX_STOP_CHARS = 1000
# A lone surrogate (a JSON "\ud800" escape without its pair) is not text: no tokenizer encodes
# it and no reply can carry it back.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")
# A token id as logit_bias writes it: ASCII digits (str.isdigit() also takes "²" and other
# digits int() refuses), no more of them than any vocabulary's ids have.
TOKEN_ID = re.compile("[0-9]{1,10}")
# The deepest nesting of a JSON value handed to the chat template (a tool's schema, a call's
# arguments, chat_template_kwargs): templates write them out recursively (`tojson`), and Python's
# recursion limit is not a client's business. Real schemas nest a handful of levels.
MAX_TEMPLATE_NESTING = 64
# transformers' apply_chat_template takes these itself (its parameters), so that in
# chat_template_kwargs they would change how the prompt is made (tensors instead of token ids,
# another template, truncation) instead of reaching the template as variables.
# test_server_hostile.py checks the list against transformers' signature.
RENDERING_ARGUMENTS = frozenset(
    {
        "conversation", "messages", "tools", "documents", "chat_template",
        "add_generation_prompt", "continue_final_message", "tokenize", "sanitize_control_tokens",
        "padding", "truncation", "max_length", "return_tensors", "return_dict",
        "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip
ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


class ApiError(Exception):
    """An error the client sees, in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True)
class OutputFormat:
    """The form a reply must take, as the request gave it: a JSON schema (`kind` "json_schema")
    or a GBNF grammar's text ("gbnf"); `field` is where in the request, for errors."""

    kind: str
    value: object
    field: str


@dataclass(frozen=True)
class GenerationRequest:
    """What the engine thread needs for one reply, checked."""

    kind: str  # "chat" or "completion"
    model: str  # the id the reply names: the served model's own
    messages: tuple[dict, ...] | None  # chat: role/content dicts for the chat template
    prompt: str | None  # completion: encoded as is
    generation: GenerationConfig
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    k: int | None
    mode: str | None
    # Chat: the tools the model may call (OpenAI's `tools`, handed to the chat template), and
    # the template's own switches (`enable_thinking`, `chat_template_kwargs`).
    tools: tuple[dict, ...] | None = None
    template_kwargs: dict | None = None
    # No max_tokens in the request: DEFAULT_MAX_TOKENS, or what the context has left after the
    # prompt when that is less (the engine thread knows the prompt's length).
    default_max_tokens: bool = False
    # The name the request asked for when it is none of the served model's (any name is
    # answered by the one model, unless the server runs with --strict-model-name): for the log.
    asked_model: str | None = None
    # The form the reply must take (None: any text), and the tools one of which it must call
    # (`tool_choice` "required": all of them; a named function: that one). At most one of them.
    output: OutputFormat | None = None
    forced_tools: tuple[dict, ...] | None = None


# -- checking fields ---------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _optional(body: dict, name: str, check, wanted: str):
    value = body.get(name)
    if value is not None and not check(value):
        raise bad(f"{name} must be {wanted}, not {_json_type(value)}", name)
    return value


def _shown(value: object) -> str:
    """A client's value in an error message: strings quoted and cut short, others by type."""
    if isinstance(value, str):
        shown = repr(value)
        return shown if len(shown) <= 60 else shown[:57] + "..."
    return _json_type(value)


def check_text(value: str, where: str) -> str:
    """`value`, refused (naming `where`) when it holds a lone surrogate."""
    found = LONE_SURROGATE.search(value)
    if found:
        raise bad(
            f"{where} holds a lone surrogate (U+{ord(found.group()):04X} at character "
            f"{found.start()}), which is not text",
            where,
        )
    return value


def check_template_value(value: object, where: str) -> None:
    """A JSON value the chat template is given, refused (naming `where` and the part of it at
    fault) when a string in it, key or value, holds a lone surrogate, or when it nests deeper than
    MAX_TEMPLATE_NESTING. Walked without recursion: the depth is what is being checked."""
    pending = [(value, where, 0)]
    while pending:
        item, path, depth = pending.pop()
        if depth > MAX_TEMPLATE_NESTING:
            raise bad(f"{where} nests more than {MAX_TEMPLATE_NESTING} levels deep", where)
        if isinstance(item, str):
            check_text(item, path)
        elif isinstance(item, dict):
            for key, inner in item.items():
                check_text(key, path)
                pending.append((inner, f"{path}.{key}", depth + 1))
        elif isinstance(item, list):
            pending += [(inner, f"{path}[{i}]", depth + 1) for i, inner in enumerate(item)]


def _json_type(value: object) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return "null"


def _refuse_unless(body: dict, name: str, allowed, why: str) -> None:
    value = body.get(name)
    if value is not None and not allowed(value):
        raise bad(f"{name} is not supported: {why}", name)


def check_model(body: dict, model_ids: tuple[str, ...], strict: bool = False) -> str | None:
    """The name the request asks for when it is none of `model_ids` (None: one of them, or no
    name). One model is served: any name gets it (front ends send a default, `gpt-4o`), unless
    `strict`, where another name is a 404."""
    model = _optional(body, "model", lambda v: isinstance(v, str), "a string")
    if model is None or model in model_ids:
        return None
    if strict:
        raise ApiError(
            404,
            f"the model {_shown(model)} does not exist here (this server runs {model_ids[0]!r})",
            param="model",
            code="model_not_found",
        )
    return check_text(model, "model")


def _generation(body: dict, max_tokens_field: tuple[str, ...], chat: bool) -> GenerationConfig:
    max_tokens = None
    for name in max_tokens_field:
        value = _optional(body, name, _is_int, "an integer")
        if value is not None:
            if value < 1:
                raise bad(f"{name}={value} must be at least 1", name)
            max_tokens = value
            break
    numbers = {
        name: _optional(body, name, _is_number, "a number")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty")
        + ("presence_penalty", "frequency_penalty")
    }
    given = {name: value for name, value in numbers.items() if value is not None}
    top_k = _optional(body, "top_k", _is_int, "an integer")
    seed = _optional(body, "seed", _is_int, "an integer")
    # mlx-lm's server's name for the tokens the penalties look back over.
    context = _optional(body, "repetition_context_size", _is_int, "an integer")
    if context is not None:
        given["penalty_context"] = context
    # edge0's speculative decoding, for this request: a drafter ("lookup") and its longest draft.
    given["draft"] = _optional(body, "draft", lambda v: isinstance(v, str), "a string (lookup)")
    draft_max = _optional(body, "draft_max", _is_int, "an integer")
    if draft_max is not None:
        given["draft_max"] = draft_max
    try:
        return GenerationConfig(
            **{"temperature": 1.0, **given},
            max_tokens=max_tokens or DEFAULT_MAX_TOKENS,
            top_k=top_k or 0,
            seed=seed,
            logit_bias=_logit_bias(body),
            logprobs=_logprobs(body, chat),
        )
    except Edge0Error as e:  # the check the CLI and the app share; it names the field
        field = re.match(r"(\w+)=", str(e))
        name = field.group(1) if field else None
        if name == "penalty_context":  # the request's name for it
            name = "repetition_context_size"
            e = Edge0Error(str(e).replace("penalty_context", name, 1))
        raise bad(str(e), name) from None


def _logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's logit_bias: an object from token ids (as strings) to a bias in [-100, 100]."""
    bias = _optional(body, "logit_bias", lambda v: isinstance(v, dict), "an object")
    out = {}
    for key, value in (bias or {}).items():
        if not TOKEN_ID.fullmatch(key) or not _is_number(value):
            raise bad(
                f"logit_bias maps token ids (strings of up to 10 digits) to numbers, not "
                f"{_shown(key)}: {_json_type(value)}",
                "logit_bias",
            )
        out[int(key)] = value
    return out


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives each token's log-probability comes with (None: no log-probs).
    Chat: `logprobs` true and `top_logprobs` N; completions: `logprobs` N."""
    if not chat:
        return _optional(body, "logprobs", _is_int, "an integer (the alternatives per token)")
    wanted = _optional(body, "logprobs", lambda v: isinstance(v, bool), "a boolean")
    top = _optional(body, "top_logprobs", _is_int, "an integer")
    if top is not None and not wanted:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    if top is not None and not 0 <= top <= 20:
        raise bad(f"top_logprobs={top} must be between 0 and 20", "top_logprobs")
    return (top or 0) if wanted else None


def _no_max_tokens(body: dict, fields: tuple[str, ...]) -> bool:
    return all(body.get(name) is None for name in fields)


def check_stop(stop: object, name: str = "stop") -> tuple[str, ...]:
    """Stop sequences (a string or an array of strings, None: none), checked; `name` is the
    field as the request's API calls it (OpenAI's `stop`, Anthropic's `stop_sequences`)."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad(f"{name} must be a string or an array of strings", name)
    if len(stop) > MAX_STOP:
        raise bad(f"{name} takes at most {MAX_STOP} sequences, not {len(stop)}", name)
    if any(s == "" for s in stop):
        raise bad(f"{name}: stop sequences must not be empty", name)
    longest = max(len(s) for s in stop)
    if longest > MAX_STOP_CHARS:
        raise bad(
            f"{name}: stop sequences may have at most {MAX_STOP_CHARS} characters each, not "
            f"{longest}",
            name,
        )
    return tuple(check_text(s, name) for s in stop)


def _profile(body: dict) -> tuple[int | None, str | None]:
    k = _optional(body, "k", _is_int, "an integer (edge0's routing width)")
    mode = _optional(body, "mode", lambda v: isinstance(v, str), "a string")
    if mode is not None and mode not in MODES:
        raise bad(f"unknown mode {mode!r}: choose one of {', '.join(MODES)}", "mode")
    return k, mode


def _stream(body: dict) -> tuple[bool, bool]:
    stream = bool(_optional(body, "stream", lambda v: isinstance(v, bool), "a boolean"))
    options = _optional(body, "stream_options", lambda v: isinstance(v, dict), "an object")
    if options is None:
        return stream, False
    if not stream:  # as OpenAI answers it: the options of a stream that is not one
        raise bad("stream_options is only allowed when stream is true", "stream_options")
    include_usage = _optional(
        options, "include_usage", lambda v: isinstance(v, bool), "a boolean (stream_options)"
    )
    return stream, bool(include_usage)


def _unsupported(body: dict) -> None:
    """Refuse what would change the reply but the engine does not do."""
    _refuse_unless(body, "n", lambda v: v == 1, "one choice per request (n=1)")
    _refuse_unless(body, "best_of", lambda v: v == 1, "one choice per request")
    _refuse_unless(body, "echo", lambda v: v is False, "the prompt is not echoed")
    _refuse_unless(body, "suffix", lambda v: False, "no insertion")
    _refuse_unless(body, "functions", lambda v: v == [], "send them as tools")


def _output_format(body: dict) -> OutputFormat | None:
    """The reply's required form: `response_format`, or llama.cpp's top-level `json_schema` (a
    schema) or `grammar` (GBNF); at most one of them."""
    formats = []
    if body.get("response_format") is not None:
        formats.append(_response_format(body["response_format"]))
    schema = body.get("json_schema")
    if schema is not None:
        if not isinstance(schema, dict):
            raise bad(
                f"json_schema must be an object (a JSON schema), not {_json_type(schema)}",
                "json_schema",
            )
        formats.append(OutputFormat("json_schema", schema, "json_schema"))
    grammar = body.get("grammar")
    if grammar is not None:
        if not isinstance(grammar, str) or not grammar.strip():
            raise bad("grammar must be a GBNF grammar (a non-empty string)", "grammar")
        formats.append(OutputFormat("gbnf", check_text(grammar, "grammar"), "grammar"))
    formats = [f for f in formats if f is not None]
    if len(formats) > 1:
        raise bad(
            "give one of response_format, json_schema and grammar, not several", formats[1].field
        )
    return formats[0] if formats else None


def _response_format(value: object) -> OutputFormat | None:
    """OpenAI's response_format: text (None), json_object, or json_schema {name, schema, strict}."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputFormat("json_schema", {"type": "object"}, "response_format")
    if kind != "json_schema":
        raise bad(
            'response_format must be {"type": "text"}, {"type": "json_object"} or '
            '{"type": "json_schema", "json_schema": {...}}, not '
            + (_shown(kind) if isinstance(value, dict) else _json_type(value)),
            "response_format",
        )
    where = "response_format.json_schema"
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad(f'{where} must be an object: {{"name": ..., "schema": {{...}}}}', where)
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise bad(f"{where}.name must be a non-empty string", f"{where}.name")
    _optional(spec, "strict", lambda v: isinstance(v, bool), "a boolean")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise bad(
            f"{where}.schema must be an object (a JSON schema), not {_json_type(schema)}",
            f"{where}.schema",
        )
    return OutputFormat("json_schema", schema, f"{where}.schema")


def _content(message: dict, index: int) -> str:
    content = message.get("content")
    where = f"messages[{index}].content"
    if content is None:
        if message.get("role") == "assistant":
            return ""
        raise bad(f"{where} is missing", where)
    if isinstance(content, str):
        return check_text(content, where)
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad(f"{where}: only text parts are supported", where)
            if not isinstance(part.get("text"), str):
                raise bad(f"{where}: a text part needs a string `text`", where)
            parts.append(check_text(part["text"], where))
        return "".join(parts)
    raise bad(f"{where} must be a string or an array of text parts", where)


def _messages(body: dict) -> tuple[dict, ...]:
    messages = body.get("messages")
    if messages is None:
        raise bad("messages is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty array", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad(f"messages[{i}] must be an object", f"messages[{i}]")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:  # a list or an object is unhashable
            raise bad(
                f"messages[{i}].role must be one of {', '.join(ROLES)}, not {_shown(role)}",
                f"messages[{i}].role",
            )
        entry = {"role": ROLES[role], "content": _content(message, i)}
        if role == "assistant" and message.get("tool_calls"):
            entry["tool_calls"] = _history_calls(message["tool_calls"], i)
        if role == "tool":
            for field in ("tool_call_id", "name"):
                if isinstance(message.get(field), str):
                    entry[field] = check_text(message[field], f"messages[{i}].{field}")
        out.append(entry)
    return tuple(out)


def _history_calls(calls: object, index: int) -> list[dict]:
    """An assistant turn's tool_calls as chat templates read them: arguments as an object."""
    where = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise bad(f"{where} must be an array", where)
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad(f"{where}: each call needs a function with a name", where)
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except (ValueError, RecursionError):
                raise bad(
                    f"{where}: arguments of {_shown(function['name'])} are not JSON", where
                ) from None
        call_id = call.get("id") if isinstance(call.get("id"), str) else ""
        check_text(call_id, f"{where}[{j}].id")
        check_text(function["name"], f"{where}[{j}].function.name")
        check_template_value(arguments, f"{where}[{j}].function.arguments")
        out.append(
            {
                "id": call_id,
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return out


def _tool_choice(choice: object) -> str:
    """ "auto", "none", "required", or the name of the one function the reply must call."""
    if choice is None:
        return "auto"
    if choice in ("auto", "none", "required"):
        return choice
    function = choice.get("function") if isinstance(choice, dict) else None
    if (
        not isinstance(choice, dict)
        or choice.get("type") != "function"
        or not isinstance(function, dict)
        or not isinstance(function.get("name"), str)
    ):
        raise bad(
            'tool_choice must be "auto", "none", "required" or {"type": "function", '
            '"function": {"name": ...}}',
            "tool_choice",
        )
    return function["name"]


def _forced_tools(tools: tuple[dict, ...] | None, choice: str) -> tuple[dict, ...] | None:
    """The tools one of which the reply must call (None: it need not call one)."""
    if choice in ("auto", "none"):
        return None
    if not tools:
        raise bad(f"tool_choice {_shown(choice)} needs tools to call", "tool_choice")
    if choice == "required":
        return tools
    named = tuple(t for t in tools if t["function"]["name"] == choice)
    if not named:
        raise bad(f"tool_choice names {_shown(choice)}, which is not one of tools", "tool_choice")
    return named[:1]


def _tools(body: dict) -> tuple[dict, ...] | None:
    """`tools` as the chat template reads them; None when the model may call none
    (`tool_choice: "none"`)."""
    tools = body.get("tools")
    choice = _tool_choice(body.get("tool_choice"))
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise bad("tools must be an array", "tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function":
            raise bad(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', "tools")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise bad(f"tools[{i}].function needs a name", "tools")
        # The function nests as deep as an Anthropic tool: both APIs refuse the same schemas.
        check_template_value(function, f"tools[{i}].function")
        check_template_value({k: v for k, v in tool.items() if k != "function"}, f"tools[{i}]")
    return None if choice == "none" else tuple(tools)


def _template_kwargs(body: dict) -> dict:
    """What the chat template is given besides the messages: `chat_template_kwargs` (an
    object), and `enable_thinking` (a boolean, as vLLM and mlx-lm take it)."""
    kwargs = _optional(body, "chat_template_kwargs", lambda v: isinstance(v, dict), "an object")
    out = dict(kwargs or {})
    thinking = _optional(body, "enable_thinking", lambda v: isinstance(v, bool), "a boolean")
    if thinking is not None:
        out["enable_thinking"] = thinking
    reserved = RENDERING_ARGUMENTS & set(out)
    if reserved:
        raise bad(
            f"chat_template_kwargs may not set {', '.join(sorted(reserved))}: the server makes "
            "the prompt with them",
            "chat_template_kwargs",
        )
    check_template_value(out, "chat_template_kwargs")
    return out


def parse_chat(body: dict, model_ids: tuple[str, ...], strict: bool = False) -> GenerationRequest:
    """A chat completion request, checked; `model_ids`: the served model's ids, its own first
    (`strict`: refuse any other name)."""
    asked = check_model(body, model_ids, strict)
    messages = _messages(body)
    request = _request(
        body, "chat", model_ids[0], ("max_completion_tokens", "max_tokens"), messages=messages
    )
    tools = _tools(body)
    forced = _forced_tools(tools, _tool_choice(body.get("tool_choice")))
    if forced and request.output is not None:
        raise bad(
            f"give {request.output.field} or a tool_choice that forces a call, not both",
            "tool_choice",
        )
    return replace(
        request,
        tools=tools,
        template_kwargs=_template_kwargs(body),
        asked_model=asked,
        forced_tools=forced,
    )


def parse_completion(
    body: dict, model_ids: tuple[str, ...], strict: bool = False
) -> GenerationRequest:
    """A text completion request, checked (`model_ids`, `strict`: as parse_chat's)."""
    asked = check_model(body, model_ids, strict)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if prompt is None:
        raise bad("prompt is required", "prompt")
    if not isinstance(prompt, str):
        raise bad("prompt must be a string (one prompt per request)", "prompt")
    if not prompt:
        raise bad("prompt must not be empty", "prompt")
    request = _request(
        body, "completion", model_ids[0], ("max_tokens",), prompt=check_text(prompt, "prompt")
    )
    return replace(request, asked_model=asked)


def _request(
    body: dict,
    kind: str,
    model: str,
    max_token_fields: tuple[str, ...],
    messages: tuple[dict, ...] | None = None,
    prompt: str | None = None,
) -> GenerationRequest:
    """What chat and completion requests share, checked in this order after their own input."""
    _unsupported(body)
    stream, include_usage = _stream(body)
    k, mode = _profile(body)
    return GenerationRequest(
        kind=kind,
        model=model,
        messages=messages,
        prompt=prompt,
        generation=_generation(body, max_token_fields, kind == "chat"),
        default_max_tokens=_no_max_tokens(body, max_token_fields),
        stop=check_stop(body.get("stop")),
        stream=stream,
        include_usage=include_usage,
        k=k,
        mode=mode,
        output=_output_format(body),
    )
