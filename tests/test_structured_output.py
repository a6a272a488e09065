"""Structured output through `edge0 serve demo` (edge0_tui/server/structured.py): response_format,
llama.cpp's json_schema and grammar, and forced tool calls, as the official clients ask for them.

The demo writes Shakespeare, never JSON: every reply here is JSON (or a call) because the grammar
leaves it nothing else. Schemas bound their values (enums, short strings, small integers) so that
a reply ends within a few dozen tokens; the server runs resident, where no expert is read.
"""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace
from typing import Literal

import anthropic
import pytest
from pydantic import BaseModel, Field
from test_server import API_KEY, metric, private_env, start_server, stop_server
from tokenizers import Tokenizer

from edge0_tui.model_source import BUNDLED_DEMO
from edge0_tui.server import structured
from edge0_tui.server.openai_shapes import ApiError, parse_chat
from edge0_tui.server.structured import compile_constraint


class Character(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=99)
    house: Literal["Montague", "Capulet"]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "toss",
            "parameters": {
                "type": "object",
                "properties": {"heads": {"type": "boolean"}},
                "required": ["heads"],
            },
        },
    },
]
ASK = [{"role": "user", "content": "Who is Romeo?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("structured-log") / "server.log"
    env = private_env(tmp_path_factory)
    server = start_server("demo", log, env, "--api-key", API_KEY, "--mode", "resident")
    yield server
    stop_server(server)


def test_the_sdks_parse_gives_an_object_that_validates(server):
    reply = server.client().chat.completions.parse(
        model="demo", messages=ASK, response_format=Character, max_tokens=60
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Character)  # the SDK validated it with pydantic


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchains_structured_output_gives_a_validated_object(server, method):
    """langchain-openai's `with_structured_output`, both of its ways: a response_format
    json_schema, or a forced call of a function whose parameters are the schema."""
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(
        model="demo", base_url=f"{server.url}/v1", api_key=API_KEY, max_tokens=60, max_retries=0
    )
    character = model.with_structured_output(Character, method=method).invoke("Who is Romeo?")
    assert isinstance(character, Character)  # langchain validated it with pydantic


def test_json_object_is_json(server):
    # A bias toward `}` lets the demo close its object at once (left alone it writes a key that
    # never ends); the grammar still decides what comes before it.
    close = Tokenizer.from_file(str(BUNDLED_DEMO / "tokenizer.json")).token_to_id("}")
    reply = server.client().chat.completions.create(
        model="demo",
        messages=ASK,
        response_format={"type": "json_object"},
        logit_bias={str(close): 50},
        max_tokens=20,
    )
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    assert reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "choice, names",
    [
        ("required", {"get_time", "toss"}),
        ({"type": "function", "function": {"name": "toss"}}, {"toss"}),
    ],
    ids=["required", "named"],
)
def test_a_forced_tool_choice_comes_back_as_a_call(server, choice, names):
    reply = server.client().chat.completions.create(
        model="demo", messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=40
    )
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls"
    assert len(calls) == 1 and calls[0].function.name in names
    arguments = json.loads(calls[0].function.arguments)
    if calls[0].function.name == "toss":
        assert isinstance(arguments["heads"], bool)


def test_responses_tool_choice_named_comes_back_as_a_function_call(server):
    """The Responses API's forced call (`{"type": "function", "name": ...}`) is the chat
    endpoint's: a grammar in the model's call format; the response echoes the choice."""
    response = server.client().responses.create(
        model="demo",
        input="Who is Romeo?",
        tools=[
            {"type": "function", "name": "toss", "parameters": TOOLS[1]["function"]["parameters"]}
        ],
        tool_choice={"type": "function", "name": "toss"},
        max_output_tokens=40,
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "toss"
    assert isinstance(json.loads(calls[0].arguments)["heads"], bool)
    assert response.tool_choice.name == "toss"


def test_anthropic_tool_choice_any_comes_back_as_tool_use(server):
    client = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=60)
    message = client.messages.create(
        model="demo",
        max_tokens=40,
        messages=ASK,
        tools=[{"name": "toss", "input_schema": TOOLS[1]["function"]["parameters"]}],
        tool_choice={"type": "any"},
    )
    assert message.stop_reason == "tool_use"
    used = [block for block in message.content if block.type == "tool_use"]
    assert used[0].name == "toss" and isinstance(used[0].input["heads"], bool)


def test_a_gbnf_grammar_is_taken_and_counted_in_metrics(server):
    before = metric(server.metrics(), "edge0_constrained_replies_total")
    reply = server.client().chat.completions.create(
        model="demo", messages=ASK, max_tokens=10, extra_body={"grammar": 'root ::= "ay" | "nay"'}
    )
    assert reply.choices[0].message.content in ("ay", "nay")
    samples = server.metrics()
    assert metric(samples, "edge0_constrained_replies_total") == before + 1
    assert metric(samples, "edge0_grammar_mask_ms_total") > 0


def _deep(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _schema(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


SCHEMA_FIELD = "response_format.json_schema.schema"
BAD = [
    ("unknown type", {"response_format": {"type": "xml"}}, "response_format"),
    ("no name", {"response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format.json_schema.name"),
    ("schema not an object", {"response_format": _schema([1])}, SCHEMA_FIELD),
    ("schema not a schema", {"response_format": _schema({"type": "strin"})}, SCHEMA_FIELD),
    ("schema nested deep", {"response_format": _schema(_deep(100))}, SCHEMA_FIELD),
    ("schema huge", {"response_format": _schema({"enum": ["a" * 1000] * 1000})}, SCHEMA_FIELD),
    ("json_schema an array", {"json_schema": [1]}, "json_schema"),
    ("grammar not GBNF", {"grammar": "root ::= ("}, "grammar"),
    ("two forms", {"json_schema": {"type": "object"}, "grammar": 'root ::= "a"'}, "grammar"),
    ("required without tools", {"tool_choice": "required"}, "tool_choice"),
    ("named tool not in tools",
     {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ("form and forced call", {"tools": TOOLS, "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, "tool_choice"),
]  # fmt: skip


@pytest.mark.parametrize("fields, param", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_a_bad_form_is_a_400_naming_the_field(server, fields, param):
    body = json.dumps({"model": "demo", "messages": ASK, "max_tokens": 4, **fields})
    status, raw = server.http("POST", "/v1/chat/completions", body.encode())
    error = json.loads(raw)["error"]
    assert status == 400, raw
    assert error["param"] == param, error
    assert "\n" not in error["message"] and "Traceback" not in error["message"]


# -- the compile's bounds, without a server -----------------------------------------------------


def _json_request():
    body = {"messages": ASK, "response_format": {"type": "json_object"}}
    return parse_chat(body, ("demo",))


def test_a_reply_the_template_opens_in_a_think_block_is_refused():
    with pytest.raises(ApiError) as refused:
        asyncio.run(compile_constraint(_json_request(), worker=None, opens_thinking=True))
    assert refused.value.status == 400 and refused.value.param == "response_format"
    assert "enable_thinking" in refused.value.message


def test_a_compile_past_its_time_is_a_400_and_frees_the_request(monkeypatch):
    """A compile that does not end in time (here: one held on an event) answers a 400 naming the
    field; the request does not wait for it."""
    held = threading.Event()

    class Engine:
        @property
        def tokenizer(self):
            held.wait()
            raise AssertionError("released only once the request was answered")

    worker = SimpleNamespace(service=SimpleNamespace(engine=Engine()))
    monkeypatch.setattr(structured, "COMPILE_TIMEOUT_S", 0.05)
    loop = asyncio.new_event_loop()  # not asyncio.run: it would wait for the held thread
    try:
        with pytest.raises(ApiError) as refused:
            loop.run_until_complete(compile_constraint(_json_request(), worker, False))
    finally:
        held.set()
        loop.close()
    assert refused.value.param == "response_format"
    assert "too long to compile" in refused.value.message
