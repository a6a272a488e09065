"""Tool-call dialects and the reasoning split, on outputs as each family's models write them,
whole and fed in every two-piece split (a split inside a tag included)."""

from __future__ import annotations

import pytest

from edge0_tui.server.reply_parts import ReplyParts, TemplateFacts
from edge0_tui.server.tool_calls import DIALECTS, dialect_of

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
