"""`EngineService`: the thread that owns the Engine, its queue, and one reply's run."""

from __future__ import annotations

import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from engine import HEAD_MODES, Edge0Error

from ..live_metrics import HISTORY_STEPS, LiveMetrics
from .batching import BatchRun, batchable
from .jobs import (
    EngineOpened,
    EngineUnavailable,
    NewText,
    OpenFailed,
    QualityChanged,
    QueueFull,
    ReloadRefused,
    ReplyDone,
    ReplyError,
    ReplyJob,
    ServiceClosed,
    ServiceEvent,
    SwitchNotApplied,
    SwitchRefused,
)

if TYPE_CHECKING:
    from engine import (
        Engine,
        GeneratedToken,
        GenerationConfig,
        GenerationResult,
        HeatPicture,
        KProfile,
        StepMetrics,
    )

# How often an idle engine thread looks at its quit flags (a caller's flag cannot wake it).
POLL_S = 0.1
# How often an idle engine thread looks for a profile-quality table kept since it loaded (an
# `edge0 eval --profiles` run beside the app): one small file read.
QUALITY_POLL_S = 5.0


class EngineService:
    """Owns the Engine on one thread; runs queued jobs and chores one at a time, in order."""

    def __init__(
        self,
        open_engine: Callable[[], Engine],
        on_event: Callable[[ServiceEvent], object] = lambda event: None,
        queue_limit: int | None = None,
        memory_refresh_s: float | None = None,
        bugs_end_service: bool = False,
        heat_every_s: float | None = None,
        max_batch: int = 1,
    ) -> None:
        """`open_engine` runs on the engine thread and returns the loaded Engine (Edge0Error when
        it cannot; ServiceClosed to give up quietly). `queue_limit`: jobs that may wait (None: no
        limit). `memory_refresh_s`: when set, `memory` is re-read after every request and this
        often while idle. `bugs_end_service`: an exception other than Edge0Error ends the engine
        thread and leaves `run` (the app shows it); otherwise only the request it broke fails
        (the server keeps serving). `heat_every_s`: publish the expert heat picture with the
        live figures at most this often while a reply runs, and after its last step (None: never;
        the server has no view of it). `max_batch`: above one, replies run together as a batch
        (batching.py); the engine's config must plan as many KV caches."""
        self._open_engine = open_engine
        self._on_event = on_event
        self.queue_limit = queue_limit
        self._memory_refresh_s = memory_refresh_s
        self._bugs_end_service = bugs_end_service
        self.heat_every_s = heat_every_s
        self.max_batch = max_batch
        self.state = "loading"  # "loading", "ready", "failed" or "closed"
        self.error: str | None = None
        # The loaded engine; other threads may call only its thread-safe request methods and
        # read its plain attributes.
        self.engine: Engine | None = None
        self.closed = threading.Event()  # set once the engine is closed and the thread returns
        self._cv = threading.Condition()
        self._queue: deque[ReplyJob | Callable[[], None]] = deque()  # jobs and chores
        self._running: list[ReplyJob] = []  # generating now: one, or a batch's
        self._quit = False
        self._stop_when: Callable[[], bool] = lambda: False
        self._thread: threading.Thread | None = None
        # Snapshots, replaced by the engine thread.
        self.live = LiveMetrics()
        self.memory: dict = {}
        self.kv_cache_bytes = 0
        self.info: dict = {}
        self.profiles: list[KProfile] = []
        self.modes: list[str] = []
        self.last_figures: dict = {}

    # -- any thread --------------------------------------------------------------------------------

    def start(self) -> None:
        """Run the service on a thread of its own."""
        self._thread = threading.Thread(target=self.run, name="edge0-engine", daemon=True)
        self._thread.start()

    def submit(self, job: ReplyJob) -> None:
        """Queue a job; raises EngineUnavailable (not loaded, or closed) or QueueFull."""
        with self._cv:
            if self.state != "ready":
                raise EngineUnavailable(self.state, self.error)
            waiting = self.queue_depth
            busy = bool(self._running) or waiting
            if busy and self.queue_limit is not None and waiting >= self.queue_limit:
                raise QueueFull(waiting)
            job.service = self
            self._queue.append(job)
            self._cv.notify()

    def discard(self, job: ReplyJob) -> None:
        """Drop a waiting job (a running one, or one done, is left as it is)."""
        with self._cv:
            try:
                self._queue.remove(job)
            except ValueError:
                pass

    @property
    def queue_depth(self) -> int:
        """Jobs waiting behind the one running."""
        with self._cv:  # the engine thread changes the queue meanwhile
            return sum(isinstance(item, ReplyJob) for item in self._queue)

    @property
    def running(self) -> int:
        """Jobs generating now (a batch's, or one)."""
        return len(self._running)

    @property
    def quitting(self) -> bool:
        return self._quit or self._stop_when()

    def request_k(self, k: int) -> KProfile:
        """Switch routing width; applied before the engine's next step. Raises Edge0Error."""
        profile = self._loaded().request_k(k)
        self._chore(self._apply_switch)
        return profile

    def request_mode(self, mode: str) -> KProfile:
        """Switch expert-loading mode; applied before the engine's next step. Returns the profile
        that will be used (a mode with heads may bring another K). Raises Edge0Error."""
        profile = self._loaded().request_mode(mode)
        self._chore(self._apply_switch)
        return profile

    def request_page_cache(self, budget_bytes: int | None) -> None:
        """Set the experts' page-cache budget (None: off); applied at once when idle."""
        self._loaded().request_page_cache(budget_bytes)
        self._chore(self._apply_switch)

    def reload(
        self, open_engine: Callable[[], Engine], check: Callable[[], object] | None = None
    ) -> None:
        """Close the engine, then open the one `open_engine` returns (on the engine thread):
        how the app moves between resident and streaming modes, which one engine cannot switch,
        and opens another model. Answered with EngineOpened; an Edge0Error from `open_engine`
        ends the service. `check` runs first, the engine still open (a model to open next is
        found and validated there): an Edge0Error from it is answered with ReloadRefused, and
        the engine stays as it was."""
        self._chore(lambda: self._reload(open_engine, check))

    def count_tokens(self, messages: list[dict], answer: Callable[[int], object]) -> None:
        """Count a chat's tokens through the template, on the engine thread (bounded in time,
        never on a UI thread); `answer` gets the count, and is not called on an Edge0Error."""
        self._chore(lambda: self._count(messages, answer))

    def cancel_all(self) -> None:
        """Stop the running job and drop the waiting ones, which are told EngineUnavailable."""
        with self._cv:
            waiting = [item for item in self._queue if isinstance(item, ReplyJob)]
            running = list(self._running)
            for job in waiting:
                self._queue.remove(job)
        for job in running:
            job.stop()  # it ends at its next step, and says so itself
        unavailable = EngineUnavailable("closed", None)
        for job in waiting:
            job.dropped = True
            job.stop()
            job.post(ReplyError(unavailable, "", 0, 0))

    def shutdown(self) -> None:
        """Stop generating; the engine thread closes the engine and returns. Does not wait."""
        self.cancel_all()
        with self._cv:
            self._quit = True
            self._cv.notify_all()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the service's own thread (`start`) to end."""
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _loaded(self) -> Engine:
        engine = self.engine
        if engine is None:
            raise Edge0Error("the model is not loaded")
        return engine

    def _chore(self, chore: Callable[[], None]) -> None:
        with self._cv:
            self._queue.append(chore)
            self._cv.notify()

    # -- the engine thread -------------------------------------------------------------------------

    def run(self, stop_when: Callable[[], bool] = lambda: False) -> None:
        """Load the model, then serve jobs and chores until shutdown, then close the engine.

        The engine thread's whole life. `stop_when` is the caller's own quit flag (the Textual
        worker's, set when the app exits by any path), looked at while idle and between tokens.
        """
        import engine as surface  # MLX loads here, on the engine thread (a server listens first)

        self._stop_when = stop_when
        try:
            if self._open(self._open_engine):
                self._serve()
        except ServiceClosed:
            pass
        except Edge0Error as e:  # the model could not be prepared or loaded (again)
            self._fail(str(e))
        except Exception as e:
            if self._bugs_end_service:
                raise
            traceback.print_exc()
            what = "the engine thread stopped" if self.state == "ready" else "cannot load the model"
            self._fail(f"{what}: {e}")
        finally:
            with self._cv:
                self.state = "failed" if self.error else "closed"
            self.cancel_all()  # waiting jobs are told
            engine, self.engine = self.engine, None
            if engine is not None:
                engine.close()
            surface.release_thread_streams()  # this thread made MLX streams: it frees them
            self.closed.set()

    def _open(self, open_engine: Callable[[], Engine]) -> bool:
        """Load, publish the engine's facts, and say so. False when asked to quit meanwhile."""
        engine = open_engine()
        self.engine = engine
        self.live = LiveMetrics(
            k=engine.k,
            mode=engine.mode,
            peak_rss_bytes=_process_peak_rss(),
            loaded_memory=engine.memory.snapshot(),
        )
        self._publish_facts(engine)
        self._refresh_memory(engine)
        with self._cv:
            if self.quitting:
                return False
            self.state = "ready"
        self._on_event(EngineOpened(self.info, self.profiles, self.modes))
        return True

    def _serve(self) -> None:
        last_refresh = last_quality = time.monotonic()
        while True:
            with self._cv:
                while not self._queue and not self.quitting:
                    if not self._cv.wait(timeout=POLL_S):
                        break
                if self.quitting:
                    return
                item = self._queue.popleft() if self._queue else None
                if isinstance(item, ReplyJob):
                    self._running.append(item)
            if item is None:
                if self._memory_refresh_s and time.monotonic() - last_refresh >= (
                    self._memory_refresh_s
                ):
                    self._refresh_memory(self.engine)
                    last_refresh = time.monotonic()
                if time.monotonic() - last_quality >= QUALITY_POLL_S:
                    self._refresh_quality(self.engine)
                    last_quality = time.monotonic()
            elif isinstance(item, ReplyJob):
                self._serve_job(item)
            else:
                item()

    def _serve_job(self, job: ReplyJob) -> None:
        reply = _ReplyRun(self, self.engine, job)
        try:
            if not job.dropped:  # cancelled after it left the queue: nobody waits for it
                self._run(reply)
        except Exception as e:
            if self._bugs_end_service:
                raise
            traceback.print_exc()  # a bug: this request fails, the service goes on
            job.post(ReplyError(e, "", len(reply.tokens), reply.nonfinite_repaired))
        finally:
            self._finished(job)

    def _run(self, reply: _ReplyRun) -> None:
        """One job's reply: alone, or as the first of a batch that others join (batching.py).
        An Edge0Error is the request's answer (SwitchRefused too), anything else a bug."""
        try:
            prompt, generation = reply.prepare()
        except Edge0Error as e:
            reply.fail(e)
            return
        if self.max_batch > 1 and batchable(reply.job):
            BatchRun(self, reply, prompt, generation).run()
        else:
            reply.stream(prompt, generation)

    def _take_joiner(self) -> _ReplyRun | None:
        """The job at the head of the queue, when it can join the running batch now; None when
        the head is a chore, another profile's job, or nothing (it waits for the batch to end)."""
        with self._cv:
            head = self._queue[0] if self._queue else None
            if self.quitting or not isinstance(head, ReplyJob) or not self._joins_now(head):
                return None
            self._queue.popleft()
            self._running.append(head)
        return _ReplyRun(self, self.engine, head)

    def _joins_now(self, job: ReplyJob) -> bool:
        """Whether `job` can join the running batch now: it asks for no other K or mode."""
        engine = self.engine
        k, mode = self._profile_for(engine, job)
        same = k in (None, engine.k) and mode in (None, engine.mode)
        return same and batchable(job)

    def _finished(self, job: ReplyJob) -> None:
        with self._cv:
            if job in self._running:
                self._running.remove(job)

    def _fail(self, message: str) -> None:
        with self._cv:
            self.error = message
            self.state = "failed"
        self._on_event(OpenFailed(message))

    def _publish_facts(self, engine: Engine) -> None:
        self.info = engine.info()
        self.profiles = engine.profiles()
        self.modes = engine.modes()
        self.live = replace(self.live, k=engine.k, mode=engine.mode)

    def _refresh_quality(self, engine: Engine) -> None:
        quality = engine.profile_quality()
        if quality != self.info.get("profile_quality"):
            self.info = {**self.info, "profile_quality": quality}
            self._on_event(QualityChanged(quality))

    def _refresh_memory(self, engine: Engine) -> None:
        if self._memory_refresh_s is None:
            return  # nobody reads it (the app reads the system's memory itself)
        snapshot = engine.memory.snapshot()
        self.memory = {
            "mlx_active_bytes": snapshot.mlx_active_bytes,
            "mlx_cache_bytes": snapshot.mlx_cache_bytes,
            "mlx_peak_bytes": snapshot.mlx_peak_bytes,
            "rss_bytes": snapshot.rss_bytes,
            "page_cache_expert_bytes": snapshot.page_cache_expert_bytes,
            "process_peak_rss_bytes": _process_peak_rss(),
        }
        self.kv_cache_bytes = engine.kv_cache_bytes()

    def _apply_switch(self) -> None:
        """Apply a requested K, mode or budget now, while idle (a reply in between applied it at
        its first step, and this finds nothing left to do)."""
        engine = self.engine
        error: str | None = None
        try:
            engine.apply_requests()
        except Edge0Error as e:  # e.g. a heads file that cannot be read
            error = str(e)
        # Published before the event, so its reader sees the K and mode that stand.
        self.live = replace(self.live, k=engine.k, mode=engine.mode)
        if error is not None:
            self._on_event(SwitchNotApplied(error))

    def _reload(
        self, open_engine: Callable[[], Engine], check: Callable[[], object] | None
    ) -> None:
        if check is not None:
            try:
                check()
            except Edge0Error as e:
                self._on_event(ReloadRefused(str(e)))
                return
        engine, self.engine = self.engine, None
        engine.close()  # first: two copies of the experts (resident, streaming) never coexist
        self._open(open_engine)

    def _count(self, messages: list[dict], answer: Callable[[int], object]) -> None:
        try:
            tokens = len(self.engine.encode_chat(messages))
        except Edge0Error:
            return  # the next reply reports the template's error
        answer(tokens)

    def _switch_for(self, engine: Engine, job: ReplyJob) -> None:
        """The profile the job runs with, applied on this thread before its prompt: its own K
        and mode where it names them, else its base profile's (the server's configured one), so
        a switch one request asks for lasts for that request only. Without a base profile (the
        app), what the job names stays for later jobs."""
        k, mode = self._profile_for(engine, job)
        if k in (None, engine.k) and mode in (None, engine.mode):
            return  # the profile that stands
        param = "mode"
        try:
            if mode is not None and mode != engine.mode:
                if mode not in engine.modes():
                    why = " (resident is chosen at start: --mode resident)"
                    raise Edge0Error(
                        f"mode {mode!r} is not available here (choose "
                        f"{', '.join(engine.modes())}){why if mode == 'resident' else ''}"
                    )
                engine.request_mode(mode)  # picks a K with heads where the mode needs one
            param = "k"
            if k is not None:
                engine.request_k(k)
        except Edge0Error as e:
            # Undo half a switch (a mode, then a K refused for it): ask for what stands.
            engine.request_mode(engine.mode)
            engine.request_k(engine.k)
            engine.apply_requests()
            raise SwitchRefused(str(e), param) from None
        engine.apply_requests()  # Edge0Error (a file that cannot be read): the old profile stays
        self._publish_facts(engine)

    def _profile_for(self, engine: Engine, job: ReplyJob) -> tuple[int | None, str | None]:
        """(K, mode) to ask for; None for what need not change. A job naming only a mode keeps
        the base K where that mode can use it, else the K with heads nearest the native K (as
        the engine picks at start), whatever an earlier job left."""
        if job.base_profile is None:
            return job.k, job.mode
        base_k, base_mode = job.base_profile
        mode = job.mode or base_mode
        if job.k is not None:
            return job.k, mode
        if job.mode is None:
            return base_k, mode
        heads = [p.k for p in engine.profiles() if p.prerouter]
        if mode not in HEAD_MODES or base_k in heads or not heads:
            return base_k, mode  # no heads at all: the engine's refusal names the mode
        native = self.info.get("native_k", base_k)
        return min(heads, key=lambda k: (abs(k - native), k)), mode


class _ReplyRun:
    """One job on the engine thread: generates, sends its text, publishes the live figures."""

    def __init__(self, service: EngineService, engine: Engine, job: ReplyJob) -> None:
        self.service = service
        self.engine = engine
        self.job = job
        self.tokens: list[int] = []
        self.prompt_tokens = 0
        self.nonfinite_repaired = 0  # over the steps seen so far
        self.logprobs: list = []  # tokens' log-probabilities not sent yet (when asked for)
        self.last_text_at = time.perf_counter()
        self.last_token_at: float | None = None
        self.heat_at = -float("inf")  # when the last expert heat picture was taken
        previous = service.live
        self.steps: deque[StepMetrics] = deque(previous.recent_steps, maxlen=HISTORY_STEPS)
        self.token_ms: deque[float] = deque(previous.recent_token_ms, maxlen=HISTORY_STEPS)

    def stream(self, prompt: list[int], generation: GenerationConfig) -> None:
        """The reply to a prepared prompt, alone on the engine."""
        try:
            reply = self.engine.stream(prompt, generation, self._should_stop)
            for token in reply:
                self._took(token)
        except Edge0Error as e:
            self.fail(e)
            return
        self.answer(reply.result)

    def prepare(self) -> tuple[list[int], GenerationConfig]:
        """The job's profile applied, its prompt's tokens and its generation config."""
        engine, job = self.engine, self.job
        self.service._switch_for(engine, job)
        if job.prompt_tokens is not None:
            prompt = job.prompt_tokens
        elif isinstance(job.prompt, str):
            prompt = engine.encode(job.prompt)
        else:
            prompt = engine.encode_chat(list(job.prompt))
        self.prompt_tokens = len(prompt)
        generation = job.generation
        if job.fit_context:
            room = max(1, engine.context_limit - len(prompt))
            generation = replace(generation, max_tokens=min(generation.max_tokens, room))
        return prompt, generation

    def answer(self, result: GenerationResult) -> None:
        """The reply, whole: the job's last event."""
        try:
            done = self._done(result)
        finally:
            self._ended()
        self.service.last_figures = done.figures
        self.job.post(done)

    def fail(self, error: Edge0Error) -> None:
        """The reply failed: the job's last event names why, with the text given so far."""
        self._ended()
        text = self.engine.reply_text(self.tokens) if self.tokens else ""
        self.job.post(ReplyError(error, text, len(self.tokens), self.nonfinite_repaired))

    def _ended(self) -> None:
        service, engine = self.service, self.engine
        service._refresh_memory(engine)
        # The steps read the high-water mark as each ended; what came after the last is in it.
        peak_rss = max(service.live.peak_rss_bytes, _process_peak_rss())
        service.live = replace(
            service.live,
            k=engine.k,
            mode=engine.mode,
            peak_rss_bytes=peak_rss,
            expert_heat=self._heat(last=True),
        )

    def _should_stop(self) -> bool:
        return self.job.text.stopped or self.job.stop_asked.is_set() or self.service.quitting

    def _took(self, token: GeneratedToken) -> None:
        now = time.perf_counter()
        step = token.step
        self.tokens.append(token.token)
        if self.job.generation.logprobs is not None and token.logprobs is not None:
            self.logprobs.append(token.logprobs)
        self.nonfinite_repaired += step.nonfinite_repaired
        if step.phase == "decode" and self.last_token_at is not None:
            self.steps.append(step)
            self.token_ms.append((now - self.last_token_at) * 1e3)
        self.last_token_at = now
        self._publish(step)
        if now - self.last_text_at >= self.job.text_every_s:
            self.last_text_at = now
            # Decoding the whole reply (not token by token) keeps multi-token characters whole.
            new = self.job.text.update(self.engine.reply_text(self.tokens))
            if new:
                self.job.post(NewText(new, tuple(self.logprobs)))
                self.logprobs.clear()

    def _publish(self, step: StepMetrics) -> None:
        service = self.service
        previous = service.live
        service.live = LiveMetrics(
            k=step.k,
            mode=step.mode,
            context_tokens=self.prompt_tokens + len(self.tokens),
            peak_memory_bytes=max(previous.peak_memory_bytes, step.mlx_peak_bytes),
            # The step's reading of the kernel's high-water mark (a peak, not an RSS sample).
            peak_rss_bytes=max(previous.peak_rss_bytes, step.rss_peak_bytes),
            last_step=step,
            # The whole prompt's forwards as one, which the engine keeps (its thread: this one).
            last_prefill=self.engine.last_prefill,
            recent_steps=tuple(self.steps),
            recent_token_ms=tuple(self.token_ms),
            expert_heat=self._heat(),
        )
        service.memory = {
            "mlx_active_bytes": step.mlx_active_bytes,
            "mlx_cache_bytes": step.mlx_cache_bytes,
            "mlx_peak_bytes": step.mlx_peak_bytes,
            "rss_bytes": step.rss_bytes,
            "page_cache_expert_bytes": step.page_cache_expert_bytes,
            "process_peak_rss_bytes": service.live.peak_rss_bytes,
        }

    def _heat(self, last: bool = False) -> HeatPicture | None:
        """The expert heat picture of the latest step when one is due (`heat_every_s`; always
        for the reply's `last` step), else the one published before."""
        every = self.service.heat_every_s
        now = time.perf_counter()
        if every is None or (not last and now - self.heat_at < every):
            return self.service.live.expert_heat
        self.heat_at = now
        return self.engine.expert_heat()

    def _done(self, result: GenerationResult) -> ReplyDone:
        engine = self.engine
        # The summary counts every step, prefill chunks that produced no token included.
        repaired = result.summary.get("nonfinite_repaired", self.nonfinite_repaired)
        return ReplyDone(
            rest=self.job.text.finish(result.text),
            text=result.text,
            stopped_by=result.stopped_by,
            stopped_at_text=self.job.text.stopped,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=len(result.tokens),
            summary=result.summary,
            figures=request_figures(result, engine.k, engine.mode),
            nonfinite_repaired=repaired,
            logprobs=tuple(self.logprobs),
        )


def _process_peak_rss() -> int:
    """The most memory this process has held resident since it started (the kernel's mark,
    carried over the resets each request makes)."""
    import engine as surface  # on the engine thread, where MLX is already loaded

    return surface.process_lifetime_peaks()["peak_rss_bytes"]


def request_figures(result: GenerationResult, k: int, mode: str) -> dict:
    """A request's own figures, from its GenerationResult (the server's `edge0` object): the
    decode figures are medians of the decode steps (the engine's summary), the prefill's apart."""
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
        "peak_rss_bytes": s["peak_rss_bytes"],  # the kernel's high-water mark over the request
        "stopped_by": result.stopped_by,
    }
    if "draft" in s:  # speculative decoding: drafted, kept, verify steps
        figures["draft"] = s["draft"]
    if "batch" in s:  # decoded in a batch: rows a step, experts used against one at a time
        figures["batch"] = s["batch"]
    if "ranks" in s:  # --hosts: each rank's reads, cache, waits and speed
        figures["ranks"] = s["ranks"]
    if s.get("mask_ms"):  # a reply under a grammar: the host time its token masks took
        figures["grammar_mask_ms"] = s["mask_ms"]
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
