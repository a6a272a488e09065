"""A tool-calling loop, as agents run it, with the official `openai` and `anthropic` clients
against a real `edge0 serve` process on a model that really calls a tool.

The model is the tiny checkpoint trained to memorize a few replies (tests/agent_model.py): asked
the weather in Paris with a weather tool it writes a `<tool_call>`; with thinking on it reasons
first; given the tool's result it answers in text. Replies are greedy (temperature 0). The
server knows none of this: the calls below come from its template rendering, the engine's
tokens and the qwen dialect's parser, in each API's shapes.
"""

from __future__ import annotations

import json

import anthropic
import pytest
from agent_model import (
    ANSWER,
    ANTHROPIC_WEATHER_TOOL,
    CALL_ARGUMENTS,
    MODEL_ID,
    REASONING,
    TOOL_RESULT,
    WEATHER_TOOL,
    anthropic_ask,
    openai_ask,
)
from test_server import API_KEY, private_env, start_server, stop_server

THINKING = {"type": "enabled", "budget_tokens": 1024}


@pytest.fixture(scope="module")
def server(tool_calling_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("agents-log") / "server.log"
    env = private_env(tmp_path_factory)
    server = start_server(tool_calling_checkpoint, log, env, "--api-key", API_KEY)
    yield server
    stop_server(server)


def anthropic_client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=60)


def tool_result_turns(call_id: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": TOOL_RESULT}


def test_openai_client_calls_the_tool_and_answers_from_its_result(server):
    client = server.client()
    common = dict(model=MODEL_ID, tools=[WEATHER_TOOL], temperature=0, max_tokens=128)
    first = client.chat.completions.create(messages=openai_ask(), **common)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content  # the call is no text
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == CALL_ARGUMENTS
    # The agent runs the tool and sends the assistant's turn back as it came, with the result.
    history = [
        *openai_ask(),
        choice.message.model_dump(exclude_none=True),
        tool_result_turns(call.id),
    ]
    second = client.chat.completions.create(messages=history, **common)
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == ANSWER
    assert not second.choices[0].message.tool_calls
    # The call's turn and the result are in the prompt as the template writes them.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 50


def streamed_calls(stream) -> tuple[list[dict], str, str, str | None]:
    """(tool calls assembled from their deltas by index, content, reasoning, finish_reason)."""
    calls: dict[int, dict] = {}
    content, reasoning, finish = "", "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = piece.id or call["id"]
            if piece.function is not None:
                call["name"] += piece.function.name or ""
                call["arguments"] += piece.function.arguments or ""
        finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], content, reasoning, finish


def test_openai_client_streams_the_call_as_tool_call_deltas(server):
    client = server.client()
    common = dict(model=MODEL_ID, tools=[WEATHER_TOOL], temperature=0, max_tokens=128)
    stream = client.chat.completions.create(messages=openai_ask(), stream=True, **common)
    [call], content, reasoning, finish = streamed_calls(stream)
    assert finish == "tool_calls" and content == "" and reasoning == ""
    assert call["id"].startswith("call_") and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == CALL_ARGUMENTS
    # Thinking on: the reasoning streams first, then the call.
    stream = client.chat.completions.create(
        messages=openai_ask(), stream=True, extra_body={"enable_thinking": True}, **common
    )
    [thought_call], content, reasoning, finish = streamed_calls(stream)
    assert finish == "tool_calls" and content == "" and reasoning == REASONING
    assert json.loads(thought_call["arguments"]) == CALL_ARGUMENTS
    # The result streams back as the final text.
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": call["name"], "arguments": call["arguments"]},
            }
        ],
    }
    history = [*openai_ask(), assistant, tool_result_turns(call["id"])]
    stream = client.chat.completions.create(messages=history, stream=True, **common)
    calls, content, _, finish = streamed_calls(stream)
    assert calls == [] and content == ANSWER and finish == "stop"


def test_anthropic_client_gets_tool_use_and_answers_from_the_tool_result(server):
    client = anthropic_client(server)
    common = dict(
        model=MODEL_ID,
        max_tokens=128,
        tools=[ANTHROPIC_WEATHER_TOOL],
        extra_body={"temperature": 0},  # greedy (this client version has no temperature)
    )
    first = client.messages.create(messages=anthropic_ask(), **common)
    assert first.stop_reason == "tool_use"
    [use] = first.content
    assert use.type == "tool_use" and use.id.startswith("toolu_") and use.name == "get_weather"
    assert use.input == CALL_ARGUMENTS
    # The same tool and question render the same prompt as through the OpenAI API.
    openai_prompt = server.client().chat.completions.create(
        model=MODEL_ID, messages=openai_ask(), tools=[WEATHER_TOOL], max_tokens=1
    )
    prompt_tokens = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert prompt_tokens == openai_prompt.usage.prompt_tokens
    # As Anthropic's docs run the loop: the assistant's content as it came, then the result.
    history = [
        *anthropic_ask(),
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": TOOL_RESULT}],
        },
    ]
    second = client.messages.create(messages=history, **common)
    assert second.stop_reason == "end_turn"
    assert [block.type for block in second.content] == ["text"]
    assert second.content[0].text == ANSWER
    # Streamed, the call arrives as a tool_use block filled by input_json_delta events.
    with client.messages.stream(messages=anthropic_ask(), **common) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    assert "input_json" in [event.type for event in events] and streamed.stop_reason == "tool_use"
    # message_start counts the prompt already (before it is computed: all of it as input).
    assert events[0].type == "message_start"
    assert events[0].message.usage.input_tokens == prompt_tokens
    [streamed_use] = streamed.content
    assert streamed_use.type == "tool_use" and streamed_use.name == "get_weather"
    assert streamed_use.input == CALL_ARGUMENTS
    with client.messages.stream(messages=history, **common) as stream:
        assert "".join(stream.text_stream) == ANSWER
        assert stream.get_final_message().stop_reason == "end_turn"


def test_anthropic_client_streams_thinking_blocks(server):
    client = anthropic_client(server)
    common = dict(
        model=MODEL_ID,
        max_tokens=2048,
        tools=[ANTHROPIC_WEATHER_TOOL],
        extra_body={"temperature": 0},
        thinking=THINKING,
        messages=anthropic_ask(),
    )
    with client.messages.stream(**common) as stream:
        events = list(stream)
        final = stream.get_final_message()
    thought = "".join(e.thinking for e in events if e.type == "thinking")
    assert thought == REASONING
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "tool_use"]
    assert [block.type for block in final.content] == ["thinking", "tool_use"]
    assert final.content[0].thinking == REASONING
    assert final.content[1].input == CALL_ARGUMENTS and final.stop_reason == "tool_use"
    whole = client.messages.create(**common)
    assert [block.type for block in whole.content] == ["thinking", "tool_use"]
    assert whole.content[0].thinking == REASONING
    # Thinking asked off: the template closes the tag itself and no thinking block comes.
    off = client.messages.create(**{**common, "thinking": {"type": "disabled"}})
    assert [block.type for block in off.content] == ["tool_use"]
