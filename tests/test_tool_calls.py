"""Tool-call dialects and the reasoning split, on outputs as each family's models write them,
whole and fed in every two-piece split (a split inside a tag included)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import llguidance
import pytest

from edge0_tui.server.anthropic_shapes import AnthropicWriter, parse_messages
from edge0_tui.server.app import GenerationResponse
from edge0_tui.server.engine_worker import Finished, Text
from edge0_tui.server.metrics import ServerStats
from edge0_tui.server.openai_replies import OpenAIWriter
from edge0_tui.server.openai_shapes import parse_chat
from edge0_tui.server.reply_parts import ReplyParts, TemplateFacts
from edge0_tui.server.tool_calls import (
    DIALECTS,
    JSON_CALL,
    Dialect,
    ToolCall,
    dialect_of,
    forced_call_grammar,
)
from engine import compile_grammar, lark_source

WEATHER = {"city": "Paris", "days": 2}

# (dialect, reply as the model writes it, the text around the call)
RECORDED = [
    ("qwen", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Paris", "days": 2}}\n</tool_call>', "Let me look."),
    ("qwen", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
     "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>", ""),
    ("glm", "Checking.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
     "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>", "Checking."),
    ("deepseek", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
     '```json\n{"city": "Paris", "days": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', ""),
    ("deepseek", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
     '{"city": "Paris", "days": 2}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', ""),
    ("kimi", "Sure. <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
     '<|tool_call_argument_begin|>{"city": "Paris", "days": 2}<|tool_call_end|>'
     "<|tool_calls_section_end|>", "Sure."),
    ("harmony", "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
     '{"city": "Paris", "days": 2}<|call|>', ""),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
     '"days": 2}}]', ""),
    ("minimax", '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
     '</parameter>\n<parameter name="days">2</parameter>\n</invoke>\n</minimax:tool_call>', ""),
    ("minimax", '<tool_calls>\n{"name": "get_weather", "arguments": {"city": "Paris", '
     '"days": 2}}\n</tool_calls>', ""),
]  # fmt: skip


@pytest.mark.parametrize("dialect, reply, text", RECORDED, ids=[r[0] for r in RECORDED])
def test_each_dialect_parses_its_recorded_call(dialect, reply, text):
    left, calls = DIALECTS[dialect].parse(reply)
    assert left == text
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", WEATHER)]


@pytest.mark.parametrize("dialect, reply, text", RECORDED, ids=[r[0] for r in RECORDED])
def test_streamed_in_two_pieces_anywhere_the_call_is_found_and_never_shown(dialect, reply, text):
    facts = TemplateFacts(thinks=False, dialect=DIALECTS[dialect])
    for cut in range(1, len(reply)):
        parts = ReplyParts(facts, thinking=False, tools=True)
        pieces = parts.feed(reply[:cut]) + parts.feed(reply[cut:])
        last, calls = parts.finish()
        shown = "".join(t for kind, t in pieces + last if kind == "content")
        assert shown.strip() == text, (cut, shown)
        assert [(c.name, c.arguments) for c in calls] == [("get_weather", WEATHER)], cut
        assert all(c.id.startswith("call_") for c in calls)


def test_two_calls_in_one_reply_and_text_that_only_looks_like_a_call():
    two = (
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {"x": 1}}\n</tool_call>'
    )
    _, calls = DIALECTS["qwen"].parse(two)
    assert [(c.name, c.arguments) for c in calls] == [("a", {}), ("b", {"x": 1})]
    parts = ReplyParts(TemplateFacts(False, DIALECTS["qwen"]), thinking=False, tools=True)
    pieces = parts.feed("I would write <tool_call>not json</tool_call> here")
    last, calls = parts.finish()
    assert calls == []  # no call: the text is the content, whole
    assert (
        "".join(t for _, t in pieces + last) == "I would write <tool_call>not json</tool_call> here"
    )


THOUGHT = "The user asks about the sea.\nI should be brief."


@pytest.mark.parametrize("opened_by_prompt", [True, False])
def test_reasoning_is_split_at_the_think_tags_in_any_split(opened_by_prompt):
    reply = ("" if opened_by_prompt else "<think>\n") + THOUGHT + "\n</think>\n\nThe sea is wide."
    facts = TemplateFacts(thinks=True, dialect=DIALECTS["qwen"])
    for cut in range(0, len(reply) + 1):
        parts = ReplyParts(facts, thinking=opened_by_prompt, tools=True)
        pieces = parts.feed(reply[:cut]) + parts.feed(reply[cut:])
        last, calls = parts.finish()
        got = {"reasoning": "", "content": ""}
        for kind, text in pieces + last:
            got[kind] += text
        # The newlines around the reasoning are the tags'; the one inside it is kept.
        assert got == {"reasoning": THOUGHT, "content": "The sea is wide."}, cut
        assert calls == []


def test_without_think_tags_or_tools_the_text_is_content_as_written():
    parts = ReplyParts(TemplateFacts(False, None), thinking=True, tools=False)
    text = "<think>x</think> and <tool_call>{}</tool_call>"
    assert parts.feed(text) == [("content", text)]
    assert parts.finish() == ([], [])


@pytest.mark.parametrize(
    "template, dialect",
    [
        ("{{ '<tool_call>\\n' }}{{ tool_call.arguments | tojson }}", "qwen"),
        ("<tool_call>{{ name }}<arg_key>{{ k }}</arg_key>", "glm"),
        ("<｜tool▁calls▁begin｜>", "deepseek"),
        ("<|tool_calls_section_begin|>", "kimi"),
        ("<|channel|>commentary to=functions.{{ name }}", "harmony"),
        ("[TOOL_CALLS]", "mistral"),
        ("<minimax:tool_call>", "minimax"),
        ("{{ messages }}", None),
    ],
)
def test_the_dialect_is_read_from_the_chat_template(template, dialect):
    found = dialect_of(template)
    assert (found.name if found else None) == dialect


# -- calls that cannot be sent on (issue 47 items 1 and 2) ---------------------------------------

# Each dialect's call with one argument `x`, its value as JSON text where VALUE stands.
ONE_ARGUMENT = [
    ("qwen", '<tool_call>{"name": "f", "arguments": {"x": VALUE}}</tool_call>'),
    ("qwen", "<tool_call><function=f><parameter=x>VALUE</parameter></function></tool_call>"),
    ("glm", "<tool_call>f<arg_key>x</arg_key><arg_value>VALUE</arg_value></tool_call>"),
    ("deepseek", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n"
     '{"x": VALUE}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    ("deepseek", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>"
     '{"x": VALUE}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    ("kimi", "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
     '<|tool_call_argument_begin|>{"x": VALUE}<|tool_call_end|><|tool_calls_section_end|>'),
    ("harmony", "<|channel|>commentary to=functions.f <|constrain|>json<|message|>"
     '{"x": VALUE}<|call|>'),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"x": VALUE}}]'),
    ("minimax", '<minimax:tool_call><invoke name="f"><parameter name="x">VALUE</parameter>'
     "</invoke></minimax:tool_call>"),
    ("minimax", '<tool_calls>\n{"name": "f", "arguments": {"x": VALUE}}\n</tool_calls>'),
]  # fmt: skip
DEEP = "[" * 5000 + "]" * 5000  # JSON, nested past what a decoder's recursion takes
LONE_SURROGATE = '"\\ud800"'  # JSON for a string UTF-8 cannot carry


def finished(dialect: str, reply: str) -> tuple[str, list]:
    """The content and calls ReplyParts gives for `reply`, fed whole."""
    parts = ReplyParts(TemplateFacts(False, DIALECTS[dialect]), thinking=False, tools=True)
    pieces = parts.feed(reply)
    last, calls = parts.finish()
    return "".join(text for _, text in pieces + last), calls


@pytest.mark.parametrize("dialect, call", ONE_ARGUMENT, ids=[d for d, _ in ONE_ARGUMENT])
def test_a_call_nested_too_deep_or_not_utf8_is_text_in_every_dialect(dialect, call):
    for value in (DEEP, LONE_SURROGATE, "[" * 50000):
        reply = call.replace("VALUE", value)
        assert finished(dialect, reply) == (reply, []), value[:10]
    nested = [[[[[[[[[[[]]]]]]]]]]]  # within the bound: still a call
    assert finished(dialect, call.replace("VALUE", json.dumps(nested)))[1][0].arguments == {
        "x": nested
    }


# -- work linear in the reply (issue 47 item 3) --------------------------------------------------

N = 200_000  # characters of each hostile reply
# Replies made of what looks like the start of a call over and over: the regexes these parsers
# had backtracked over the rest of the reply from each start, minutes at this length.
HOSTILE = [
    ("harmony", "<|channel|>commentary to=functions.get_weather" + " " * N),
    ("harmony", "<|channel|>commentary to=functions.f" + " " * N + "x<|message|>{}"),
    ("qwen", "<tool_call>" + "<function=" * (N // 10)),
    ("qwen", "<tool_call><function=f>" + "<parameter=" * (N // 11)),
    ("qwen", "<tool_call><function=f>" + ("<parameter=a>" + "x" * 99) * (N // 112)
     + "</parameter>"),
    ("qwen", '<tool_call>["' + '\\"' * (N // 2)),
    ("glm", "<tool_call>f" + "<arg_key>" * (N // 9)),
    ("glm", "<tool_call>f" + "<arg_key>k</arg_key>" * (N // 20) + "<arg_value>1"),
    ("kimi", "<|tool_calls_section_begin|>" + "<|tool_call_begin|>" * (N // 19)
     + "<|tool_call_argument_begin|>{}"),
    ("deepseek", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json"
     + " " * N + "x"),
    ("minimax", "<minimax:tool_call>" + '<invoke name="' * (N // 14)),
    ("minimax", "<minimax:tool_call>" + '<invoke name="f">' * (N // 17) + "</invoke>"),
]  # fmt: skip
# Far above what a linear parse of N characters takes, far below what the old one took.
BOUND_S = 5.0


@pytest.mark.parametrize("dialect, reply", HOSTILE, ids=[d for d, _ in HOSTILE])
def test_each_parser_is_linear_in_a_hostile_reply(dialect, reply):
    started = time.perf_counter()
    content, calls = finished(dialect, reply)
    assert time.perf_counter() - started < BOUND_S
    assert content == reply or calls  # text, or the calls it also holds


@pytest.mark.parametrize("thinking, piece", [(True, "\n\n\n\n"), (False, "    ")])
def test_blank_the_split_holds_back_is_not_split_again_at_every_piece(thinking, piece):
    # Newlines in reasoning may be the closing tag's, and blank before a think tag may be the
    # tag's: both are held until the text after them says. Each piece of a long run of them
    # had scanned the whole run again.
    parts = ReplyParts(TemplateFacts(True, DIALECTS["qwen"]), thinking=thinking, tools=True)
    started = time.perf_counter()
    pieces = [p for _ in range(2 * N // len(piece)) for p in parts.feed(piece)]
    pieces += parts.feed("x")
    assert time.perf_counter() - started < BOUND_S
    kind = "reasoning" if thinking else "content"
    assert [(k, len(t)) for k, t in pieces + parts.finish()[0]] == [
        (kind, 1 if thinking else 2 * N + 1)
    ]


# -- through the server's reply path -------------------------------------------------------------

FIGURES = {
    "reused_prompt_tokens": 0, "ttft_ms": 1.0, "decode_tok_per_s": 1.0,
    "blocked_ms_per_step": 0.0, "cold_fraction": 0.0, "k": 4, "mode": "exact",
}  # fmt: skip


class _Job:
    def cancel(self) -> None:
        pass


def served_reply(dialect: Dialect, reply: str, stream: bool, anthropic: bool) -> list[dict]:
    """What the server sends for a model's `reply` (as ASGI messages), through
    app.GenerationResponse with the API's writer, the engine's events queued beforehand."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    body["max_tokens"] = 8
    request = (parse_messages if anthropic else parse_chat)(body, ("m",))
    writer = AnthropicWriter(request, lambda: False) if anthropic else OpenAIWriter(request)
    parts = ReplyParts(TemplateFacts(False, dialect), thinking=False, tools=True)
    sent: list[dict] = []

    async def run() -> None:
        events: asyncio.Queue = asyncio.Queue()
        events.put_nowait(Text(reply[:20]))
        events.put_nowait(Finished(reply[20:], "stop", 3, 5, FIGURES))
        response = GenerationResponse(request, _Job(), events, ServerStats(), writer, parts)

        async def receive() -> dict:
            await asyncio.Event().wait()  # the client stays

        async def send(message: dict) -> None:
            sent.append(message)

        await response({"type": "http"}, receive, send)

    asyncio.run(run())
    return sent


@pytest.mark.parametrize("anthropic", [False, True], ids=["openai", "anthropic"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_call_that_cannot_be_sent_is_text_and_the_reply_completes(stream, anthropic):
    call = '<tool_call>{"name": "f", "arguments": {"x": VALUE}}</tool_call>'
    for value in (DEEP, LONE_SURROGATE):
        reply = call.replace("VALUE", value)
        sent = served_reply(DIALECTS["qwen"], reply, stream, anthropic)
        data = b"".join(m.get("body", b"") for m in sent)
        assert sent[0]["status"] == 200
        if not stream:
            answer = json.loads(data)
            text = (
                answer["content"][0]["text"]
                if anthropic
                else answer["choices"][0]["message"]["content"]
            )
            assert text == reply
        else:
            last_event = data.rstrip().split(b"\n\n")[-1]
            assert last_event.startswith(b"event: message_stop" if anthropic else b"data: [DONE]")
            assert b'"tool_calls"' not in data and b"tool_use" not in data


def test_the_reply_is_parsed_off_the_event_loop():
    threads = []

    def read(text: str):
        threads.append(threading.current_thread())
        return text, []

    served_reply(Dialect("probe", ("<tool_call>",), read), "<tool_call>x", True, False)
    assert threads and threads[0] is not threading.main_thread()


# -- forced calls: the grammar's sentences parse back as the call --------------------------------

TOSS = {
    "type": "function",
    "function": {
        "name": "toss",
        "parameters": {"type": "object", "properties": {"heads": {"type": "boolean"}}},
    },
}
# One call of `toss` as each dialect's forced grammar writes it (compact JSON).
FORCED = {
    "json": '{"name":"toss","arguments":{"heads":true}}',
    "qwen": '<tool_call>\n{"name":"toss","arguments":{"heads":true}}\n</tool_call>',
    "mistral": '[TOOL_CALLS][{"name":"toss","arguments":{"heads":true}}]',
    "minimax": '<tool_calls>\n{"name":"toss","arguments":{"heads":true}}\n</tool_calls>',
    "deepseek": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>toss<｜tool▁sep｜>"
    '{"heads":true}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "kimi": "<|tool_calls_section_begin|><|tool_call_begin|>functions.toss:0"
    '<|tool_call_argument_begin|>{"heads":true}<|tool_call_end|><|tool_calls_section_end|>',
    "harmony": '<|channel|>commentary to=functions.toss <|constrain|>json<|message|>{"heads":true}'
    "<|call|>",
}


@pytest.fixture(scope="module")
def demo_vocabulary():
    from transformers import PreTrainedTokenizerFast

    from edge0_tui.model_source import BUNDLED_DEMO

    return PreTrainedTokenizerFast.from_pretrained(str(BUNDLED_DEMO))


@pytest.mark.parametrize("name", list(FORCED))
def test_a_forced_calls_grammar_takes_the_call_and_it_parses_back(demo_vocabulary, name):
    dialect = JSON_CALL if name == "json" else DIALECTS[name]
    text = forced_call_grammar(dialect, [TOSS], lambda tag: None)
    grammar = compile_grammar(lark_source(text), demo_vocabulary)
    matcher = grammar.compiled.deep_copy()
    tokens = grammar.vocabulary.tokenize_str(FORCED[name])
    assert matcher.consume_tokens(tokens), matcher.get_error()
    assert matcher.is_accepting()
    # And nothing else: another argument value is refused.
    other = llguidance.LLMatcher(grammar.vocabulary, grammar.source.text, log_level=0)
    assert not other.consume_tokens(
        grammar.vocabulary.tokenize_str(FORCED[name].replace("true", '"x"'))
    )
    assert dialect.parse(FORCED[name]) == ("", [ToolCall("toss", {"heads": True})])


def test_a_forced_call_cannot_be_written_in_glm():
    with pytest.raises(KeyError):
        forced_call_grammar(DIALECTS["glm"], [TOSS], lambda tag: None)


def test_a_tag_the_vocabulary_has_is_forced_as_its_token():
    text = forced_call_grammar(DIALECTS["qwen"], [TOSS], {"<tool_call>": 7}.get)
    assert text.startswith('start: <[7]> "\\n" json_0 "\\n" "</tool_call>"')
