"""Tool calls in the text a model writes, one parser per dialect of the families edge0 runs.

A model calls a tool by writing it in its own dialect, as its chat template taught it; the
template also says which dialect it expects (`dialect_of` reads its markers). Each dialect has
the markers that open a call in the reply (`Dialect.starts`: from there on the reply is held
back, not streamed as text) and a parser: a plain function from the reply's text to the text
outside calls and the calls found (`ToolCall`: a name and its arguments as a JSON object).

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
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass


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
    parse: Callable[[str], Parsed]


def _value(text: str):
    """A parameter's value as written in XML-ish dialects: JSON where it is JSON, else text."""
    text = text.strip("\n")
    try:
        return json.loads(text)
    except ValueError:
        return text


def _json_object(text: str) -> dict | None:
    try:
        value = json.loads(text)
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


def _blocks(
    text: str, open_tag: str, close_tag: str, body: Callable[[str], list[ToolCall]]
) -> Parsed:
    """Calls in every open_tag...close_tag block (an unclosed last block runs to the end); the
    text outside them is kept. A block that does not parse stays in the text."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    rest = text
    while True:
        start = rest.find(open_tag)
        if start < 0:
            kept.append(rest)
            break
        end = rest.find(close_tag, start + len(open_tag))
        stop = len(rest) if end < 0 else end + len(close_tag)
        inner = rest[start + len(open_tag) : end if end >= 0 else len(rest)]
        found = body(inner)
        kept.append(rest[:start])
        if found:
            calls.extend(found)
        else:
            kept.append(rest[start:stop])
        rest = rest[stop:]
    return "".join(kept).strip(), calls


# -- qwen ---------------------------------------------------------------------------------------

_QWEN_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_QWEN_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


def _qwen_body(inner: str) -> list[ToolCall]:
    inner = inner.strip()
    if inner.startswith("<function="):
        calls = []
        for name, body in _QWEN_FUNCTION.findall(inner):
            arguments = {k.strip(): _value(v) for k, v in _QWEN_PARAMETER.findall(body)}
            calls.append(ToolCall(name.strip(), arguments))
        return calls
    call = _call_of_json(_json_object(inner))
    return [call] if call else []


def parse_qwen(text: str) -> Parsed:
    return _blocks(text, "<tool_call>", "</tool_call>", _qwen_body)


# -- glm / ling ---------------------------------------------------------------------------------

_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)(?:</arg_value>|$)", re.S)


def _glm_body(inner: str) -> list[ToolCall]:
    name, _, rest = inner.partition("<arg_key>")
    name = name.strip()
    if not name or "<" in name:
        return []
    arguments = {k.strip(): _value(v) for k, v in _GLM_ARG.findall("<arg_key>" + rest)}
    return [ToolCall(name, arguments)]


def parse_glm(text: str) -> Parsed:
    return _blocks(text, "<tool_call>", "</tool_call>", _glm_body)


# -- deepseek -----------------------------------------------------------------------------------

DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = (
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
)
_FENCED = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.S)


def _deepseek_call(inner: str) -> list[ToolCall]:
    head, sep, body = inner.partition(DS_SEP)
    if not sep:
        return []
    if head.strip() == "function":  # V3: function<sep>NAME\n```json ... ```
        name, _, body = body.partition("\n")
        fenced = _FENCED.search(body)
        body = fenced.group(1) if fenced else body
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
_KIMI_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*(?:functions\.)?([\w.\-]+?)(?::\d+)?\s*"
    r"<\|tool_call_argument_begin\|>(.*?)(?:<\|tool_call_end\|>|$)",
    re.S,
)


def parse_kimi(text: str) -> Parsed:
    before, sep, section = text.partition(KIMI_BEGIN)
    if not sep:
        return text.strip(), []
    section, _, after = section.partition(KIMI_END)
    calls = []
    for name, body in _KIMI_CALL.findall(section):
        arguments = _json_object(body.strip())
        if arguments is None:
            return text.strip(), []
        calls.append(ToolCall(name, arguments))
    return (before + after).strip(), calls


# -- harmony (gpt-oss) --------------------------------------------------------------------------

_HARMONY_CALL = re.compile(
    r"(?:<\|start\|>assistant)?<\|channel\|>commentary to=functions\.([\w.\-]+)\s*"
    r"(?:<\|constrain\|>\s*json)?\s*<\|message\|>(.*?)(?:<\|call\|>|$)",
    re.S,
)


def parse_harmony(text: str) -> Parsed:
    calls = []
    for name, body in _HARMONY_CALL.findall(text):
        arguments = _json_object(body.strip())
        if arguments is None:
            return text.strip(), []
        calls.append(ToolCall(name, arguments))
    if not calls:
        return text.strip(), []
    return _HARMONY_CALL.sub("", text).strip(), calls


# -- mistral ------------------------------------------------------------------------------------


def parse_mistral(text: str) -> Parsed:
    before, sep, body = text.partition("[TOOL_CALLS]")
    if not sep:
        return text.strip(), []
    try:
        value, end = json.JSONDecoder().raw_decode(body.strip())
    except ValueError:
        return text.strip(), []
    values = value if isinstance(value, list) else [value]
    calls = [_call_of_json(v) for v in values]
    if not calls or None in calls:
        return text.strip(), []
    return (before + body.strip()[end:]).strip(), calls


# -- minimax ------------------------------------------------------------------------------------

_MINIMAX_INVOKE = re.compile(r'<invoke name="([^"]+)">(.*?)(?:</invoke>|$)', re.S)
_MINIMAX_PARAMETER = re.compile(r'<parameter name="([^"]+)">(.*?)(?:</parameter>|$)', re.S)


def _minimax_m2_body(inner: str) -> list[ToolCall]:
    return [
        ToolCall(name, {k: _value(v) for k, v in _MINIMAX_PARAMETER.findall(body)})
        for name, body in _MINIMAX_INVOKE.findall(inner)
    ]


def _minimax_m1_body(inner: str) -> list[ToolCall]:
    calls = [_call_of_json(_json_object(line.strip())) for line in inner.strip().splitlines()]
    return calls if calls and None not in calls else []


def parse_minimax(text: str) -> Parsed:
    if "<minimax:tool_call>" in text:
        return _blocks(text, "<minimax:tool_call>", "</minimax:tool_call>", _minimax_m2_body)
    return _blocks(text, "<tool_calls>", "</tool_calls>", _minimax_m1_body)


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
