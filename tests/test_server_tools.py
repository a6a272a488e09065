"""`edge0 serve` for agents: tools and thinking through the chat template, and Anthropic's
Messages API driven by the official `anthropic` client, against a real server process.

The tiny random checkpoint gets the Qwen3-style chat template of tests/agent_model.py (tools
listed in the system turn, calls as `<tool_call>` JSON, results as `<tool_response>`,
`enable_thinking` opening `<think>`), so what the requests carry reaches a real template and a
real engine; tests/test_server_agents.py runs the loop on a model trained to call the tool.
"""

from __future__ import annotations

import json
import shutil

import anthropic
import pytest
from agent_model import QWEN_LIKE_TEMPLATE, WEATHER_TOOL
from test_server import API_KEY, model_dir, private_env, start_server, stop_server

from edge0_tui.server.openai_shapes import parse_chat
from engine import Engine, EngineConfig

__all__ = ["model_dir"]  # a fixture, used here by name


@pytest.fixture(scope="module")
def agent_model(model_dir, tmp_path_factory):
    model = tmp_path_factory.mktemp("agent") / "tiny-agent"
    shutil.copytree(model_dir, model)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = QWEN_LIKE_TEMPLATE
    config_path.write_text(json.dumps(config))
    return model


@pytest.fixture(scope="module")
def server(agent_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("agent-log") / "server.log"
    server = start_server(agent_model, log, private_env(tmp_path_factory), "--api-key", API_KEY)
    yield server
    stop_server(server)


def test_tools_and_a_tool_turn_reach_the_template(server):
    client = server.client()
    question = [{"role": "user", "content": "Weather in Paris?"}]
    plain = client.chat.completions.create(model="tiny-agent", messages=question, max_tokens=2)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-agent", messages=question, max_tokens=2, tools=[WEATHER_TOOL]
    )
    assert raw.headers.get("x-edge0-warning") is None  # this template takes tools
    with_tools = raw.parse()
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 10  # the tools' text
    none = client.chat.completions.create(
        model="tiny-agent", messages=question, max_tokens=2, tools=[WEATHER_TOOL],
        tool_choice="none",
    )  # fmt: skip
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens  # tool_choice none: no tools
    history = [
        *question,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"},
    ]
    answer = client.chat.completions.create(
        model="tiny-agent", messages=history, max_tokens=3, tools=[WEATHER_TOOL]
    )
    # The call and its result are in the prompt: the tokens of both, as the template wrote them.
    assert answer.usage.prompt_tokens > with_tools.usage.prompt_tokens + 15
    assert answer.choices[0].finish_reason in ("length", "stop")


def test_thinking_is_split_into_reasoning_content(server):
    client = server.client()
    common = dict(model="tiny-agent", messages=[{"role": "user", "content": "Why?"}], max_tokens=8)
    thinking = client.chat.completions.create(
        **common, temperature=0, extra_body={"enable_thinking": True}
    )
    message = thinking.choices[0].message
    # The template opened <think>; a random model never closes it: all of it is reasoning.
    assert message.model_extra["reasoning_content"] and message.content == ""
    off = client.chat.completions.create(
        **common, temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    # Thinking off: the template closed the think block empty, which is no reasoning at all.
    assert off.choices[0].message.content
    assert "reasoning_content" not in off.choices[0].message.model_extra
    streamed = client.chat.completions.create(
        **common, temperature=0, stream=True, extra_body={"enable_thinking": True}
    )
    reasoning = "".join(
        (c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
        for c in streamed
        if c.choices
    )
    assert reasoning == message.model_extra["reasoning_content"]


def anthropic_client(server, key: str = API_KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=60)


def test_the_anthropic_client_gets_messages_whole_and_streamed(server):
    client = anthropic_client(server)
    common = dict(
        model="tiny-agent",
        max_tokens=6,
        system="You are terse.",
        messages=[{"role": "user", "content": "Tell me about the sea."}],
        extra_body={"temperature": 0},  # greedy: the same text whole and streamed
    )
    whole = client.messages.create(**common)
    assert whole.type == "message" and whole.role == "assistant"
    assert whole.stop_reason in ("max_tokens", "end_turn")
    assert whole.usage.output_tokens == 6 or whole.stop_reason == "end_turn"
    text = "".join(b.text for b in whole.content if b.type == "text")
    with client.messages.stream(**common) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.usage.output_tokens == whole.usage.output_tokens
    # A stop sequence taken from the reply cuts it there.
    stop = text[3:6]
    if stop.strip():
        cut = client.messages.create(**common, stop_sequences=[stop])
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
        assert "".join(b.text for b in cut.content if b.type == "text") == text[: text.index(stop)]


def test_the_anthropic_client_sends_tools_and_tool_results(server):
    client = anthropic_client(server)
    tools = [
        {
            "name": "get_weather",
            "description": "The weather in a city.",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ]
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.messages.create(model="tiny-agent", max_tokens=2, messages=ask, tools=tools)
    history = [
        *ask,
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                         "input": {"city": "Paris"}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"}],
        },
    ]  # fmt: skip
    second = client.messages.create(model="tiny-agent", max_tokens=2, messages=history, tools=tools)

    def prompt_tokens(reply) -> int:  # Anthropic's: input plus what the KV cache held
        return reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0)

    assert prompt_tokens(second) > prompt_tokens(first) + 10


def test_anthropic_errors_are_in_anthropics_shape(server):
    with pytest.raises(anthropic.AuthenticationError) as wrong:
        anthropic_client(server, key="wrong").messages.create(
            model="tiny-agent", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
    assert wrong.value.body["error"]["type"] == "authentication_error"
    client = anthropic_client(server)
    with pytest.raises(anthropic.BadRequestError) as forced:  # a named tool with no name
        client.messages.create(
            model="tiny-agent", max_tokens=2, messages=[{"role": "user", "content": "hi"}],
            tools=[{"name": "f", "input_schema": {"type": "object"}}], tool_choice={"type": "tool"},
        )  # fmt: skip
    assert forced.value.body["type"] == "error"
    assert "tool_choice" in forced.value.body["error"]["message"]
    # Any model name is answered by the one model, and the reply names it.
    other = client.messages.create(
        model="claude-x", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
    )
    assert other.model == "tiny-agent"
    # A field edge0 cannot honour is refused, naming it, never ignored; edge0's own per-request
    # profile is taken as through the OpenAI API.
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.BadRequestError) as unknown:
        client.messages.create(
            model="tiny-agent", max_tokens=2, messages=hi, extra_body={"mcp_servers": []}
        )
    assert "mcp_servers is not supported" in unknown.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as bad_mode:
        client.messages.create(
            model="tiny-agent", max_tokens=2, messages=hi, extra_body={"mode": "sideways"}
        )
    assert "unknown mode 'sideways'" in bad_mode.value.body["error"]["message"]
    reply = client.messages.create(
        model="tiny-agent", max_tokens=2, messages=hi, metadata={"user_id": "u1"}
    )
    assert reply.type == "message"


def test_count_tokens_counts_the_prompt_a_message_request_would_have(server):
    """The anthropic client's count_tokens: the tokens a Messages request with that prompt is
    encoded to (system, tools, thinking included); edge0 says which part of a prompt its KV
    cache already held as Anthropic does (cache_read_input_tokens)."""
    client = anthropic_client(server)
    tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    prompt = dict(
        model="claude-sonnet-4-5",  # any name: the one model answers
        system="You are terse.",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=tools,
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    counted = client.messages.count_tokens(**prompt).input_tokens
    first = client.messages.create(max_tokens=1, **prompt)
    assert first.model == "tiny-agent"
    assert counted == first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert counted != client.messages.count_tokens(**{**prompt, "tools": []}).input_tokens
    again = client.messages.create(max_tokens=1, **prompt)  # the same prompt again
    reused = again.model_extra["edge0"]["reused_prompt_tokens"]
    assert 0 < again.usage.cache_read_input_tokens == min(reused, counted)
    # As Anthropic counts: the cached part is not input again (a sum counts it once).
    assert again.usage.input_tokens == counted - again.usage.cache_read_input_tokens


def test_count_tokens_refuses_in_anthropics_shape_within_the_prompt_bounds(server):
    client = anthropic_client(server)
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.BadRequestError) as extra:
        client.messages.count_tokens(model="m", messages=hi, extra_body={"max_tokens": 5})
    assert extra.value.body["type"] == "error"
    assert "max_tokens is not supported by count_tokens" in extra.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as empty:
        client.messages.count_tokens(model="m", messages=[])
    assert empty.value.body["error"]["message"].endswith("(messages)")
    # Past the context by its length alone: refused before it is encoded, as a request is.
    huge = [{"role": "user", "content": "x" * 2_000_000}]
    with pytest.raises(anthropic.BadRequestError) as past:
        client.messages.count_tokens(model="m", messages=huge)
    assert "more than the model's context" in past.value.body["error"]["message"]


# -- issue 47 item 5: what the template cannot render is refused, naming the field ---------------

LONE = "caf\ud800e"
DEEP = (
    "[" * 900 + "]" * 900
)  # parses as JSON; a template writing it out would recurse past the limit


def tool(name: str = "f", description: str = "d", parameters: str = '{"type": "object"}') -> str:
    return (
        f'{{"type": "function", "function": {{"name": {json.dumps(name)}, '
        f'"description": {json.dumps(description)}, "parameters": {parameters}}}}}'
    )


TEMPLATE_BAD = [
    ("a deep tool schema", "/v1/chat/completions", tool(parameters=DEEP), "tools[0].function"),
    ("a lone surrogate in a tool's name", "/v1/chat/completions", tool(name=LONE),
     "tools[0].function.name"),
    ("a lone surrogate in a tool's description", "/v1/chat/completions",
     tool(description=LONE), "tools[0].function.description"),
    ("a deep input_schema", "/v1/messages",
     f'{{"name": "f", "input_schema": {DEEP}}}', "tools[0]"),
    ("a lone surrogate in an Anthropic tool's description", "/v1/messages",
     f'{{"name": "f", "description": {json.dumps(LONE)}, "input_schema": {{}}}}',
     "tools[0].description"),
]  # fmt: skip


@pytest.mark.parametrize("case", TEMPLATE_BAD, ids=[c[0] for c in TEMPLATE_BAD])
def test_what_the_template_cannot_render_is_a_400_naming_the_field(server, case):
    _, path, tool_json, param = case
    body = (
        '{"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], '
        f'"tools": [{tool_json}]}}'
    ).encode()
    status, raw = server.http("POST", path, body)
    reply = json.loads(raw)
    assert status == 400, reply
    if path == "/v1/messages":
        message = reply["error"]["message"]
        assert message.endswith(f"({param})"), reply
    else:
        message = reply["error"]["message"]
        assert reply["error"]["param"] == param, reply
    assert str(server.model.parent) not in message and "/" not in message, message


# -- issue 47 item 7: the bound known before rendering is below what the template makes ----------

CONVERSATIONS = [
    [{"role": "user", "content": "x"}] * 50,
    [
        {"role": "system", "content": "Be brief. \u00e9t\u00e9 \u4e2d\u6587"},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": ""},
        {"role": "tool", "tool_call_id": "c2", "content": "Rain"},
        {"role": "assistant", "content": "<think>long reasoning</think>Sunny."},
        {"role": "user", "content": ""},
    ],
]  # fmt: skip


def test_the_turn_bound_is_at_most_the_prompts_tokens(agent_model):
    """For the Qwen-like template: with and without tools, the count taken before rendering
    (text and each turn's markup) is never more than the rendered prompt's tokens, and it
    counts markup for each role (it is not vacuous)."""
    from edge0_tui.server.engine_worker import least_prompt_tokens, turn_tokens

    with Engine(agent_model, EngineConfig()) as engine:
        markup = turn_tokens(engine)
        assert all(markup.get(role, 0) > 0 for role in ("system", "user", "assistant", "tool"))
        longest = max(map(len, engine.tokenizer.get_vocab()))
        for conversation in CONVERSATIONS:
            for tools in (None, [WEATHER_TOOL]):
                body = {"messages": conversation, **({"tools": tools} if tools else {})}
                request = parse_chat(body, ("tiny-agent",))
                tokens = engine.encode_chat(list(request.messages), request.tools)
                assert least_prompt_tokens(request, longest, markup) <= len(tokens)
