"""The one thread that owns the engine, and the queue of requests in front of it.

Thread rule (as in the app's `EngineSession`): every MLX call (loading, generating, reading MLX
memory, closing) happens on the thread that runs `EngineWorker._serve`. The event loop that
answers HTTP talks to it only through this object:
- `submit` queues a `Job` in arrival order, or refuses it (503 while the model loads, 429 when
  `queue_limit` requests already wait behind the one running);
- `Job.cancel` (a client that went away) drops a waiting job, or makes the running generation stop
  before its next step (the engine checks `should_stop` after every token);
- the engine thread answers each job with events (`Text`, `Finished`, `Failed`) handed to the
  job's `post`, which puts them on the event loop without waiting;
- `live`, `memory`, `kv_cache_bytes`, `info` are snapshots the engine thread replaces and
  `/metrics` reads (plain attribute swaps).
The engine is single-request by design: one conversation's KV cache is kept between requests, so
a chat that sends its history again continues from it (`reused_prompt_tokens` in the figures).
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from engine import Edge0Error

from ..live_metrics import HISTORY_STEPS, LiveMetrics
from .openai_shapes import ApiError, GenerationRequest

# How often an idle engine thread re-reads MLX and page-cache memory for /metrics.
IDLE_REFRESH_S = 1.0


@dataclass(frozen=True)
class Text:
    text: str  # new reply text, never taken back


@dataclass(frozen=True)
class Finished:
    text: str  # the rest of the reply (what Text events have not carried yet)
    finish_reason: str  # "stop", "length" or "cancelled"
    prompt_tokens: int
    completion_tokens: int
    figures: dict  # the request's own measurements: the reply's `edge0` object


@dataclass(frozen=True)
class Failed:
    error: ApiError
    started: bool  # text had already been sent


Event = Text | Finished | Failed


@dataclass(eq=False)
class Job:
    request: GenerationRequest
    post: Callable[[Event], None]  # thread-safe: hands an event to the request's handler
    cancelled: threading.Event = field(default_factory=threading.Event)
    worker: EngineWorker | None = None

    def cancel(self) -> None:
        self.cancelled.set()
        if self.worker is not None:
            self.worker.discard(self)


class StopText:
    """The reply's text as it may be sent: cut at the first stop sequence, and holding back what
    could still become one (or a character whose last bytes have not been decoded yet)."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = stop
        self.sent = 0  # characters already handed out
        self.stopped = False

    def _cut(self, text: str) -> str:
        hits = [i for s in self.stop if (i := text.find(s)) >= 0]
        if hits:
            self.stopped = True
            return text[: min(hits)]
        return text

    def update(self, text: str) -> str:
        """The new text that may be sent, given the whole reply decoded so far."""
        text = self._cut(text)
        if not self.stopped:
            text = text.rstrip("\ufffd")
            held = max(
                (n for s in self.stop for n in range(len(s) - 1, 0, -1) if text.endswith(s[:n])),
                default=0,
            )
            text = text[: len(text) - held]
        new = text[self.sent :]
        self.sent = max(self.sent, len(text))
        return new

    def finish(self, text: str) -> str:
        """The rest of the reply once generation has ended."""
        text = self._cut(text)
        new = text[self.sent :]
        self.sent = len(text)
        return new


def request_figures(result, k: int, mode: str) -> dict:
    """A request's `edge0` object, from its GenerationResult: the decode figures are medians of
    the decode steps (the engine's summary), the prefill's apart."""
    s = result.summary
    figures = {
        "k": k,
        "mode": mode,
        "prompt_tokens": s["prompt_tokens"],
        "reused_prompt_tokens": s.get("reused_prompt_tokens", 0),
        "generated_tokens": s["generated_tokens"],
        "ttft_ms": s["ttft_ms"],
        "prefill_tok_per_s": s["prefill_tok_per_s"],
        "decode_tok_per_s": s["decode_tok_per_s"],
        "blocked_ms_per_step": s["median_blocked_ms"],
        "cold_fraction": s["median_cold_fraction"],
        "loads_per_step": s["median_loads"],
        "mib_read_per_step": s["median_mib_read"],
        "expert_pool_mib": s["median_expert_pool_mib"],
        "prefill_mib_read": s["prefill_mib_read"],
        "peak_mlx_bytes": s["peak_mlx_bytes"],
        "stopped_by": result.stopped_by,
    }
    if "prefetch_hit_rate" in s:  # prefetch mode: share of routed experts read ahead
        figures["prefetch_hit_rate"] = s["prefetch_hit_rate"]
    if "shadow_recall" in s:  # --shadow-router: recall@K of the predictions
        figures["prediction_recall"] = s["shadow_recall"]
    if mode == "prerouter":  # reads issued from predictions that arrived before they were needed
        decode = [st for st in result.steps if st.phase == "decode"]
        in_time = sum(st.prefetch_in_time for st in decode)
        late = sum(st.prefetch_late for st in decode)
        if in_time + late:
            figures["reads_ahead_in_time"] = in_time / (in_time + late)
    if s.get("nonfinite_repaired"):
        figures["nonfinite_repaired"] = s["nonfinite_repaired"]
    return figures


class EngineWorker:
    """Owns the Engine on one thread; serves queued jobs one at a time, in arrival order."""

    def __init__(
        self,
        open_engine: Callable[[], object],
        queue_limit: int = 16,
        on_ready: Callable[[EngineWorker], None] | None = None,
        on_failed: Callable[[str], None] | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self._open_engine = open_engine  # runs on the engine thread; returns an Engine
        self.queue_limit = queue_limit
        self._on_ready = on_ready
        self._on_failed = on_failed
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.state = "loading"  # "loading", "ready", "failed" or "closed"
        self.error: str | None = None
        self._cv = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
        self._quit = False
        self._thread: threading.Thread | None = None
        # Snapshots for /metrics and /v1/models, replaced by the engine thread.
        self.live = LiveMetrics()
        self.memory: dict = {}
        self.kv_cache_bytes = 0
        self.info: dict = {}
        self.profiles: list = []
        self.modes: list[str] = []
        self.last_figures: dict = {}

    # -- any thread --------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name="edge0-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job, or raise ApiError: 503 while loading (or after a failed load), 429 when
        the queue is full."""
        with self._cv:
            if self.state != "ready":
                raise not_ready(self.state, self.error)
            busy = self._running is not None or self._waiting
            if busy and len(self._waiting) >= self.queue_limit:
                raise ApiError(
                    429,
                    f"the engine is busy: {len(self._waiting)} requests already wait (the queue "
                    "limit); try again shortly",
                    type="rate_limit_error",
                    code="queue_full",
                )
            job.worker = self
            self._waiting.append(job)
            self._cv.notify()

    def discard(self, job: Job) -> None:
        with self._cv:
            try:
                self._waiting.remove(job)
            except ValueError:
                pass  # running (it stops at its next step) or done

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> bool:
        return self._running is not None

    def cancel_all(self) -> None:
        """Stop the running job and drop the waiting ones (the server is shutting down)."""
        with self._cv:
            waiting, running = list(self._waiting), self._running
            self._waiting.clear()
        if running is not None:
            running.cancelled.set()  # it ends at its next step, and says so itself
        for job in waiting:  # never started: answered 503 now
            job.cancelled.set()
            job.post(Failed(not_ready("closed", None), started=False))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop generating, close the engine on its thread and wait for it (up to `timeout`)."""
        self.cancel_all()
        with self._cv:
            self._quit = True
            self._cv.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # -- the engine thread -------------------------------------------------------------------------

    def _serve(self) -> None:
        import engine as surface  # MLX loads here, on the engine thread, after the server listens

        eng = None
        try:
            try:
                eng = self._open_engine()
            except Edge0Error as e:
                self._fail(str(e))
                return
            except Exception as e:  # noqa: BLE001 - reported, the server then stops
                traceback.print_exc()
                self._fail(f"cannot load the model: {e}")
                return
            self._publish_state(eng)
            self._refresh_memory(eng)
            with self._cv:
                if self._quit:
                    return
                self.state = "ready"
            if self._on_ready is not None:
                self._on_ready(self)
            last_refresh = time.monotonic()
            while True:
                with self._cv:
                    while not self._waiting and not self._quit:
                        if not self._cv.wait(timeout=IDLE_REFRESH_S):
                            break
                    if self._quit:
                        return
                    job = self._waiting.popleft() if self._waiting else None
                    self._running = job
                if job is None:
                    if time.monotonic() - last_refresh >= IDLE_REFRESH_S:
                        self._refresh_memory(eng)
                        last_refresh = time.monotonic()
                    continue
                try:
                    if not job.cancelled.is_set():
                        self._run(eng, job)
                except Exception as e:  # noqa: BLE001 - a bug: this request fails, not the server
                    traceback.print_exc()
                    error = ApiError(500, f"internal error: {e}", type="server_error")
                    job.post(Failed(error, started=True))
                finally:
                    with self._cv:
                        self._running = None
        except Exception as e:  # noqa: BLE001 - a bug: said, and every request answered
            traceback.print_exc()
            self._fail(f"the engine thread stopped: {e}")
        finally:
            with self._cv:
                self.state = "failed" if self.error else "closed"
            self.cancel_all()  # waiting requests are answered 503
            if eng is not None:
                eng.close()
            surface.release_thread_streams()  # this thread made MLX streams: it frees them

    def _fail(self, message: str) -> None:
        with self._cv:
            self.error = message
            self.state = "failed"
        if self._on_failed is not None:
            self._on_failed(message)

    def _publish_state(self, eng) -> None:
        info = eng.info()
        self.info = {k: info[k] for k in ("model", "family", "native_k", "experts", "layers")}
        self.info["expert_cache_bytes"] = info["expert_cache_bytes"]
        self.info["expert_bytes"] = info["expert_bytes"]
        self.profiles = [p.__dict__ for p in eng.profiles()]
        self.modes = eng.modes()
        self.live = replace(self.live, k=eng.k, mode=eng.mode)

    def _refresh_memory(self, eng) -> None:
        snapshot = eng.memory.snapshot()
        self.memory = {
            "mlx_active_bytes": snapshot.mlx_active_bytes,
            "mlx_cache_bytes": snapshot.mlx_cache_bytes,
            "mlx_peak_bytes": snapshot.mlx_peak_bytes,
            "rss_bytes": snapshot.rss_bytes,
            "page_cache_expert_bytes": snapshot.page_cache_expert_bytes,
        }
        self.kv_cache_bytes = eng.kv_cache_bytes()

    def _switch(self, eng, request: GenerationRequest) -> None:
        """The request's K and mode, applied before its prompt (they stay for later requests)."""
        if request.mode is None and request.k is None:
            return
        param = "mode"
        try:
            if request.mode is not None and request.mode != eng.mode:
                if request.mode not in eng.modes():
                    why = " (resident is chosen at start: --mode resident)"
                    raise Edge0Error(
                        f"mode {request.mode!r} is not available here (choose "
                        f"{', '.join(eng.modes())}){why if request.mode == 'resident' else ''}"
                    )
                eng.request_mode(request.mode)
            param = "k"
            if request.k is not None:
                eng.request_k(request.k)
        except Edge0Error as e:
            # Undo half a switch (a mode, then a K refused for it): ask for what stands.
            eng.request_mode(eng.mode)
            eng.request_k(eng.k)
            eng.apply_requests()
            raise ApiError(400, str(e), param=param) from None
        eng.apply_requests()  # Edge0Error (a file that cannot be read): the old profile stays
        self._publish_state(eng)

    def _run(self, eng, job: Job) -> None:
        request = job.request
        text = StopText(request.stop)
        tokens: list[int] = []
        recorder = _Recorder(self, eng)
        try:
            self._switch(eng, request)
            if request.kind == "chat":
                prompt = eng.encode_chat(list(request.messages))
            else:
                prompt = eng.encode(request.prompt)
            recorder.prompt_tokens = len(prompt)

            def on_token(token: int, step) -> None:
                tokens.append(token)
                recorder.on_token(step)
                new = text.update(eng.reply_text(tokens))
                if new:
                    job.post(Text(new))

            def should_stop() -> bool:
                return text.stopped or job.cancelled.is_set() or self._quit

            generation = request.generation
            if request.default_max_tokens:  # never past the context for a length not asked for
                room = max(1, eng.context_limit - len(prompt))
                generation = replace(generation, max_tokens=min(generation.max_tokens, room))
            result = eng.generate(prompt, generation, on_token, should_stop)
        except ApiError as e:
            job.post(Failed(e, started=False))
            return
        except Edge0Error as e:
            if tokens:
                job.post(Failed(ApiError(500, str(e), type="server_error"), started=True))
            else:  # the prompt (too long, a template that fails) or a sampling value
                code = (
                    "context_length_exceeded" if "exceeds the model's context" in str(e) else None
                )
                job.post(Failed(ApiError(400, str(e), code=code), started=False))
            return
        except Exception as e:  # noqa: BLE001 - one request fails, the server goes on
            traceback.print_exc()
            error = ApiError(500, f"internal error: {e}", type="server_error")
            job.post(Failed(error, started=bool(tokens)))
            return
        finally:
            self._refresh_memory(eng)
            self.live = replace(self.live, k=eng.k, mode=eng.mode)
        rest = text.finish(result.text)
        if text.stopped or result.stopped_by == "eos":
            reason = "stop"
        elif result.stopped_by == "max_tokens":
            reason = "length"
        else:
            reason = "cancelled"
        figures = request_figures(result, eng.k, eng.mode)
        self.last_figures = figures
        job.post(Finished(rest, reason, len(prompt), len(result.tokens), figures))


class _Recorder:
    """Publishes the live figures after every token, as the app's reply stream does."""

    def __init__(self, worker: EngineWorker, eng) -> None:
        self.worker = worker
        self.eng = eng
        previous = worker.live
        self.steps = deque(previous.recent_steps, maxlen=HISTORY_STEPS)
        self.token_ms = deque(previous.recent_token_ms, maxlen=HISTORY_STEPS)
        self.last_token_at: float | None = None
        self.prompt_tokens = 0
        self.generated = 0

    def on_token(self, step) -> None:
        now = time.perf_counter()
        self.generated += 1
        if step.phase == "decode" and self.last_token_at is not None:
            self.steps.append(step)
            self.token_ms.append((now - self.last_token_at) * 1e3)
        self.last_token_at = now
        previous = self.worker.live
        self.worker.live = LiveMetrics(
            k=step.k,
            mode=step.mode,
            context_tokens=self.prompt_tokens + self.generated,
            peak_memory_bytes=max(previous.peak_memory_bytes, step.mlx_peak_bytes),
            last_step=step,
            # The whole prompt's forwards as one, which the engine keeps (its thread: this one).
            last_prefill=self.eng.last_prefill,
            recent_steps=tuple(self.steps),
            recent_token_ms=tuple(self.token_ms),
        )
        self.worker.memory = {
            "mlx_active_bytes": step.mlx_active_bytes,
            "mlx_cache_bytes": step.mlx_cache_bytes,
            "mlx_peak_bytes": step.mlx_peak_bytes,
            "rss_bytes": step.rss_bytes,
            "page_cache_expert_bytes": step.page_cache_expert_bytes,
        }


def not_ready(state: str, error: str | None) -> ApiError:
    if state == "loading":
        return ApiError(
            503, "the model is loading; try again shortly", "server_error", None, "model_loading"
        )
    return ApiError(
        503,
        f"the model is not available: {error or 'the server is shutting down'}",
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
                print(f"edge0: {what}", file=sys.stderr, flush=True)

        source = resolve_model(spec, cache_dir, on_progress)
        adapter_dirs = tuple(resolve_adapters(str(a), on_progress) for a in config.adapter_dirs)
        engine = Engine(source.path, replace(config, adapter_dirs=adapter_dirs))
        for note in (source.notice, engine.quality_note(), *engine.warnings):
            if note:
                print(f"edge0: note: {note}", file=sys.stderr, flush=True)
        return engine

    return open_engine


def model_name(spec: str) -> str:
    """The model's id in the API: the checkpoint folder's name, `demo`, or the Hub repo id."""
    if spec == "demo":
        return spec
    local = Path(spec).expanduser()
    return local.resolve().name if local.exists() else spec
