"""The ASGI app (Starlette) and `serve`, which runs it under uvicorn beside the engine thread.

Requests are checked here, on the event loop, and queued for the engine thread
(`engine_worker.EngineWorker`, the server's side of `engine_service.EngineService`); a reply is
an ASGI response that relays the engine thread's events as they come, as server-sent events or
as one JSON body. Each reply also listens for the client's disconnect: a client that goes away
cancels its job, waiting or running (the engine stops before its next step).

Bodies are read incrementally: refused past `max_body_bytes` (413), or when they take longer than
the client timeout (408), or are not `application/json` (415). Every error is OpenAI's JSON error
shape with its status (`openai_shapes.ApiError`). What keeps one client from taking the server
(time limits, the connection limit, the Host and Origin checks, the log's flood guard) is in
limits.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..sanitize import escape_controls
from . import metrics as prometheus
from .access_log import CLIENT_CLOSED, REQUEST_ID, AccessLog, note
from .anthropic_shapes import AnthropicWriter, parse_count_tokens, parse_messages
from .anthropic_shapes import error_body as anthropic_error
from .engine_worker import EngineWorker, Failed, Finished, Job, Text, not_ready, request_chars
from .limits import (
    CLIENT_TIMEOUT_S,
    LOOPBACK_NAMES,
    MAX_CONNECTIONS,
    BrowserCORS,
    RequestGuard,
)
from .openai_replies import OpenAIWriter, model_card, system_fingerprint, usage
from .openai_shapes import ApiError, GenerationRequest, error_body, parse_chat, parse_completion
from .reply_parts import ReplyParts
from .responses_api import ResponseStore, ResponsesWriter, parse_responses
from .structured import compile_constraint, reply_facts

MAX_BODY_BYTES = 4 * 1024 * 1024
# A body over the limit is still read (and dropped) up to this size, so that the client, still
# sending, reads the 413 instead of a reset connection; past it the connection is closed.
DRAIN_BYTES = 64 * 1024 * 1024

# A prompt of fewer characters than this encodes in a moment: it waits only behind others like
# it, never behind a long one (one of each kind is encoded at a time: each takes memory).
SHORT_PROMPT_CHARS = 64 * 1024

Log = Callable[[str], None]

# The reply headers a web page's script may read (CORS): the request's id, edge0's warning.
EXPOSED_HEADERS = (REQUEST_ID, "x-edge0-warning")


def _stderr(line: str) -> None:
    # A log line quotes what clients sent and what files hold: control characters shown escaped.
    print(escape_controls(line), file=sys.stderr, flush=True)


@dataclass
class ServerSettings:
    model_ids: tuple[str, ...]  # the model's name first; any of these may be requested
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    log: Log = _stderr
    created: int = 0  # the model's `created`, set when the app is made
    # The Host names answered (None: any); `serve` sets them from the address it binds.
    hosts: frozenset[str] | None = LOOPBACK_NAMES
    origins: tuple[str, ...] = ()  # browser origins allowed (--cors); "*": any
    client_timeout_s: float = CLIENT_TIMEOUT_S  # for a request's headers, and for its body
    max_connections: int = MAX_CONNECTIONS
    # Refuse a request naming another model than model_ids (404) instead of answering it with
    # the one served (--strict-model-name).
    strict_model_name: bool = False


def error_response(
    error: ApiError, stats: prometheus.ServerStats | None = None, shape=None
) -> JSONResponse:
    """The error as a response (`shape`: ApiError -> body, for another API than OpenAI's)."""
    # Client errors (4xx) are counted by the access log, which sees every refusal.
    if stats is not None:
        if error.status == 429:
            stats.rejected += 1
        elif error.status >= 500:
            stats.failed += 1
    headers = {"Retry-After": "1"} if error.status in (429, 503) else None
    if error.status == 408:  # the rest of a body that came too slowly must not be read as a request
        headers = {"Connection": "close"}
    body = shape(error) if shape is not None else error.body()
    return JSONResponse(body, status_code=error.status, headers=headers)


class ClientGone(Exception):
    """The client disconnected before its request's body had arrived: nobody reads an answer."""


async def read_json(request: Request, limit: int, timeout_s: float = CLIENT_TIMEOUT_S) -> dict:
    """The request's JSON object, read chunk by chunk: refused past `limit` bytes, when it is not
    `application/json` (a browser's form or text/plain POST needs no preflight), or when the
    body takes more than `timeout_s` to arrive (a client sending it a byte at a time)."""
    kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if kind != "application/json":
        raise ApiError(
            415,
            f"the body must be JSON, sent as Content-Type: application/json (not "
            f"{kind[:60] or 'none'!r})",
            code="unsupported_media_type",
        )
    declared = request.headers.get("content-length", "")
    too_big = declared.isdigit() and int(declared) > limit
    if too_big and int(declared) > DRAIN_BYTES:
        raise _too_big(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in _body(request, timeout_s):
        size += len(chunk)
        too_big = too_big or size > limit
        if too_big:
            if size > DRAIN_BYTES:
                break
            continue
        chunks.append(chunk)
    if too_big:
        raise _too_big(limit)
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    return body


async def _body(request: Request, timeout_s: float):
    """The body's chunks, within `timeout_s` in all; ClientGone when the client leaves."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    stream = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), max(0.0, deadline - loop.time()))
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            raise ApiError(
                408,
                f"the request body did not arrive within {timeout_s:g} s",
                code="request_timeout",
            ) from None
        except ClientDisconnect:
            raise ClientGone() from None
        yield chunk


def _too_big(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes", code="request_too_large")


async def _no_receive() -> dict:
    raise RuntimeError("the reply's watcher owns receive")


class _ClientGone:
    """Put on a reply's event queue when its client disconnects."""


CLIENT_GONE = _ClientGone()
# The reply's warning when the request brought tools and the model's chat template never reads
# them: the model did not see them (a header, not an error: the reply is still the model's).
TOOLS_IGNORED = "tools ignored: this model's chat template does not take tools"


class GenerationResponse:
    """One reply: waits for the engine thread's events and sends them (SSE or one JSON body),
    in the shapes of the API asked (`writer`: openai_replies.OpenAIWriter,
    anthropic_shapes.AnthropicWriter or responses_api.ResponsesWriter); `parts` splits reasoning
    and tool calls out of the text."""

    def __init__(
        self,
        request: GenerationRequest,
        job: Job,
        events: asyncio.Queue,
        stats: prometheus.ServerStats,
        writer,
        parts: ReplyParts,
        error_body=lambda error: error.body(),
        warning: str | None = None,
    ) -> None:
        self.request = request
        # Said in the `x-edge0-warning` header and the request's log line: what the request
        # asked for that the reply was made without.
        self.warning = warning
        self.job = job
        self.events = events
        self.stats = stats
        self.writer = writer
        self.parts = parts
        self.error_body = error_body  # an ApiError in the API's shape

    async def __call__(self, scope, receive, send) -> None:
        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self.job.cancel()  # waiting: dropped; running: stops before its next step
                    self.events.put_nowait(CLIENT_GONE)
                    return

        self.scope = scope
        watcher = asyncio.create_task(watch())
        try:
            if self.request.stream:
                await self._stream(send)
            else:
                await self._whole(send)
        except OSError:  # the client went away while we were sending
            self.job.cancel()
            self._client_left()
        finally:
            watcher.cancel()
            self.job.cancel()  # a no-op once finished; an error above must not leave it running

    async def _first(self):
        event = await self.events.get()
        if event is CLIENT_GONE:
            self._client_left()
        return event

    def _client_left(self) -> None:
        self.stats.cancelled += 1
        note(self.scope, "cancelled: the client went away", CLIENT_CLOSED)

    async def _error(self, send, error: ApiError) -> None:
        if error.status == 429:
            self.stats.rejected += 1
        elif error.status >= 500:
            self.stats.failed += 1
        headers = {"Retry-After": "1"} if error.status in (429, 503) else None
        response = JSONResponse(self.error_body(error), status_code=error.status, headers=headers)
        await response(self.scope, _no_receive, send)

    def _finished(self, event: Finished, calls: list) -> tuple[str, dict]:
        """The reply's finish reason (tool_calls when it called one) and usage; logged."""
        self.stats.served += 1
        self.stats.prompt_tokens += event.prompt_tokens
        self.stats.completion_tokens += event.completion_tokens
        if "grammar_mask_ms" in event.figures:
            self.stats.constrained += 1
            self.stats.constrained_tokens += event.completion_tokens
            self.stats.grammar_mask_ms += event.figures["grammar_mask_ms"]
        reason = "tool_calls" if calls and event.finish_reason == "stop" else event.finish_reason
        f = event.figures
        # The profile the reply ran with: the server's, or one the request asked for.
        asked = " (asked)" if self.request.k is not None or self.request.mode is not None else ""
        called = f", called {', '.join(c.name for c in calls)}" if calls else ""
        called += f"; {self.warning}" if self.warning else ""
        asked_model = self.request.asked_model
        kind = self.request.kind
        if batch := f.get("batch"):  # decoded with other replies: rows a step, reads shared
            asked += (
                f", batched {batch['rows_per_step']:.1f} rows a step "
                f"({batch['reads_saved_fraction']:.0%} of the experts shared)"
            )
        if asked_model is not None:  # any name is answered by the one model: say which
            kind += f" for model {asked_model!r} (answered by {self.request.model})"
        note(
            self.scope,
            f"{kind} {event.prompt_tokens}+{event.completion_tokens} tokens "
            f"({f['reused_prompt_tokens']} reused), {f['ttft_ms']:.0f} ms to first token, "
            f"{f['decode_tok_per_s']:.1f} tok/s, blocked {f['blocked_ms_per_step']:.1f} ms/step, "
            f"cold {f['cold_fraction']:.0%}, K={f['k']} {f['mode']}{asked}, {reason}{called}",
        )
        reused = min(f["reused_prompt_tokens"], event.prompt_tokens)
        return reason, usage(event.prompt_tokens, event.completion_tokens, reused)

    def _warning_header(self) -> dict[str, str]:
        return {"x-edge0-warning": self.warning} if self.warning else {}

    async def _whole(self, send) -> None:
        pieces: list[tuple[str, str]] = []
        logprobs: list[dict] = []
        while True:
            event = await self._first()
            if event is CLIENT_GONE:
                return
            if isinstance(event, Text):
                pieces += self.parts.feed(event.text)
                logprobs += event.logprobs
                continue
            if isinstance(event, Failed):
                await self._error(send, event.error)
                return
            if event.finish_reason == "cancelled":  # the server is shutting down
                self.stats.cancelled += 1
                await self._error(send, not_ready("closed", None))
                return
            pieces += self.parts.feed(event.text)
            logprobs += event.logprobs
            last, calls = await self._finish_parts()
            pieces += last
            content = "".join(text for kind, text in pieces if kind == "content")
            reasoning = "".join(text for kind, text in pieces if kind == "reasoning")
            reason, used = self._finished(event, calls)
            body = self.writer.whole(
                content,
                reasoning if self.parts.thinks else None,
                calls,
                reason,
                used,
                event.figures,
                logprobs,
            )
            await JSONResponse(body, headers=self._warning_header())(self.scope, _no_receive, send)
            return

    async def _stream(self, send) -> None:
        event = await self._first()
        if event is CLIENT_GONE:
            return
        if isinstance(event, Failed):  # before any text: a plain error status
            await self._error(send, event.error)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no"),
                    *((k.encode(), v.encode()) for k, v in self._warning_header().items()),
                ],
            }
        )
        await self._send(send, self.writer.start())
        await self._stream_events(send, event)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _stream_events(self, send, event) -> None:
        writer = self.writer
        logprobs: tuple = ()  # waiting for a piece of text to go with
        while True:
            if event is CLIENT_GONE:
                return
            if isinstance(event, Failed):  # after text: an error event ends the stream
                self.stats.failed += 1
                await self._send(send, writer.error_event(event.error))
                return
            if event.finish_reason == "cancelled" if isinstance(event, Finished) else False:
                self.stats.cancelled += 1  # the server is shutting down
                await self._send(send, writer.error_event(not_ready("closed", None)))
                return
            logprobs += event.logprobs
            pieces = self.parts.feed(event.text)
            calls = []
            if isinstance(event, Finished):
                last, calls = await self._finish_parts()
                pieces += last
            for kind, text in pieces:
                await self._send(send, writer.delta(kind, text, logprobs))
                logprobs = ()
            if isinstance(event, Finished):
                reason, used = self._finished(event, calls)
                await self._send(send, writer.end(reason, calls, used, event.figures))
                return
            event = await self._first()

    async def _finish_parts(self):
        """The reply's last pieces and its tool calls, parsed on a worker thread: a long reply's
        parse must not hold the event loop that every other request is answered on."""
        return await asyncio.to_thread(self.parts.finish)

    @staticmethod
    async def _send(send, chunks: list[bytes]) -> None:
        for data in chunks:
            await send({"type": "http.response.body", "body": data, "more_body": True})


def create_app(worker: EngineWorker, settings: ServerSettings) -> Starlette:
    """The ASGI app. Starts the worker when the app starts, shuts it down when the app stops."""
    stats = prometheus.ServerStats()
    responses_kept = ResponseStore()  # for previous_response_id, while the server runs
    encoding = {"short": asyncio.Lock(), "long": asyncio.Lock()}
    settings.created = settings.created or int(time.time())

    def check_key(request: Request) -> None:
        """`Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's)."""
        if settings.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            token = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(token.strip().encode(), settings.api_key.encode()):
            raise ApiError(
                401,
                "missing or wrong API key (send `Authorization: Bearer KEY` or `x-api-key: KEY`)",
                code="invalid_api_key",
            )

    def guarded(handler, shape=None):
        """`handler` behind the key check, its refusals in the API's error shape (`shape`:
        ApiError -> body; OpenAI's by default)."""

        async def endpoint(request: Request):
            try:
                check_key(request)
                return await handler(request)
            except ApiError as e:
                return error_response(e, stats, shape)
            except ClientGone:  # nobody to answer
                note(request.scope, "the client went away before its body arrived", CLIENT_CLOSED)
                return Response(status_code=400)

        return endpoint

    async def encoded(request: Request, parse) -> tuple[GenerationRequest, list[int] | None]:
        """The request's body checked by `parse` and its prompt encoded (None: the model is not
        ready), within the prompt bounds every request has (EngineWorker.encode)."""
        body = await read_json(request, settings.max_body_bytes, settings.client_timeout_s)
        parsed: GenerationRequest = parse(body, settings.model_ids, settings.strict_model_name)
        lane = "short" if request_chars(parsed) < SHORT_PROMPT_CHARS else "long"
        async with encoding[lane]:  # a long prompt may take seconds and much memory
            tokens = await asyncio.to_thread(worker.encode, parsed)
        return parsed, tokens

    async def generate(request: Request, parse, api: str = "openai"):
        """A reply to a generation request of `api` (openai, anthropic or responses), checked
        by `parse`."""
        parsed, tokens = await encoded(request, parse)
        if tokens is not None:  # else the model is not ready: `submit` answers that
            parsed = await compile_constraint(parsed, worker, worker.opens_thinking(tokens))
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def post(event) -> None:  # the engine thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                job.stop()

        job = Job(parsed, post, tokens)
        worker.submit(job)  # ApiError: 503 loading, 429 queue full
        facts = reply_facts(parsed, worker.template_facts)
        parts = ReplyParts(facts, worker.opens_thinking(tokens), bool(parsed.tools))
        ignored = bool(parsed.tools) and not worker.template_facts.takes_tools
        warning = TOOLS_IGNORED if ignored else None
        if api == "anthropic":
            writer = AnthropicWriter(parsed, lambda: job.text.stopped, len(tokens or ()))
            return GenerationResponse(
                parsed, job, events, stats, writer, parts, anthropic_error, warning
            )
        if api == "responses":
            writer = ResponsesWriter(parsed, responses_kept)
            return GenerationResponse(parsed, job, events, stats, writer, parts, warning=warning)
        k = parsed.k if parsed.k is not None else (worker.configured or (None,))[0]
        writer = OpenAIWriter(parsed, system_fingerprint(worker.fingerprint, k))
        return GenerationResponse(parsed, job, events, stats, writer, parts, warning=warning)

    async def chat_completions(request: Request):
        return await generate(request, parse_chat)

    async def completions(request: Request):
        return await generate(request, parse_completion)

    async def messages(request: Request):
        return await generate(request, parse_messages, api="anthropic")

    async def responses(request: Request):
        """OpenAI's `POST /v1/responses`, as a chat request (responses_api.py)."""

        def parse(body: dict, model_ids: tuple[str, ...], strict: bool):
            return parse_responses(body, model_ids, responses_kept, strict)

        try:
            return await generate(request, parse, api="responses")
        except ApiError as e:  # the prompt's bounds name the chat request's field: here, input
            if e.param == "messages":
                e.param = "input"
            raise

    async def count_tokens(request: Request):
        """Anthropic's `POST /v1/messages/count_tokens`: the tokens a Messages request with
        this prompt would be encoded to, by the same path and bounds."""
        parsed, tokens = await encoded(request, parse_count_tokens)
        if tokens is None:
            raise not_ready(worker.state, worker.error)
        note(request.scope, f"count_tokens: {len(tokens)} tokens")
        return JSONResponse({"input_tokens": len(tokens)})

    def card(model_id: str) -> dict:
        k, mode = worker.configured or (None, None)
        details = {
            "state": worker.state,
            "k": k,  # the server's profile: what a request that names none runs with
            "mode": mode,
            "modes": worker.modes,
            "profiles": worker.profiles,
            **worker.info,
        }
        return model_card(model_id, settings.created, details)

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [card(settings.model_ids[0])]})

    async def model(request: Request):
        model_id = request.path_params["model"]
        if model_id not in settings.model_ids:
            raise ApiError(
                404, f"the model {model_id!r} does not exist here", param="model",
                code="model_not_found",
            )  # fmt: skip
        return JSONResponse(card(model_id))

    async def health(request: Request):
        body = {"status": worker.state, "model": settings.model_ids[0]}
        if worker.state == "ready":
            return JSONResponse({**body, "status": "ok"})
        if worker.error:  # failed: asking again will not help
            body["error"] = worker.error
            return JSONResponse(body, status_code=503)
        return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})  # loading

    async def metrics(request: Request):
        text = prometheus.render(worker, stats, settings.model_ids[0])
        return Response(text, media_type=prometheus.CONTENT_TYPE)

    async def http_error(request: Request, exc: HTTPException):
        error = ApiError(
            exc.status_code,
            f"{request.method} {request.url.path}: {exc.detail}",
            type="invalid_request_error",
            code="not_found" if exc.status_code == 404 else None,
        )
        return error_response(error, stats)

    async def server_error(request: Request, exc: Exception):
        stats.failed += 1
        return JSONResponse(error_body(f"internal error: {exc}", "server_error"), status_code=500)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.shutdown)

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", guarded(chat_completions), methods=["POST"]),
            Route("/v1/completions", guarded(completions), methods=["POST"]),
            Route("/v1/responses", guarded(responses), methods=["POST"]),
            Route("/v1/messages", guarded(messages, anthropic_error), methods=["POST"]),
            Route(
                "/v1/messages/count_tokens",
                guarded(count_tokens, anthropic_error),
                methods=["POST"],
            ),
            Route("/v1/models", guarded(models), methods=["GET"]),
            Route("/v1/models/{model:path}", guarded(model), methods=["GET"]),
            Route("/metrics", guarded(metrics), methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error, Exception: server_error},
        lifespan=lifespan,
        middleware=_middleware(settings, stats),
    )
    app.state.stats = stats
    app.state.worker = worker
    return app


def _middleware(settings: ServerSettings, stats: prometheus.ServerStats) -> list[Middleware]:
    """The access log around everything; the Host and Origin checks first; then, for the
    origins allowed (--cors), CORS (preflights answered, and the headers that let the page read
    the reply)."""
    middleware = [
        Middleware(AccessLog, log=settings.log, stats=stats),
        Middleware(RequestGuard, hosts=settings.hosts, origins=settings.origins),
    ]
    if settings.origins:
        middleware.append(
            Middleware(BrowserCORS, origins=settings.origins, expose_headers=EXPOSED_HEADERS)
        )
    return middleware
