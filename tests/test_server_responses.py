"""OpenAI's Responses API (`POST /v1/responses`) with the official `openai` client against a real
`edge0 serve` process, on the tiny checkpoint trained to call a tool (tests/agent_model.py).

A Responses request is the chat request it stands for: the same question and tool render the
same prompt, so the trained model calls the tool, and given the tool's output (through
`previous_response_id`) answers in text. The SDK's typed objects and stream events must parse.
"""

from __future__ import annotations

import json

import openai
import pydantic
import pytest
from agent_model import (
    ANSWER,
    CALL_ARGUMENTS,
    MODEL_ID,
    QUESTION,
    REASONING,
    TOOL_RESULT,
    WEATHER_TOOL,
    openai_after_call,
)
from openai.types.responses import Response, ResponseStreamEvent
from test_server import API_KEY, metric, private_env, start_server, stop_server

from edge0_tui.server.engine_worker import not_ready
from edge0_tui.server.responses_api import ResponseStore, ResponsesWriter, parse_responses
from edge0_tui.server.tool_calls import ToolCall

# The chat endpoint's weather tool in the Responses API's flat shape.
TOOL = {"type": "function", **WEATHER_TOOL["function"]}
GREEDY = dict(model=MODEL_ID, temperature=0)


@pytest.fixture(scope="module")
def server(tool_calling_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("responses-log") / "server.log"
    server = start_server(
        tool_calling_checkpoint, log, private_env(tmp_path_factory), "--api-key", API_KEY
    )
    yield server
    stop_server(server)


def the_call(response):
    [call] = [item for item in response.output if item.type == "function_call"]
    return call


def test_a_function_call_whole_then_the_answer_from_its_output(server):
    client = server.client()
    first = client.responses.create(input=QUESTION, tools=[TOOL], max_output_tokens=128, **GREEDY)
    assert first.object == "response" and first.status == "completed"
    assert first.id.startswith("resp_") and first.model == MODEL_ID
    assert [item.type for item in first.output] == ["function_call"]
    call = the_call(first)
    assert call.call_id.startswith("call_") and call.name == "get_weather"
    assert json.loads(call.arguments) == CALL_ARGUMENTS
    assert first.tools[0].name == "get_weather" and first.tool_choice == "auto"
    # Thinking on: the reasoning comes first, as a reasoning item.
    thought = client.responses.create(
        input=QUESTION, tools=[TOOL], extra_body={"enable_thinking": True}, **GREEDY
    )
    assert [item.type for item in thought.output] == ["reasoning", "function_call"]
    assert thought.output[0].content[0].text == REASONING
    usage = first.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens > usage.input_tokens
    # The agent runs the tool and sends its output, continuing the stored response.
    second = client.responses.create(
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT}],
        tools=[TOOL],
        max_output_tokens=128,
        **GREEDY,
    )
    assert second.status == "completed" and second.previous_response_id == first.id
    assert second.output_text == ANSWER
    [message] = second.output
    assert message.type == "message" and message.role == "assistant"
    # The prompt is the chat endpoint's for the same conversation, token for token, and the
    # engine's KV cache held the part the first request computed.
    chat = client.chat.completions.create(
        messages=openai_after_call(call.call_id), tools=[WEATHER_TOOL], max_tokens=1, **GREEDY
    )
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert 0 < second.usage.input_tokens_details.cached_tokens < second.usage.input_tokens


def test_a_function_call_streamed_as_the_apis_events(server):
    client = server.client()
    events = list(
        client.responses.create(
            input=QUESTION, tools=[TOOL], max_output_tokens=128, stream=True, **GREEDY
        )
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert json.loads(events[4].arguments) == CALL_ARGUMENTS
    final = events[-1].response
    call = the_call(final)
    assert call.name == "get_weather" and json.loads(call.arguments) == CALL_ARGUMENTS
    assert final.usage.output_tokens > 0
    # The answer streams as a message's text; the SDK's own stream helper assembles it.
    output = {"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT}
    with client.responses.stream(
        previous_response_id=final.id, input=[output], tools=[TOOL], **GREEDY
    ) as stream:
        answer = list(stream)
        done = stream.get_final_response()
    kinds = [e.type for e in answer]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert "".join(e.delta for e in answer if e.type == "response.output_text.delta") == ANSWER
    assert done.output_text == ANSWER


def test_plain_text_whole_and_streamed_and_a_conversation_continued(server):
    client = server.client()
    served = metric(server.metrics(), "edge0_requests_served_total")
    ask = dict(input="Tell me about the sea.", instructions="Be terse.", **GREEDY)
    whole = client.responses.create(max_output_tokens=6, **ask)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 6 and whole.instructions == "Be terse."
    streamed = list(client.responses.create(max_output_tokens=6, stream=True, **ask))
    assert streamed[-1].type == "response.incomplete"
    text = "".join(e.delta for e in streamed if e.type == "response.output_text.delta")
    assert text == whole.output_text == streamed[-1].response.output_text
    # The next turn carries the conversation on: its prompt holds the first turn and the reply.
    more = client.responses.create(
        previous_response_id=whole.id,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "And the sky?"}]}],
        max_output_tokens=2,
        **GREEDY,
    )
    assert more.usage.input_tokens > whole.usage.input_tokens + whole.usage.output_tokens
    # store: false keeps nothing to continue from.
    unkept = client.responses.create(input="Hi.", store=False, max_output_tokens=1, **GREEDY)
    with pytest.raises(openai.BadRequestError) as gone:
        client.responses.create(previous_response_id=unkept.id, input="Again.", **GREEDY)
    assert gone.value.body["code"] == "previous_response_not_found"
    # The chat endpoint's counters and log: the start-up text offers it, each request is logged
    # (the refusal's line too, written before the next request, /metrics, is answered).
    assert metric(server.metrics(), "edge0_requests_served_total") == served + 4
    log = server.log.read_text()
    assert f"{server.url}/v1/chat/completions, /v1/completions, /v1/responses" in log
    assert "POST /v1/responses 200" in log and "POST /v1/responses 400" in log


REFUSED = [
    ({"previous_response_id": "resp_nowhere"}, "previous_response_id"),
    ({"extra_body": {"conversation": "conv_1"}}, "conversation"),
    ({"tool_choice": {"type": "custom", "name": "x"}, "tools": [TOOL]}, "tool_choice"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
     "input[0].arguments"),
    ({"text": {"format": {"type": "json_object"}}}, "text"),
]  # fmt: skip


@pytest.mark.parametrize("fields, param", REFUSED, ids=[p for _, p in REFUSED])
def test_what_edge0_cannot_do_is_a_400_naming_the_field(server, fields, param):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**{"model": MODEL_ID, "input": "hi", **fields})
    error = refused.value.body
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert param.partition("[")[0] in error["message"], error


def test_a_prompt_past_the_context_names_input(server):
    with pytest.raises(openai.BadRequestError) as past:
        server.client().responses.create(model=MODEL_ID, input="x" * 2_000_000)
    error = past.value.body
    assert error["param"] == "input" and error["code"] == "context_length_exceeded", error


# A lone surrogate as JSON writes it (the client would not send it): no reply can carry it.
LONE = '"caf\\ud800e"'
ECHOED = [
    (f'"metadata": {{"note": {LONE}}}', "metadata.note"),
    (f'"tools": [{{"type": "function", "name": "f", "note": {LONE}}}]', "tools[0].note"),
]


@pytest.mark.parametrize("field, param", ECHOED, ids=[p for _, p in ECHOED])
def test_what_the_reply_echoes_must_be_text(server, field, param):
    body = f'{{"input": "hi", "max_output_tokens": 1, {field}}}'.encode()
    status, raw = server.http("POST", "/v1/responses", body)
    assert status == 400 and json.loads(raw)["error"]["param"] == param, raw


def test_the_store_drops_the_oldest_past_its_count_or_size():
    store = ResponseStore(max_count=3, max_chars=100)
    turn = ({"role": "user", "content": "x"},)
    for n in range(5):
        store.put(f"resp_{n}", turn, 10)
    assert len(store) == 3 and store.get("resp_1") is None and store.get("resp_2") is not None
    store.put("resp_big", turn, 90)  # 120 characters: the oldest go until it fits
    assert store.get("resp_3") is None and store.get("resp_4") is not None
    assert store.chars == 100
    store.put("resp_huge", turn, 101)  # larger than the whole store: not kept
    assert store.get("resp_huge") is None and store.get("resp_big") is not None


def test_every_shape_validates_as_the_sdks_own_models():
    """Strictly (the client parses leniently): each event of a stream with reasoning, text and a
    call, cut at the length limit; one that fails mid-way; and a whole response."""
    store = ResponseStore()
    request = parse_responses({"input": "hi", "tools": [TOOL]}, (MODEL_ID,), store)
    used = {
        "prompt_tokens": 9,
        "completion_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    call = ToolCall("get_weather", CALL_ARGUMENTS, "call_1")
    events = pydantic.TypeAdapter(ResponseStreamEvent)

    def validate(chunks: list[bytes]) -> list:
        return [events.validate_json(chunk.partition(b"data: ")[2]) for chunk in chunks]

    writer = ResponsesWriter(request, store)
    chunks = (
        writer.start() + writer.delta("reasoning", "Hm.", ()) + writer.delta("content", "Hi", ())
    )
    ended = validate(chunks + writer.end("length", [call], used, {}))
    assert [e.sequence_number for e in ended] == list(range(len(ended)))
    assert ended[-1].type == "response.incomplete" and ended[-1].response.usage.total_tokens == 13
    assert [item.type for item in ended[-1].response.output] == [
        "reasoning",
        "message",
        "function_call",
    ]
    writer = ResponsesWriter(request, store)
    chunks = writer.start() + writer.delta("content", "Hi", ())
    failed = validate(chunks + writer.error_event(not_ready("closed", None)))
    assert [e.type for e in failed[-2:]] == ["error", "response.failed"]
    assert failed[-2].code == "model_unavailable" and failed[-1].response.status == "failed"
    whole = ResponsesWriter(request, store).whole("Hi", "Hm.", [call], "tool_calls", used, {}, [])
    assert Response.model_validate(whole).output_text == "Hi"
    assert len(store) == 2  # the finished replies are kept; the failed one is not
