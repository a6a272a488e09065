"""Structured output: a request's required form made into a grammar the engine decodes under.

The form comes checked for shape from openai_shapes (`GenerationRequest.output`: a JSON schema
or a GBNF grammar; `forced_tools`: a call the reply must make). Here it is compiled for the
served model's tokenizer (engine/runtime/constraint.py, llguidance) on a worker thread, within
COMPILE_TIMEOUT_S: the client wrote the schema, so neither its size nor its shape may hold the
event loop or the engine. A forced call is written in the model's own tool-call dialect
(tool_calls.forced_call_grammar), so the reply parses back as tool_calls; a template with no
dialect gets the bare JSON form. Whatever cannot be compiled is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from .engine_worker import EngineWorker
from .openai_shapes import GenerationRequest, bad
from .reply_parts import TemplateFacts
from .tool_calls import JSON_CALL, forced_call_grammar

# How long a grammar may take to compile before the request is refused: llguidance's own limits
# end a hostile one's work well before this (constraint.LIMITS); this bounds the wait besides.
COMPILE_TIMEOUT_S = 10.0


def constrained(request: GenerationRequest) -> bool:
    return request.output is not None or bool(request.forced_tools)


def reply_facts(request: GenerationRequest, facts: TemplateFacts) -> TemplateFacts:
    """The template's facts for splitting the reply: a forced call on a template with no
    dialect is written (and so parsed) in the bare JSON form."""
    if request.forced_tools and facts.dialect is None:
        return replace(facts, dialect=JSON_CALL)
    return facts


async def compile_constraint(
    request: GenerationRequest, worker: EngineWorker, opens_thinking: bool
) -> GenerationRequest:
    """`request` with its grammar compiled into its GenerationConfig (unchanged when it asks for
    no form). ApiError 400 naming the field for a grammar that cannot be used."""
    if not constrained(request):
        return request
    field = request.output.field if request.output is not None else "tool_choice"
    if opens_thinking:  # the grammar would hold the reasoning to it as well
        raise bad(
            f"{field}: this model's chat template opens a think block the reply would have to "
            "write under the grammar; send enable_thinking: false",
            field,
        )
    try:
        grammar = await asyncio.wait_for(
            asyncio.to_thread(_compile, request, worker), COMPILE_TIMEOUT_S
        )
    except TimeoutError:
        raise bad(f"{field} takes too long to compile: simplify it", field) from None
    return replace(request, generation=replace(request.generation, constraint=grammar))


def _compile(request: GenerationRequest, worker: EngineWorker):
    """The request's grammar for the engine's tokenizer (a worker thread: no MLX is run)."""
    from engine import GrammarError, compile_grammar, gbnf_source, json_schema_source, lark_source

    tokenizer = worker.service.engine.tokenizer
    output = request.output
    field = output.field if output is not None else "tool_choice"
    try:
        if output is None:
            source = lark_source(_forced_call(request, worker, tokenizer), "tool_choice's tools")
        elif output.kind == "json_schema":
            source = json_schema_source(output.value, field)
        else:
            source = gbnf_source(output.value, field)
        return compile_grammar(source, tokenizer, field)
    except GrammarError as e:
        raise bad(str(e), field) from None


def _closed_tool(tool: dict) -> dict:
    from engine import closed_schema

    parameters = tool["function"].get("parameters")
    if not isinstance(parameters, dict):
        return tool
    return {**tool, "function": {**tool["function"], "parameters": closed_schema(parameters)}}


def _forced_call(request: GenerationRequest, worker: EngineWorker, tokenizer) -> str:
    dialect = worker.template_facts.dialect

    def token_of(tag: str) -> int | None:
        """The tag's id where the vocabulary has it as one (added) token."""
        token = tokenizer.convert_tokens_to_ids(tag)
        return None if token is None or token == tokenizer.unk_token_id else token

    # Each tool's arguments closed to keys it does not list, as a response_format schema is.
    tools = [_closed_tool(tool) for tool in request.forced_tools]
    try:
        return forced_call_grammar(dialect, tools, token_of)
    except KeyError:
        raise bad(
            f"tool_choice cannot force a call in this model's tool-call dialect "
            f"({dialect.name}, which writes each argument apart): use auto",
            "tool_choice",
        ) from None
