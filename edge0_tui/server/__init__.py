"""`edge0 serve`: an OpenAI- and Anthropic-compatible HTTP server with the memory wall as live metrics.

    app.py            the ASGI app (Starlette): routes, replies as SSE or one JSON body
    serving.py        `serve`: the listening socket, uvicorn, the start-up text
    access_log.py     one log line per request (status, time, what happened); client errors
    engine_worker.py  requests to the engine thread (../engine_service.py) and back
    stop_text.py      stop sequences over a growing reply, in linear work
    limits.py         time limits, the connection limit, Host/Origin checks, the log's flood guard
    openai_shapes.py  request checks in the OpenAI API's shapes (and its error JSON)
    openai_replies.py replies in OpenAI's shapes, whole or as SSE chunks
    anthropic_shapes.py  Anthropic's Messages API (/v1/messages): requests, replies, errors
    responses_api.py  OpenAI's Responses API (/v1/responses): requests, replies, past responses
    reply_parts.py    a reply's text split as it streams: reasoning, content, tool calls
    tool_calls.py     the tool-call dialects, one parser each, read from the chat template
    structured.py     response_format, json_schema, grammar, forced tool calls: a grammar
    metrics.py        GET /metrics in Prometheus's text format

No MLX here: the engine thread calls the `engine` surface; a worker thread compiles a request's
grammar (`engine.compile_grammar`, which runs no MLX).
"""

from __future__ import annotations

from .app import ServerSettings, create_app
from .engine_worker import EngineWorker, model_name, open_engine_for
from .serving import serve

__all__ = [
    "EngineWorker",
    "ServerSettings",
    "create_app",
    "model_name",
    "open_engine_for",
    "serve",
    "serve_model",
]


def serve_model(
    spec: str,
    open_engine,
    host: str = "127.0.0.1",
    port: int = 8080,
    api_key: str | None = None,
    queue_limit: int = 16,
    max_batch: int = 1,
    **limits,
) -> None:
    """`edge0 serve MODEL`: the model answers to its name and to `edge0` (and to any other name
    unless `strict_model_name`). `limits`: the ServerSettings of origins, max_connections,
    client_timeout_s and strict_model_name."""
    name = model_name(spec)
    ids = (name,) if name == "edge0" else (name, "edge0")
    given = {name: value for name, value in limits.items() if value is not None}
    settings = ServerSettings(model_ids=ids, api_key=api_key, **given)
    serve(open_engine, settings, host, port, queue_limit, max_batch)
