"""Tool calls in the text a model writes, one parser per dialect of the families edge0 runs.

A model calls a tool by writing it in its own dialect, as its chat template taught it; the
template also says which dialect it expects (`dialect_of` reads its markers). Each dialect has
the markers that open a call in the reply (`Dialect.starts`: from there on the reply is held
back, not streamed as text) and a parser: a plain function from the reply's text to the text
outside calls and the calls found (`ToolCall`: a name and its arguments as a JSON object).

The reply is the model's, so it may be anything. Two rules hold for every dialect:
- its JSON is decoded by `_decode` alone, which refuses nesting past MAX_DEPTH, and each call
  found is checked to encode as UTF-8; a call that fails either is `NotACall`, and
  `Dialect.parse` gives the whole reply back as text;
- its tags are found with `str.find` (through `_Finder`) and regexes that match a character one
  way only, so the work is linear in the reply's length, however it repeats a call's start.

Dialects (as the families' chat templates write them):
- qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen3, Hermes) or, inside the
  same tags, `<function=NAME><parameter=P>value</parameter></function>` (Qwen3-Coder, Qwen3.5);
- glm: `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>` (GLM-4.5; Ling
  writes the same);
- deepseek: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` then ```json
  {...}``` (V3), or `NAME<｜tool▁sep｜>{...}` (V3.1), ending `<｜tool▁call▁end｜>`;
- kimi: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0
  <|tool_call_argument_begin|>{...}<|tool_call_end|>`;
- harmony (gpt-oss): `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}
  <|call|>`;
- mistral (Mixtral): `[TOOL_CALLS] [{"name": ..., "arguments": {...}}]`;
- minimax: `<minimax:tool_call><invoke name="NAME"><parameter name="P">V</parameter></invoke>
  </minimax:tool_call>` (M2), or `<tool_calls>{"name": ..., "arguments": ...}</tool_calls>` (M1).

A call the request forces (`tool_choice` required or named) is written under a grammar
(`forced_call_grammar`, for engine/runtime/constraint.py): one call, in the dialect's syntax, with
arguments that match the tool's schema. A template with no dialect gets the bare JSON form
(`JSON_CALL`: `{"name": ..., "arguments": {...}}`, the whole reply).
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# How deep a call's JSON may nest. Decoding and encoding JSON recurse once a level, so a reply of
# nothing but `[` would end in a RecursionError; no tool's arguments come near this.
MAX_DEPTH = 64


class NotACall(Exception):
    """A call that cannot be sent on (nested past MAX_DEPTH, or text UTF-8 cannot carry): the
    reply it is in is given back as text. Not a ValueError: `_value` must not take it for text."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    id: str = ""

    def with_id(self) -> ToolCall:
        return self if self.id else ToolCall(self.name, self.arguments, "call_" + uuid.uuid4().hex)

    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


Parsed = tuple[str, list[ToolCall]]  # the text outside calls, and the calls


@dataclass(frozen=True)
class Dialect:
    name: str
    starts: tuple[str, ...]  # what opens a call in the reply
    read: Callable[[str], Parsed]  # the dialect's parser; may raise NotACall

    def parse(self, text: str) -> Parsed:
        """The text outside calls and the calls; a reply with a call that cannot be sent on is
        all text, no calls."""
        try:
            left, calls = self.read(text)
            for call in calls:
                _check_sendable(call)
        except NotACall:
            return text.strip(), []
        return left, calls


def _check_sendable(call: ToolCall) -> None:
    """Raise NotACall unless the call's name and arguments encode as UTF-8 (a lone surrogate,
    which a JSON `\\ud800` decodes to, does not: the reply would fail as it is sent)."""
    try:
        call.name.encode()
        call.arguments_json().encode()
    except UnicodeEncodeError:
        raise NotACall from None


# -- bounded JSON: every dialect decodes its JSON here ------------------------------------------

# A JSON string (each character matched one way only: linear), a bracket, or a quote that opens
# a string never closed (where the scan stops: the text is not JSON past it).
_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]|"', re.S)
_NESTING = {"[": 1, "{": 1, "]": -1, "}": -1}


def _check_depth(text: str) -> None:
    """Raise NotACall where the brackets outside strings nest past MAX_DEPTH."""
    depth = 0
    for token in _JSON_TOKEN.finditer(text):
        step = _NESTING.get(token.group())
        if step is None:
            if len(token.group()) == 1:  # an unclosed string
                return
            continue
        depth += step
        if depth > MAX_DEPTH:
            raise NotACall


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: JSON has no infinity to send it back as
        raise ValueError(f"{text} is out of range")
    return value


def _not_json(name: str):
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_float=_finite, parse_constant=_not_json)


def _decode(text: str) -> object:
    """JSON `text`'s value. ValueError: not JSON; NotACall: nested past MAX_DEPTH."""
    _check_depth(text)
    return _DECODER.decode(text)


def _decode_prefix(text: str) -> tuple[object, int]:
    """The JSON value `text` starts with, and where it ends; raises as `_decode`."""
    _check_depth(text)
    return _DECODER.raw_decode(text)


def _value(text: str):
    """A parameter's value as written in XML-ish dialects: JSON where it is JSON, else text."""
    text = text.strip("\n")
    try:
        return _decode(text)
    except ValueError:
        return text


def _json_object(text: str) -> dict | None:
    try:
        value = _decode(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _call_of_json(value: object) -> ToolCall | None:
    """{"name": ..., "arguments": {...} or "{...}"} (arguments also as `parameters`)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = _json_object(arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], arguments)


# -- linear scanning: every dialect finds its tags here -----------------------------------------
# No regex here repeats over text another part of it may also take: a reply made to look like
# many unfinished calls costs time in its length, not its square.


class _Finder:
    """`str.find` on one text, remembering each needle's last answer: asked again from a later
    point no further than that answer, it answers without searching. So a scan that asks from
    each of many starts before one far occurrence searches the text between once."""

    def __init__(self, text: str) -> None:
        self.text = text
        self._last: dict[str, tuple[int, int]] = {}  # needle -> (searched from, found at)

    def find(self, needle: str, start: int) -> int:
        searched, at = self._last.get(needle, (-1, -1))
        if 0 <= searched <= start and (at < 0 or at >= start):
            return at
        at = self.text.find(needle, start)
        self._last[needle] = (start, at)
        return at


# What a name between tags never holds: a stray tag or a broken line means it is not a name.
_NOT_IN_NAMES = '\n"<>'


def _last_flaw(name: str) -> int:
    return max(name.rfind(c) for c in _NOT_IN_NAMES)


def _tags(
    text: str, open_tag: str, name_end: str, close_tag: str, stop_at: str | None = None
) -> list[tuple[str, str]]:
    """(name, body) of each `open_tag NAME name_end BODY close_tag` in `text`: NAME runs to the
    first name_end, is not empty and holds nothing of _NOT_IN_NAMES; BODY runs to the first
    close_tag, or to `stop_at` (which begins the next), or to the end."""
    found = _Finder(text)
    tags = []
    at = found.find(open_tag, 0)
    while at >= 0:
        name_from = at + len(open_tag)
        name_to = found.find(name_end, name_from)
        if name_to < 0:
            break
        name = text[name_from:name_to]
        flaw = _last_flaw(name)
        if not name or flaw >= 0:
            # A tag that opens before the flaw has it in its name too: look past it.
            at = found.find(open_tag, max(at + 1, name_from + flaw - len(open_tag) + 1))
            continue
        body_from = name_to + len(name_end)
        close = found.find(close_tag, body_from)
        stop = found.find(stop_at, body_from) if stop_at else -1
        if stop >= 0 and (close < 0 or stop < close):
            body_to, after = stop, stop
        elif close >= 0:
            body_to, after = close, close + len(close_tag)
        else:
            body_to = after = len(text)
        tags.append((name, text[body_from:body_to]))
        at = found.find(open_tag, after)
    return tags


def _blocks(
    text: str, open_tag: str, close_tag: str, body: Callable[[str], list[ToolCall]]
) -> Parsed:
    """Calls in every open_tag...close_tag block (an unclosed last block runs to the end); the
    text outside them is kept. A block that does not parse stays in the text."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    done = 0
    while (start := text.find(open_tag, done)) >= 0:
        end = text.find(close_tag, start + len(open_tag))
        inner_to = len(text) if end < 0 else end
        stop = len(text) if end < 0 else end + len(close_tag)
        found = body(text[start + len(open_tag) : inner_to])
        kept.append(text[done:start])
        if found:
            calls.extend(found)
        else:
            kept.append(text[start:stop])
        done = stop
    kept.append(text[done:])
    return "".join(kept).strip(), calls


# -- qwen ---------------------------------------------------------------------------------------


def _qwen_body(inner: str) -> list[ToolCall]:
    inner = inner.strip()
    if inner.startswith("<function="):
        calls = []
        for name, body in _tags(inner, "<function=", ">", "</function>"):
            parameters = _tags(body, "<parameter=", ">", "</parameter>", stop_at="<parameter=")
            calls.append(ToolCall(name.strip(), {k.strip(): _value(v) for k, v in parameters}))
        return calls
    call = _call_of_json(_json_object(inner))
    return [call] if call else []


def parse_qwen(text: str) -> Parsed:
    return _blocks(text, "<tool_call>", "</tool_call>", _qwen_body)


# -- glm / ling ---------------------------------------------------------------------------------

_GLM_VALUE_OPEN = re.compile(r"\s*<arg_value>")


def _glm_arguments(text: str) -> dict:
    """<arg_key>K</arg_key> <arg_value>V</arg_value>, each; a key with no value is skipped."""
    found = _Finder(text)
    arguments = {}
    at = found.find("<arg_key>", 0)
    while at >= 0:
        key_from = at + len("<arg_key>")
        key_to = found.find("</arg_key>", key_from)
        if key_to < 0:
            break
        value_open = _GLM_VALUE_OPEN.match(text, key_to + len("</arg_key>"))
        if value_open is None:
            at = found.find("<arg_key>", key_to)
            continue
        value_to = found.find("</arg_value>", value_open.end())
        if value_to < 0:
            value_to = len(text)
        arguments[text[key_from:key_to].strip()] = _value(text[value_open.end() : value_to])
        at = found.find("<arg_key>", value_to)
    return arguments


def _glm_body(inner: str) -> list[ToolCall]:
    name, _, rest = inner.partition("<arg_key>")
    name = name.strip()
    if not name or "<" in name:
        return []
    return [ToolCall(name, _glm_arguments("<arg_key>" + rest))]


def parse_glm(text: str) -> Parsed:
    return _blocks(text, "<tool_call>", "</tool_call>", _glm_body)


# -- deepseek -----------------------------------------------------------------------------------

DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = (
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
)


def _unfenced(body: str) -> str:
    """What the first ``` fence holds (```json opens one too); `body` itself without a fence."""
    start = body.find("```")
    end = body.find("```", start + 3) if start >= 0 else -1
    if end < 0:
        return body
    return body[start + 3 : end].removeprefix("json").strip()


def _deepseek_call(inner: str) -> list[ToolCall]:
    head, sep, body = inner.partition(DS_SEP)
    if not sep:
        return []
    if head.strip() == "function":  # V3: function<sep>NAME\n```json ... ```
        name, _, body = body.partition("\n")
        body = _unfenced(body)
    else:  # V3.1: NAME<sep>{...}
        name = head
    arguments = _json_object(body.strip())
    return [ToolCall(name.strip(), arguments)] if arguments is not None and name.strip() else []


def parse_deepseek(text: str) -> Parsed:
    before, sep, section = text.partition(DS_CALLS_BEGIN)
    if not sep:
        return text.strip(), []
    section, _, after = section.partition(DS_CALLS_END)
    leftover, calls = _blocks(section, DS_CALL_BEGIN, DS_CALL_END, _deepseek_call)
    if not calls:
        return text.strip(), []
    return (before + leftover + after).strip(), calls


# -- kimi ---------------------------------------------------------------------------------------

KIMI_BEGIN, KIMI_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL, KIMI_ARGUMENTS, KIMI_CALL_END = (
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)
# What comes between a call's two tags: `functions.NAME:0` (a name holds no `:`, so the split is
# one way only).
_KIMI_HEAD = re.compile(r"\s*(?:functions\.)?([\w.\-]+?)(?::\d+)?\s*")


def parse_kimi(text: str) -> Parsed:
    before, sep, section = text.partition(KIMI_BEGIN)
    if not sep:
        return text.strip(), []
    section, _, after = section.partition(KIMI_END)
    found = _Finder(section)
    calls = []
    at = found.find(KIMI_CALL, 0)
    while at >= 0:
        head_from = at + len(KIMI_CALL)
        arguments_at = found.find(KIMI_ARGUMENTS, head_from)
        if arguments_at < 0:
            break
        head = _KIMI_HEAD.fullmatch(section, head_from, arguments_at)
        if head is None:
            at = found.find(KIMI_CALL, head_from)
            continue
        body_from = arguments_at + len(KIMI_ARGUMENTS)
        end = found.find(KIMI_CALL_END, body_from)
        body_to = len(section) if end < 0 else end
        arguments = _json_object(section[body_from:body_to].strip())
        if arguments is None:
            return text.strip(), []
        calls.append(ToolCall(head.group(1), arguments))
        at = found.find(KIMI_CALL, body_to)
    return (before + after).strip(), calls


# -- harmony (gpt-oss) --------------------------------------------------------------------------

HARMONY_CALL, HARMONY_MESSAGE, HARMONY_END = (
    "<|channel|>commentary to=functions.",
    "<|message|>",
    "<|call|>",
)
HARMONY_START = "<|start|>assistant"  # may come before a call: it goes with it
_HARMONY_NAME = re.compile(r"[\w.\-]+")
# Between the name and the message: `<|constrain|>json`, or nothing (spaces aside).
_HARMONY_CONSTRAINT = re.compile(r"\s*(?:<\|constrain\|>\s*json\s*)?")


def parse_harmony(text: str) -> Parsed:
    found = _Finder(text)
    calls: list[ToolCall] = []
    kept: list[str] = []
    done = 0
    at = found.find(HARMONY_CALL, 0)
    while at >= 0:
        name_from = at + len(HARMONY_CALL)
        message = found.find(HARMONY_MESSAGE, name_from)
        if message < 0:
            break
        name = _HARMONY_NAME.match(text, name_from, message)
        if name is None or not _HARMONY_CONSTRAINT.fullmatch(text, name.end(), message):
            at = found.find(HARMONY_CALL, name_from)
            continue
        body_from = message + len(HARMONY_MESSAGE)
        end = found.find(HARMONY_END, body_from)
        body_to = len(text) if end < 0 else end
        arguments = _json_object(text[body_from:body_to].strip())
        if arguments is None:
            return text.strip(), []
        calls.append(ToolCall(name.group(), arguments))
        kept.append(text[done:at].removesuffix(HARMONY_START))
        done = len(text) if end < 0 else end + len(HARMONY_END)
        at = found.find(HARMONY_CALL, done)
    if not calls:
        return text.strip(), []
    kept.append(text[done:])
    return "".join(kept).strip(), calls


# -- mistral ------------------------------------------------------------------------------------


def parse_mistral(text: str) -> Parsed:
    before, sep, body = text.partition("[TOOL_CALLS]")
    if not sep:
        return text.strip(), []
    body = body.strip()
    try:
        value, end = _decode_prefix(body)
    except ValueError:
        return text.strip(), []
    values = value if isinstance(value, list) else [value]
    calls = [_call_of_json(v) for v in values]
    if not calls or None in calls:
        return text.strip(), []
    return (before + body[end:]).strip(), calls


# -- minimax ------------------------------------------------------------------------------------


def _minimax_m2_body(inner: str) -> list[ToolCall]:
    return [
        ToolCall(
            name,
            {k: _value(v) for k, v in _tags(body, '<parameter name="', '">', "</parameter>")},
        )
        for name, body in _tags(inner, '<invoke name="', '">', "</invoke>")
    ]


def _minimax_m1_body(inner: str) -> list[ToolCall]:
    calls = [_call_of_json(_json_object(line.strip())) for line in inner.strip().splitlines()]
    return calls if calls and None not in calls else []


def parse_minimax(text: str) -> Parsed:
    if "<minimax:tool_call>" in text:
        return _blocks(text, "<minimax:tool_call>", "</minimax:tool_call>", _minimax_m2_body)
    return _blocks(text, "<tool_calls>", "</tool_calls>", _minimax_m1_body)


# -- json (forced calls on a template with no dialect) ------------------------------------------


def parse_json_call(text: str) -> Parsed:
    """The whole reply as one `{"name": ..., "arguments": {...}}`."""
    try:
        call = _call_of_json(_decode(text.strip()))
    except ValueError:
        call = None
    return ("", [call]) if call else (text.strip(), [])


JSON_CALL = Dialect("json", ("{",), parse_json_call)


DIALECTS = {
    "qwen": Dialect("qwen", ("<tool_call>",), parse_qwen),
    "glm": Dialect("glm", ("<tool_call>",), parse_glm),
    "deepseek": Dialect("deepseek", (DS_CALLS_BEGIN,), parse_deepseek),
    "kimi": Dialect("kimi", (KIMI_BEGIN,), parse_kimi),
    "harmony": Dialect("harmony", ("<|channel|>commentary to=",), parse_harmony),
    "mistral": Dialect("mistral", ("[TOOL_CALLS]",), parse_mistral),
    "minimax": Dialect("minimax", ("<minimax:tool_call>", "<tool_calls>"), parse_minimax),
}


def dialect_of(chat_template: str | None) -> Dialect | None:
    """The dialect a chat template teaches, from its markers; None when it defines none."""
    template = chat_template or ""
    if "<arg_key>" in template:
        return DIALECTS["glm"]
    if "tool▁calls▁begin" in template:
        return DIALECTS["deepseek"]
    if "tool_calls_section_begin" in template:
        return DIALECTS["kimi"]
    if "<|channel|>" in template and "to=functions." in template:
        return DIALECTS["harmony"]
    if "[TOOL_CALLS]" in template:
        return DIALECTS["mistral"]
    if "<minimax:tool_call>" in template or "<tool_calls>" in template:
        return DIALECTS["minimax"]
    if "<tool_call>" in template:
        return DIALECTS["qwen"]
    return None


# -- forced calls: a grammar for one call in a dialect -----------------------------------------


@dataclass(frozen=True)
class _Marker:
    """A dialect's tag: written as its one token where the vocabulary has it as one (chat models
    learnt their tags as added tokens), else as text."""

    text: str


@dataclass(frozen=True)
class _Json:
    """A JSON value under a schema: the whole call (`{"name", "arguments"}`) or the arguments."""

    whole_call: bool


# Each dialect's one call, in order: markers, text, the call's name (None), and its JSON.
_CALL, _ARGUMENTS, _NAME = _Json(True), _Json(False), None
_FORCED_SHAPES: dict[str, tuple] = {
    "json": (_CALL,),
    "qwen": (_Marker("<tool_call>"), "\n", _CALL, "\n", _Marker("</tool_call>")),
    "mistral": (_Marker("[TOOL_CALLS]"), "[", _CALL, "]"),
    "minimax": (_Marker("<tool_calls>"), "\n", _CALL, "\n", _Marker("</tool_calls>")),
    "deepseek": (
        _Marker(DS_CALLS_BEGIN),
        _Marker(DS_CALL_BEGIN),
        _NAME,
        _Marker(DS_SEP),
        _ARGUMENTS,
        _Marker(DS_CALL_END),
        _Marker(DS_CALLS_END),
    ),
    "kimi": (
        _Marker(KIMI_BEGIN),
        _Marker(KIMI_CALL),
        "functions.",
        _NAME,
        ":0",
        _Marker(KIMI_ARGUMENTS),
        _ARGUMENTS,
        _Marker(KIMI_CALL_END),
        _Marker(KIMI_END),
    ),
    "harmony": (
        _Marker("<|channel|>"),
        "commentary to=functions.",
        _NAME,
        " ",
        _Marker("<|constrain|>"),
        "json",
        _Marker(HARMONY_MESSAGE),
        _ARGUMENTS,
        _Marker(HARMONY_END),
    ),
}


_COMPACT = {"x-guidance": {"whitespace_flexible": False}}


def _lark_text(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _tool_function(tool: dict) -> tuple[str, dict]:
    """A tool's name and its arguments' schema (any object where it gives none)."""
    function = tool["function"]
    schema = function.get("parameters")
    return function["name"], schema if isinstance(schema, dict) and schema else {"type": "object"}


def forced_call_grammar(
    dialect: Dialect | None, tools: Sequence[dict], token_of: Callable[[str], int | None]
) -> str:
    """A Lark grammar (llguidance's, which embeds JSON schemas with `%json`) whose sentences are
    one call of one of `tools` (OpenAI's shape) in `dialect`'s syntax, its arguments matching the
    tool's schema. `token_of`: a tag's token id where the vocabulary has it as one token.
    KeyError: a dialect a call cannot be forced in (glm and minimax M2 write each argument
    apart)."""
    shape = _FORCED_SHAPES[(dialect or JSON_CALL).name]
    rules, alternatives = [], []
    for i, tool in enumerate(tools):
        name, schema = _tool_function(tool)
        call = {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": schema},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        pieces = []
        for part in shape:
            if isinstance(part, _Json):
                # Compact JSON: a small model given free whitespace can write it until
                # max_tokens.
                value = {**(call if part.whole_call else schema), **_COMPACT}
                rules.append(f"json_{i}: %json {json.dumps(value, ensure_ascii=False)}")
                pieces.append(f"json_{i}")
            elif isinstance(part, _Marker):
                token = token_of(part.text)
                pieces.append(f"<[{token}]>" if token is not None else _lark_text(part.text))
            else:
                pieces.append(_lark_text(name if part is _NAME else part))
        alternatives.append(" ".join(pieces))
    return "\n".join(["start: " + " | ".join(alternatives), *rules]) + "\n"
