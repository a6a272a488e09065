"""The engine and the one thread it runs on.

Thread rule: every MLX call (writing the synthetic demo model, loading, generating, closing) happens
on the thread that runs `EngineSession.serve`, a Textual thread worker started by the chat screen.
MLX streams are thread-local on Metal, so the engine must never be touched from two threads.

The UI thread talks to that thread only through this object:
- `submit` queues a reply; `stop_reply` and `shutdown` set events that the engine checks after
  every token (through `should_stop`), so a reply stops within one decode step;
- `request_k` / `request_mode` call the engine's thread-safe request methods, which take effect
  before the engine's next step, so they work in the middle of a reply; they also queue an
  `APPLY_SWITCH`, so that an idle engine applies the switch at once instead of at the next reply;
- `metrics` is a frozen snapshot the engine thread replaces after every token, and the UI reads.
The engine thread answers with the messages in `edge0_tui.messages`, posted, never awaited.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from textual.message import Message

from engine import (
    Edge0Error,
    Engine,
    EngineConfig,
    GenerationConfig,
    KProfile,
    StepMetrics,
    release_thread_streams,
)

from .live_metrics import HISTORY_STEPS, LiveMetrics
from .messages import (
    ContextCounted,
    EngineFailed,
    EngineReady,
    ModelProgress,
    ReplyFailed,
    ReplyFinished,
    ReplyText,
    SwitchFailed,
)
from .model_source import resolve_adapters, resolve_model
from .sanitize import sanitize

# Reply text reaches the UI at most this often: fast enough to read as live, slow enough that a
# few hundred tokens a second do not flood the UI's message queue.
TEXT_BATCH_S = 0.03

Post = Callable[[Message], object]


@dataclass(frozen=True)
class ReplyRequest:
    messages: list[dict]  # the whole conversation, `role`/`content` dicts
    generation: GenerationConfig


class _ApplySwitch:
    """Queued after a K or mode request: the engine thread applies the switch when it gets here
    (a reply in between applies it at its first step, and this finds nothing left to do)."""


APPLY_SWITCH = _ApplySwitch()


@dataclass(frozen=True)
class _Reload:
    """Close the engine and load the model again in `mode`: how the app moves between resident
    (every expert read into memory) and the streaming modes, which one engine cannot switch."""

    mode: str


@dataclass(frozen=True)
class _CountContext:
    """Count the tokens of a reopened chat on the engine thread (the chat template renders there,
    bounded in time, never on the UI thread)."""

    chat_id: int
    messages: list[dict]


class SessionClosed(Exception):
    """Raised inside a long preparation step (a download) to abandon it when the app quits."""


class EngineSession:
    def __init__(
        self,
        model: str,
        engine_config: EngineConfig,
        cache_dir: Path,
        offline: bool = False,
    ) -> None:
        self.model = model
        self.engine_config = engine_config
        self.cache_dir = Path(cache_dir)
        self.offline = offline
        # Set by the engine thread once loaded. The UI thread may call only its thread-safe
        # methods (request_k, request_mode) and read plain attributes.
        self.engine: Engine | None = None
        self.metrics = LiveMetrics()
        # Set once the engine thread has closed the engine and is about to return.
        self.closed = threading.Event()
        self._requests: queue.Queue = queue.Queue()  # replies and the engine thread's chores
        # The streaming run's page-cache budget, restored when leaving resident mode.
        self._streaming_page_cache = engine_config.page_cache_bytes
        self._stop_reply = threading.Event()
        self._quit = threading.Event()
        self._worker_cancelled: Callable[[], bool] = lambda: False

    # -- called on the UI thread -------------------------------------------------------------------

    def submit(self, request: ReplyRequest) -> None:
        # Cleared here, not on the engine thread: a stop pressed before the engine picks the
        # request up must not be lost.
        self._stop_reply.clear()
        self._requests.put(request)

    def stop_reply(self) -> None:
        self._stop_reply.set()

    def request_k(self, k: int) -> KProfile:
        """Switch routing width; applied before the engine's next step. Raises Edge0Error."""
        if self.engine is None:
            raise Edge0Error("the model is not loaded")
        profile = self.engine.request_k(k)
        self._requests.put(APPLY_SWITCH)
        return profile

    def request_mode(self, mode: str) -> KProfile:
        """Switch expert-loading mode; applied before the engine's next step. Returns the profile
        that will be used (a mode with heads may bring another K). Raises Edge0Error."""
        if self.engine is None:
            raise Edge0Error("the model is not loaded")
        profile = self.engine.request_mode(mode)
        self._requests.put(APPLY_SWITCH)
        return profile

    def reload(self, mode: str) -> None:
        """Load the model again in `mode` (resident <-> streaming); answered with EngineReady,
        or SwitchFailed and the old mode loaded back."""
        self._requests.put(_Reload(mode))

    def count_context(self, chat_id: int, messages: list[dict]) -> None:
        """Ask for a chat's context size; answered with `ContextCounted` (nothing on failure)."""
        self._requests.put(_CountContext(chat_id, messages))

    def request_page_cache(self, budget_bytes: int | None) -> None:
        """Set the experts' page-cache budget (None: off); applied at once when idle."""
        if self.engine is None:
            raise Edge0Error("the model is not loaded")
        self.engine.request_page_cache(budget_bytes)
        self._requests.put(APPLY_SWITCH)

    def shutdown(self) -> None:
        """Make the engine thread stop its reply, close the engine and return. Does not wait."""
        self._quit.set()
        self._stop_reply.set()
        self._requests.put(None)

    # -- the engine thread -------------------------------------------------------------------------

    def serve(self, post: Post, worker_cancelled: Callable[[], bool]) -> None:
        """Load the model, then write replies as they are submitted, until shutdown.

        Runs on the engine thread for the whole session. `worker_cancelled` is the Textual
        worker's own flag, set when the app exits by any path, not only through `shutdown`.
        """
        self._worker_cancelled = worker_cancelled
        engine: Engine | None = None
        try:
            engine = self._open(post)
            while not self._quitting():
                try:
                    request = self._requests.get(timeout=0.1)
                except queue.Empty:
                    continue
                if request is None:
                    break
                if isinstance(request, _ApplySwitch):
                    self._apply_switch(engine, post)
                elif isinstance(request, _Reload):
                    engine = self._reload(engine, request.mode, post)
                elif isinstance(request, _CountContext):
                    try:
                        tokens = len(engine.encode_chat(request.messages))
                    except Edge0Error:
                        continue  # the next reply reports the template's error
                    post(ContextCounted(request.chat_id, tokens))
                else:
                    self._reply(engine, request, post)  # reports its own Edge0Errors
        except Edge0Error as e:  # the model could not be prepared or loaded
            post(EngineFailed(str(e)))
        except SessionClosed:
            pass
        finally:
            self.engine = None
            if engine is not None:
                engine.close()
            release_thread_streams()  # this thread made MLX streams: it must free them
            self.closed.set()

    def _quitting(self) -> bool:
        return self._quit.is_set() or self._worker_cancelled()

    def _should_stop(self) -> bool:
        return self._stop_reply.is_set() or self._quitting()

    def _open(self, post: Post) -> Engine:
        def on_progress(what: str, done: float, total: float | None) -> None:
            if self._quitting():
                raise SessionClosed
            post(ModelProgress(what, done, total))

        source = resolve_model(self.model, self.cache_dir, on_progress, offline=self.offline)
        # `--adapters` may name Hub repos: their adapter files are fetched here, on this thread.
        adapter_dirs = tuple(
            resolve_adapters(str(spec), on_progress, offline=self.offline)
            for spec in self.engine_config.adapter_dirs
        )
        config = dataclasses.replace(self.engine_config, adapter_dirs=adapter_dirs)
        post(ModelProgress(f"loading {source.name}", 0, None))
        engine = Engine(source.path, config)
        self.engine = engine
        self.metrics = LiveMetrics(k=engine.k, mode=engine.mode)
        notices = [n for n in (source.notice, engine.quality_note()) if n]
        post(EngineReady(source.name, engine.info(), engine.profiles(), engine.modes(), notices))
        return engine

    def _reload(self, engine: Engine, mode: str, post: Post) -> Engine:
        previous = self.engine_config
        if previous.mode != "resident":
            self._streaming_page_cache = previous.page_cache_bytes
        page_cache = None if mode == "resident" else self._streaming_page_cache
        self.engine = None
        engine.close()  # first: resident and streaming copies of the experts never coexist
        self.engine_config = dataclasses.replace(previous, mode=mode, page_cache_bytes=page_cache)
        try:
            return self._open(post)
        except Edge0Error as e:
            post(SwitchFailed(f"cannot load the model {mode}: {e}"))
            self.engine_config = previous
            return self._open(post)

    def _apply_switch(self, engine: Engine, post: Post) -> None:
        """Apply a requested K or mode now, while idle: what the engine does before its next step."""
        error: str | None = None
        try:
            engine.apply_requests()
        except Edge0Error as e:  # e.g. a heads file that cannot be read
            error = str(e)
        # Published before the message, so the screen reads the K and mode that stand.
        self.metrics = dataclasses.replace(self.metrics, k=engine.k, mode=engine.mode)
        if error is not None:
            post(SwitchFailed(error))

    def _reply(self, engine: Engine, request: ReplyRequest, post: Post) -> None:
        reply = _ReplyStream(engine, self, post)
        try:
            prompt = engine.encode_chat(request.messages)
            reply.prompt_tokens = len(prompt)
            result = engine.generate(
                prompt, request.generation, on_token=reply.on_token, should_stop=self._should_stop
            )
        except Edge0Error as e:
            post(ReplyFailed(str(e), reply.text_so_far(), reply.nonfinite_repaired))
            return
        # The summary counts every step, prefill chunks that produced no token included.
        repaired = result.summary.get("nonfinite_repaired", reply.nonfinite_repaired)
        post(ReplyFinished(sanitize(result.text), result.stopped_by, result.summary, repaired))


class _ReplyStream:
    """One reply on the engine thread: batches its text to the UI and publishes the metrics."""

    def __init__(self, engine: Engine, session: EngineSession, post: Post) -> None:
        self._engine = engine
        self._session = session
        self._post = post
        self._tokens: list[int] = []
        self._shown = ""  # text already posted
        self._last_post = time.perf_counter()
        self._last_token_at: float | None = None
        previous = session.metrics
        self._steps: deque[StepMetrics] = deque(previous.recent_steps, maxlen=HISTORY_STEPS)
        self._token_ms: deque[float] = deque(previous.recent_token_ms, maxlen=HISTORY_STEPS)
        self.prompt_tokens = 0
        self.nonfinite_repaired = 0  # over the steps seen so far

    def on_token(self, token: int, step: StepMetrics) -> None:
        now = time.perf_counter()
        self._tokens.append(token)
        self.nonfinite_repaired += step.nonfinite_repaired
        if step.phase == "decode" and self._last_token_at is not None:
            self._steps.append(step)
            self._token_ms.append((now - self._last_token_at) * 1e3)
        self._last_token_at = now
        self._publish_metrics(step)
        if now - self._last_post >= TEXT_BATCH_S:
            self._last_post = now
            self._post_new_text()

    def _publish_metrics(self, step: StepMetrics) -> None:
        previous = self._session.metrics
        self._session.metrics = LiveMetrics(
            k=step.k,
            mode=step.mode,
            context_tokens=self.prompt_tokens + len(self._tokens),
            peak_memory_bytes=max(previous.peak_memory_bytes, step.mlx_peak_bytes),
            last_step=step,
            # The engine thread: the engine's own attribute is safe to read here.
            last_prefill=self._engine.last_prefill
            if step.phase == "prefill"
            else previous.last_prefill,
            recent_steps=tuple(self._steps),
            recent_token_ms=tuple(self._token_ms),
        )

    def _post_new_text(self) -> None:
        text = self.text_so_far()
        if len(text) > len(self._shown):
            # Decoding the whole reply (not token by token) keeps multi-token characters whole.
            # Should a tokenizer ever rewrite earlier text, the final full update repairs it.
            self._post(ReplyText(text[len(self._shown) :]))
            self._shown = text

    def text_so_far(self) -> str:
        # A character split across tokens decodes to U+FFFD until its last byte arrives: hold
        # trailing ones back rather than show a replacement character that then changes.
        # Cleaned of terminal control sequences as a whole, not per batch, so a sequence split
        # across two batches still goes (and what was posted stays a prefix of the rest).
        return sanitize(self._engine.reply_text(self._tokens).rstrip("\ufffd"))
