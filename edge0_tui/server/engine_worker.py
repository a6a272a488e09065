"""The server's side of the engine thread: HTTP requests in, their streaming events out.

The engine thread is `edge0_tui.engine_service.EngineService` (the app runs on it too), started
on a thread of its own. This adapter turns what the event loop needs into the service's terms:
- `Job` makes a `ReplyJob` of a checked request, with `StopText` (stop_text.py) as its text
  filter, and hands the service's events to the request's `post` as `Text`, `Finished` and
  `Failed` (an `ApiError` with the status to send), which `post` puts on the event loop without
  waiting;
- `EngineWorker.submit` queues a job, or refuses it (503 while the model loads, 429 when
  `queue_limit` requests already wait behind the one running);
- `Job.cancel` (a client that went away) drops a waiting job, or makes the running generation
  stop before its next step;
- `live`, `memory`, `kv_cache_bytes`, `info`, `profiles`, `modes` are the service's snapshots in
  the shapes `/metrics` and `/v1/models` send (read, never waited for).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from engine import Edge0Error

from ..engine_service import (
    EngineOpened,
    EngineService,
    EngineUnavailable,
    JobEvent,
    NewText,
    OpenFailed,
    QueueFull,
    ReplyDone,
    ReplyJob,
    ServiceEvent,
    SwitchRefused,
)
from ..live_metrics import LiveMetrics
from ..sanitize import escape_controls
from .openai_shapes import ApiError, GenerationRequest
from .reply_parts import THINK_CLOSE, THINK_OPEN, TemplateFacts
from .stop_text import StopText
from .tool_calls import dialect_of

# The request fields an engine-side check names at the start of its message (`top_k=...`).
SAMPLING_FIELD = re.compile(r"(top_k|top_p|temperature|seed|max_tokens|logit_bias|draft)=")
# A prompt and reply longer than the model's context, or than the one the memory plan counts.
CONTEXT_EXCEEDED = re.compile(r"new tokens exceeds the (model's )?context")

# An absolute path in an engine's message (the model's folder, a file in it): a reply shows its
# last part only, never where the server keeps its files.
ABSOLUTE_PATH = re.compile(r"(?<![\w.~])(?:/[^\s/:'\"()\[\],]+)+/?")

# How often an idle engine thread re-reads MLX and page-cache memory for /metrics.
IDLE_REFRESH_S = 1.0


@dataclass(frozen=True)
class Text:
    text: str  # new reply text, never taken back
    logprobs: tuple[dict, ...] = ()  # OpenAI's entries for the tokens since the last event


@dataclass(frozen=True)
class Finished:
    text: str  # the rest of the reply (what Text events have not carried yet)
    finish_reason: str  # "stop", "length" or "cancelled"
    prompt_tokens: int
    completion_tokens: int
    figures: dict  # the request's own measurements: the reply's `edge0` object
    logprobs: tuple[dict, ...] = ()


@dataclass(frozen=True)
class Failed:
    error: ApiError
    started: bool  # text had already been sent


Event = Text | Finished | Failed


class Job(ReplyJob):
    """A checked request as the engine thread's job; its events reach `post` in HTTP terms."""

    def __init__(
        self,
        request: GenerationRequest,
        post: Callable[[Event], None],
        prompt_tokens: list[int] | None = None,
    ) -> None:
        self.request = request
        self._post_http = post  # thread-safe: hands an event to the request's handler
        super().__init__(
            prompt=list(request.messages) if request.kind == "chat" else request.prompt,
            generation=request.generation,
            post=self._translate,
            text=StopText(request.stop),
            k=request.k,
            mode=request.mode,
            fit_context=request.default_max_tokens,
            prompt_tokens=prompt_tokens,
        )

    def _translate(self, event: JobEvent) -> None:
        if isinstance(event, NewText):
            self._post_http(Text(event.text, self._entries(event.logprobs)))
        elif isinstance(event, ReplyDone):
            if event.stopped_at_text or event.stopped_by == "eos":
                reason = "stop"
            elif event.stopped_by == "max_tokens":
                reason = "length"
            else:
                reason = "cancelled"
            self._post_http(
                Finished(
                    event.rest,
                    reason,
                    event.prompt_tokens,
                    event.completion_tokens,
                    event.figures,
                    self._entries(event.logprobs),
                )
            )
        else:
            started = event.completion_tokens > 0  # text may have been sent
            self._post_http(Failed(api_error(event.error, event.completion_tokens), started))

    def _entries(self, logprobs: tuple) -> tuple[dict, ...]:
        """OpenAI's logprobs entries ({token, logprob, bytes, top_logprobs}) of engine
        TokenLogprobs, the tokens' text decoded here, on the engine thread."""
        if not logprobs:
            return ()
        tokenizer = self.service.engine.tokenizer

        def entry(token: int, logprob: float) -> dict:
            text = tokenizer.decode([token])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return tuple(
            {
                **entry(item.token, item.logprob),
                "top_logprobs": [entry(token, logprob) for token, logprob in item.top],
            }
            for item in logprobs
        )


def without_paths(message: str, model_dir: Path | None = None) -> str:
    """`message` with each absolute path cut to its last part (`model_dir` first, whole, since
    its name may hold spaces)."""
    if model_dir is not None:
        message = message.replace(str(model_dir), model_dir.name)
    return ABSOLUTE_PATH.sub(lambda found: Path(found.group()).name or "/", message)


def template_refusal(error: Edge0Error, kind: str, model_dir: Path | None) -> ApiError:
    """A prompt the model's template or tokenizer could not make: a 400 naming what the request
    gave it (`messages`, or a completion's `prompt`), said without the server's paths. What
    the request checks can name more closely (a tool, a call's arguments) is refused before."""
    message = without_paths(str(error), model_dir)
    if CONTEXT_EXCEEDED.search(message):
        return ApiError(400, message, code="context_length_exceeded")
    return ApiError(400, message, param="messages" if kind == "chat" else "prompt")


def api_error(error: Exception, generated: int) -> ApiError:
    """The HTTP answer to a request that failed after `generated` tokens, said without the
    server's paths."""
    answer = _answer(error, generated)
    answer.message = without_paths(answer.message)
    return answer


def _answer(error: Exception, generated: int) -> ApiError:
    if isinstance(error, EngineUnavailable):
        return not_ready(error.state, error.error)
    if isinstance(error, SwitchRefused):
        return ApiError(400, str(error), param=error.param)
    if not isinstance(error, Edge0Error):  # a bug: this request fails, the server goes on
        return ApiError(500, f"internal error: {error}", type="server_error")
    if generated:
        return ApiError(500, str(error), type="server_error")
    # The prompt (too long, a template that fails) or a sampling value the engine checks against
    # the model (top_k against the vocabulary): the message begins with the field's name.
    message = str(error)
    if CONTEXT_EXCEEDED.search(message):
        return ApiError(400, message, code="context_length_exceeded")
    field = SAMPLING_FIELD.match(message)
    return ApiError(400, message, param=field.group(1) if field else None)


class EngineWorker:
    """The engine service on a thread of its own, answering in the HTTP server's terms."""

    def __init__(
        self,
        open_engine: Callable[[], object],
        queue_limit: int = 16,
        on_ready: Callable[[EngineWorker], None] | None = None,
        on_failed: Callable[[str], None] | None = None,
        max_batch: int = 1,
    ) -> None:
        self._on_ready = on_ready
        self._on_failed = on_failed
        self._token_chars: int | None = None  # the vocabulary's longest entry, once known
        # The profile the server was started with (--k, --mode): every request that names no K
        # or mode runs with it, whatever the one before asked for.
        self.configured: tuple[int, str] | None = None
        # What the model's chat template says of replies: think tags, its tool-call dialect.
        self.template_facts = TemplateFacts(thinks=False, dialect=None)
        # The fewest tokens the chat template writes for a turn of each role (measured at open).
        self.turn_tokens: dict[str, int] = {}
        self.service = EngineService(
            open_engine,  # runs on the engine thread; returns an Engine
            on_event=self._on_event,
            queue_limit=queue_limit,
            memory_refresh_s=IDLE_REFRESH_S,
            max_batch=max_batch,
        )

    def _on_event(self, event: ServiceEvent) -> None:  # the engine thread
        if isinstance(event, EngineOpened):
            self.configured = (self.service.live.k, self.service.live.mode)
            self.template_facts = template_facts(self.service.engine)
            self.turn_tokens = turn_tokens(self.service.engine)
            if self._on_ready is not None:
                self._on_ready(self)
        elif isinstance(event, OpenFailed) and self._on_failed is not None:
            self._on_failed(event.message)

    # -- any thread --------------------------------------------------------------------------------

    def start(self) -> None:
        self.service.start()

    def submit(self, job: Job) -> None:
        """Queue a job, or raise ApiError: 503 while loading (or after a failed load), 429 when
        the queue is full."""
        job.base_profile = self.configured
        try:
            self.service.submit(job)
        except EngineUnavailable as e:
            raise not_ready(e.state, e.error) from None
        except QueueFull as e:
            raise ApiError(
                429,
                f"the engine is busy: {e.waiting} requests already wait (the queue limit); try "
                "again shortly",
                type="rate_limit_error",
                code="queue_full",
            ) from None

    def encode(self, request: GenerationRequest) -> list[int] | None:
        """The request's prompt as tokens, encoded on the caller's thread (a prompt of megabytes
        takes seconds: never on the engine thread, where it would stall every reply); None while the
        model is not ready (`submit` answers that). Raises ApiError 400 for a prompt that cannot
        fit the model's context: at once, without encoding it, when it has more characters than
        the context's worth of the longest token; else once encoded, before it is queued."""
        engine = self.service.engine
        if engine is None or self.state != "ready":
            return None
        limit = engine.context_limit
        param = "messages" if request.kind == "chat" else "prompt"
        room = 1 if request.default_max_tokens else request.generation.max_tokens
        least = least_prompt_tokens(request, self._longest_token(engine), self.turn_tokens)
        if least + room > limit:
            raise ApiError(
                400,
                f"the prompt takes at least {least} tokens ({prompt_chars(request)} characters "
                f"of at most {self._longest_token(engine)} a token"
                + (f", {len(request.messages)} turns" if request.kind == "chat" else "")
                + f") plus {room} new tokens: more than the model's context of {limit}",
                param=param,
                code="context_length_exceeded",
            )
        try:
            if request.kind == "chat":
                tokens = engine.encode_chat(
                    list(request.messages), request.tools, request.template_kwargs
                )
            else:
                tokens = engine.encode(request.prompt)
        except Edge0Error as e:  # a chat template that fails: the model's
            raise template_refusal(e, request.kind, getattr(engine, "model_dir", None)) from None
        if len(tokens) + room > limit:
            raise ApiError(
                400,
                f"prompt of {len(tokens)} tokens plus {room} new tokens exceeds the model's "
                f"context of {limit}",
                param=param,
                code="context_length_exceeded",
            )
        return tokens

    def opens_thinking(self, tokens: list[int] | None) -> bool:
        """Whether the prompt ends inside an open think tag (the template's generation prompt
        opened it): the reply then starts with reasoning."""
        engine = self.service.engine
        if not tokens or engine is None or not self.template_facts.thinks:
            return False
        return engine.tokenizer.decode(tokens[-8:]).rstrip().endswith(THINK_OPEN)

    def _longest_token(self, engine) -> int:
        """The most characters one token of the model's vocabulary stands for (its longest
        entry: a byte-level entry has one character per byte, which is at least one character
        of text), measured once."""
        if self._token_chars is None:
            vocab = engine.tokenizer.get_vocab()
            self._token_chars = max(map(len, vocab), default=1)
        return self._token_chars

    def cancel_all(self) -> None:
        """Stop the running job and drop the waiting ones (the server is shutting down)."""
        self.service.cancel_all()  # never started: answered 503 now

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop generating, close the engine on its thread and wait for it (up to `timeout`)."""
        self.service.shutdown()
        self.service.join(timeout)

    # -- snapshots, replaced by the engine thread --------------------------------------------------

    @property
    def state(self) -> str:
        return self.service.state  # "loading", "ready", "failed" or "closed"

    @property
    def error(self) -> str | None:
        return self.service.error

    @property
    def queue_limit(self) -> int:
        return self.service.queue_limit

    @property
    def queue_depth(self) -> int:
        return self.service.queue_depth

    @property
    def running(self) -> int:
        return self.service.running

    @property
    def live(self) -> LiveMetrics:
        return self.service.live

    @property
    def memory(self) -> dict:
        return self.service.memory

    @property
    def last_figures(self) -> dict:
        """The last reply's own figures (`request_figures`)."""
        return self.service.last_figures

    @property
    def kv_cache_bytes(self) -> int:
        return self.service.kv_cache_bytes

    @property
    def info(self) -> dict:
        """What /v1/models says of the model."""
        info = self.service.info
        keys = ("model", "family", "native_k", "experts", "layers")
        return {k: info[k] for k in (*keys, "expert_cache_bytes", "expert_bytes") if k in info}

    @property
    def fingerprint(self) -> str | None:
        """The model's fingerprint (its config and routed experts' tensors), once loaded."""
        return self.service.info.get("fingerprint")

    @property
    def profiles(self) -> list[dict]:
        return [p.__dict__ for p in self.service.profiles]

    @property
    def modes(self) -> list[str]:
        return self.service.modes


def template_facts(engine) -> TemplateFacts:
    """Think tags and the tool-call dialect, read from the model's chat template."""
    template = getattr(engine.tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default, or all of them
        template = template.get("default") or "\n".join(map(str, template.values()))
    template = template if isinstance(template, str) else ""
    return TemplateFacts(
        thinks=THINK_CLOSE in template,
        dialect=dialect_of(template),
        takes_tools="tools" in template,
    )


# The roles whose text a chat template writes whole. An assistant turn's may be cut (templates
# drop earlier reasoning), and tools may be written in part (a name and a description only).
WHOLE_TEXT_ROLES = frozenset({"system", "user", "tool"})


def prompt_chars(request: GenerationRequest) -> int:
    """The characters of text the prompt holds at least: a completion's prompt, or what the chat
    template writes whole (WHOLE_TEXT_ROLES)."""
    if request.kind == "chat":
        return sum(
            len(m.get("content") or "") for m in request.messages if m["role"] in WHOLE_TEXT_ROLES
        )
    return len(request.prompt)


def request_chars(request: GenerationRequest) -> int:
    """The size of what a request brings to be encoded, in characters: its prompt, or its turns
    and tools as the chat template is given them (a turn's keys count: many short turns are
    much to render)."""
    if request.kind != "chat":
        return len(request.prompt)
    return sum(len(str(item)) for item in (*request.messages, *(request.tools or ())))


def least_prompt_tokens(
    request: GenerationRequest, longest_token: int, turn_tokens: dict[str, int]
) -> int:
    """The fewest tokens the request's prompt can take, known before the template renders it:
    its text (`prompt_chars`) in tokens of `longest_token` characters, and each turn's markup
    (`turn_tokens`). A prompt past the context by this count is past it once encoded too."""
    text = -(-prompt_chars(request) // longest_token)
    if request.kind != "chat":
        return text
    return text + sum(turn_tokens.get(m["role"], 0) for m in request.messages)


def turn_tokens(engine) -> dict[str, int]:
    """The fewest tokens the model's chat template writes around a turn of each role: the least
    one more empty turn adds to a conversation, after a user turn and after one of its own role
    (a template may write consecutive turns of a role in one block, as Qwen's does tool
    results), less two tokens (a turn's text may merge with the markup at either edge). A role
    the template refuses there (or an engine without one) is left out: no bound is taken."""
    first = [{"role": "user", "content": "a"}]
    counts = {}
    for role in sorted(WHOLE_TEXT_ROLES | {"assistant"}):
        lengths = []
        for n in range(3):  # a template that refuses the repeat refuses such requests too
            try:
                lengths.append(len(engine.encode_chat(first + [{"role": role, "content": ""}] * n)))
            except Exception:  # whatever fails here takes no bound, and never fails the open
                break
        added = [after - before for before, after in zip(lengths, lengths[1:])]
        if added:
            counts[role] = max(0, min(added) - 2)
    return counts


def not_ready(state: str, error: str | None) -> ApiError:
    if state == "loading":
        return ApiError(
            503, "the model is loading; try again shortly", "server_error", None, "model_loading"
        )
    return ApiError(
        503,
        f"the model is not available: {without_paths(error or 'the server is shutting down')}",
        "server_error",
        None,
        "model_unavailable",
    )


def open_engine_for(spec: str, config, cache_dir: Path) -> Callable[[], object]:
    """What the engine thread calls to load MODEL: a local folder, `demo` or a Hub repo (fetched
    first, progress on stderr), with `--adapters` repos fetched too."""

    def open_engine():
        from engine import Engine

        from ..model_source import resolve_adapters, resolve_model

        shown = set()

        def on_progress(what: str, done: float, total: float | None) -> None:
            if what not in shown:  # one line per stage; byte counts would flood a log
                shown.add(what)
                print(f"edge0: {escape_controls(what, False)}", file=sys.stderr, flush=True)

        source = resolve_model(spec, cache_dir, on_progress)
        adapter_dirs = tuple(resolve_adapters(str(a), on_progress) for a in config.adapter_dirs)
        engine = Engine(source.path, replace(config, adapter_dirs=adapter_dirs))
        # The memory plan is in the start-up text, once the server is ready (serving.py).
        for note in (server_notice(source.notice), engine.quality_note(), *engine.warnings):
            if note:
                print(f"edge0: note: {escape_controls(note, False)}", file=sys.stderr, flush=True)
        return engine

    return open_engine


def server_notice(notice: str | None) -> str | None:
    """A model's notice as a server says it: without what only the app's panels show."""
    from ..model_source import BUNDLED_NOTICE, DEMO_NOTICE, PANELS_NOTE

    if notice == BUNDLED_NOTICE:
        return notice.removesuffix(PANELS_NOTE).rstrip()
    if notice == DEMO_NOTICE:
        return notice.partition(";")[0] + "."  # "... Replies are noise."
    return notice


def model_name(spec: str) -> str:
    """The model's id in the API: the checkpoint folder's name, `demo`, or the Hub repo id."""
    if spec == "demo":
        return spec
    local = Path(spec).expanduser()
    return local.resolve().name if local.exists() else spec
