"""The app's side of the engine thread: the chat screen's requests in, Textual messages out.

The engine thread is `edge0_tui.engine_service.EngineService` (the server runs on it too); here it
runs on a Textual thread worker that the chat screen starts and that calls `EngineSession.serve`.
The UI thread talks to that thread only through this object (method calls down):
- `submit` queues a reply; `stop_reply` and `shutdown` make the engine stop after the token it is
  writing, so a reply stops within one decode step;
- `request_k` / `request_mode` / `request_page_cache` take effect before the engine's next step,
  mid-reply too, and at once when idle; `reload` loads the model again in another mode;
  `open_model` opens another model in its place (the chat stays: the screen's controller
  holds it);
- `metrics` is the frozen snapshot the engine thread replaces after every token, and the UI reads.
Running as ranks (`edge0 chat --hosts`), the other ranks follow each reply with the K and mode
the engine agrees with them at each step; what would load the model again (`reload`,
`open_model`) is not asked for: `reload_refusal` says why (the others hold the model loaded),
and the chat controller and the model picker ask it first.
The engine thread answers with the messages in `edge0_tui.messages`, posted, never awaited
(messages up): workers never touch widgets.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from textual.message import Message

from engine import Edge0Error, Engine, EngineConfig, GenerationConfig, KProfile

from .engine_service import (
    EngineOpened,
    EngineService,
    EngineUnavailable,
    JobEvent,
    NewText,
    OpenFailed,
    QualityChanged,
    ReloadRefused,
    ReplyDone,
    ReplyJob,
    ServiceClosed,
    ServiceEvent,
    SwitchNotApplied,
)
from .live_metrics import HEAT_EVERY_S, LiveMetrics
from .messages import (
    ContextCounted,
    EngineFailed,
    EngineReady,
    ModelProgress,
    ModelRefused,
    QualityKept,
    ReplyFailed,
    ReplyFinished,
    ReplyText,
    SwitchFailed,
)
from .model_source import ModelSource, resolve_adapters, resolve_model
from .sanitize import sanitize

# Reply text reaches the UI at most this often: fast enough to read as live, slow enough that a
# few hundred tokens a second do not flood the UI's message queue.
TEXT_BATCH_S = 0.03

Post = Callable[[Message], object]


@dataclass(frozen=True)
class ReplyRequest:
    messages: list[dict]  # the whole conversation, `role`/`content` dicts
    generation: GenerationConfig


class ShownText:
    """The reply as the terminal may show it while it is written (the service's text filter)."""

    stopped = False  # the app has no stop sequences

    def __init__(self) -> None:
        self.shown = ""  # text already posted

    def update(self, text: str) -> str:
        # A character split across tokens decodes to U+FFFD until its last byte arrives: hold
        # trailing ones back rather than show a replacement character that then changes.
        # Cleaned of terminal control sequences as a whole, not per batch, so a sequence split
        # across two batches still goes (and what was posted stays a prefix of the rest). Should
        # a tokenizer ever rewrite earlier text, the final full update repairs it.
        text = sanitize(text.rstrip("\ufffd"))
        if len(text) <= len(self.shown):
            return ""
        new, self.shown = text[len(self.shown) :], text
        return new

    def finish(self, text: str) -> str:
        return sanitize(text)[len(self.shown) :]


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
        # A bug (not an Edge0Error) ends the engine thread: the chat screen says so.
        self.service = EngineService(
            self._open, on_event=self._on_event, bugs_end_service=True, heat_every_s=HEAT_EVERY_S
        )
        # The streaming run's page-cache budget, restored when leaving resident mode.
        self._streaming_page_cache = engine_config.page_cache_bytes
        self._post: Post = lambda message: None
        self._reply: ReplyJob | None = None  # the latest reply submitted
        self._opened: tuple[str, list[str]] = ("", [])  # the model's name and notices
        # A config to open with when `engine_config` cannot load the model, and what to say:
        # set when the config holds kept settings (models.json), so that a kept value that
        # breaks the load (an expert cache of 1 byte) does not break every start.
        self.fallback: tuple[EngineConfig, str] | None = None
        # While another model is opened (`open_model`), on the engine thread: its checked
        # source, and the model, config and fallback to load back should it fail to load.
        self._found: ModelSource | None = None
        self._back: tuple[str, EngineConfig, tuple[EngineConfig, str] | None] | None = None
        # Running as ranks: each rank's figures of the latest reply (expert reads, cache).
        self.rank_figures: list[dict] = []

    @property
    def engine(self) -> Engine | None:
        """Set by the engine thread once loaded. The UI thread may call only its thread-safe
        methods (request_k, request_mode) and read plain attributes."""
        return self.service.engine

    @property
    def runs_as_ranks(self) -> bool:
        """Started with --hosts: this is rank 0, and other ranks follow its replies."""
        return self.engine_config.expert_parallel

    def ranks_line(self) -> str:
        """How many ranks run the model and, after a reply, each one's expert reads and cache."""
        engine = self.engine
        size = engine.share.size if engine is not None and engine.share is not None else None
        line = f"{size} ranks" if size else "ranks"
        each = [
            f"rank {r['rank']:.0f}: {r['expert_mib_read']:.1f} MiB read, "
            f"{r['expert_cache_mib']:.1f} MiB cached"
            for r in self.rank_figures
        ]
        return "; ".join([line, *each])

    def reload_refusal(self) -> str | None:
        """Why the model cannot be loaded again now (None: it can)."""
        if not self.runs_as_ranks:
            return None
        return (
            "running as ranks (--hosts), the model stays loaded on every rank: resident mode "
            "and other models need a restart without --hosts"
        )

    @property
    def metrics(self) -> LiveMetrics:
        return self.service.live

    @property
    def closed(self) -> threading.Event:
        """Set once the engine thread has closed the engine and is about to return."""
        return self.service.closed

    # -- called on the UI thread -------------------------------------------------------------------

    def submit(self, request: ReplyRequest) -> None:
        job = ReplyJob(
            request.messages,
            request.generation,
            self._on_reply_event,
            ShownText(),
            text_every_s=TEXT_BATCH_S,
        )
        self._reply = job
        try:
            self.service.submit(job)
        except EngineUnavailable as e:  # the screen sends only once ready: a closed engine
            self._post(ReplyFailed(str(e), ""))

    def stop_reply(self) -> None:
        # The latest reply's own flag: a stop pressed before the engine picks it up is kept.
        if self._reply is not None:
            self._reply.stop()

    def request_k(self, k: int) -> KProfile:
        """Switch routing width; applied before the engine's next step. Raises Edge0Error."""
        return self.service.request_k(k)

    def request_mode(self, mode: str) -> KProfile:
        """Switch expert-loading mode; applied before the engine's next step. Returns the profile
        that will be used (a mode with heads may bring another K). Raises Edge0Error."""
        return self.service.request_mode(mode)

    def request_page_cache(self, budget_bytes: int | None) -> None:
        """Set the experts' page-cache budget (None: off); applied at once when idle. Kept in
        `engine_config`, so a reload (resident and back) and the settings dialog see it."""
        self.service.request_page_cache(budget_bytes)
        if self.engine_config.mode != "resident":
            self.engine_config = dataclasses.replace(
                self.engine_config, page_cache_bytes=budget_bytes
            )

    def reload(self, mode: str) -> None:
        """Load the model again in `mode` (resident <-> streaming); answered with EngineReady,
        or SwitchFailed and the old mode loaded back. Not while `reload_refusal` says why."""
        self.service.reload(lambda: self._open_in(mode))

    def open_model(
        self,
        model: str,
        engine_config: EngineConfig,
        fallback: tuple[EngineConfig, str] | None = None,
    ) -> None:
        """Close this model and open `model` with `engine_config` in its place (`fallback` as
        the attribute). Answered with EngineReady; or ModelRefused with the one-line reason:
        before anything is closed when `model` cannot be found or is no checkpoint edge0 runs
        (the words `edge0 chat` says it in), else after, with the model before loaded back as it
        ran (its K and mode) and its EngineReady. Not while `reload_refusal` says why."""
        self.service.reload(
            lambda: self._open_instead(model, engine_config, fallback),
            check=lambda: self._find(model),
        )

    def count_context(self, chat_id: int, messages: list[dict]) -> None:
        """Ask for a chat's context size; answered with `ContextCounted` (nothing on failure)."""
        self.service.count_tokens(messages, lambda n: self._post(ContextCounted(chat_id, n)))

    def shutdown(self) -> None:
        """Make the engine thread stop its reply, close the engine and return. Does not wait."""
        self.service.shutdown()

    # -- the engine thread -------------------------------------------------------------------------

    def serve(self, post: Post, worker_cancelled: Callable[[], bool]) -> None:
        """Load the model, then write replies as they are submitted, until shutdown.

        Runs on the engine thread for the whole session. `worker_cancelled` is the Textual
        worker's own flag, set when the app exits by any path, not only through `shutdown`.
        """
        self._post = post
        self.service.run(stop_when=worker_cancelled)

    def _on_event(self, event: ServiceEvent) -> None:
        if isinstance(event, EngineOpened):
            name, notices = self._opened
            self._post(EngineReady(name, event.info, event.profiles, event.modes, notices))
        elif isinstance(event, OpenFailed):
            self._post(EngineFailed(event.message))
        elif isinstance(event, SwitchNotApplied):
            self._post(SwitchFailed(event.message))
        elif isinstance(event, QualityChanged):
            self._post(QualityKept(event.quality))
        elif isinstance(event, ReloadRefused):
            self._post(ModelRefused(event.message, reloading=False))

    def _on_reply_event(self, event: JobEvent) -> None:
        if isinstance(event, NewText):
            self._post(ReplyText(event.text))
        elif isinstance(event, ReplyDone):
            self.rank_figures = event.summary.get("ranks", [])
            text = sanitize(event.text)
            self._post(
                ReplyFinished(text, event.stopped_by, event.summary, event.nonfinite_repaired)
            )
        else:
            text = sanitize(event.text.rstrip("\ufffd"))  # as it was shown
            self._post(ReplyFailed(str(event.error), text, event.nonfinite_repaired))

    def _progress(self, what: str, done: float, total: float | None) -> None:
        if self.service.quitting:
            raise ServiceClosed
        self._post(ModelProgress(what, done, total))

    def _open(self, source: ModelSource | None = None) -> Engine:
        """Load `self.model` (`source`: already found) with `self.engine_config`."""
        if source is None:
            source = resolve_model(self.model, self.cache_dir, self._progress, self.offline)
        # `--adapters` may name Hub repos: their adapter files are fetched here, on this thread.
        adapter_dirs = tuple(
            resolve_adapters(str(spec), self._progress, offline=self.offline)
            for spec in self.engine_config.adapter_dirs
        )
        config = dataclasses.replace(self.engine_config, adapter_dirs=adapter_dirs)
        self._post(ModelProgress(f"loading {source.name}", 0, None))
        fell_back = None
        try:
            engine = Engine(source.path, config)
        except Edge0Error as e:
            if self.fallback is None:
                raise
            self.engine_config, why = self.fallback
            self.fallback, fell_back = None, f"{why}: {e}; using the default"
            engine = Engine(
                source.path,
                dataclasses.replace(self.engine_config, **{"adapter_dirs": adapter_dirs}),
            )
        # What the engine warns of (stray shards, ignored adapter files or quality table) is
        # said as the server and `generate` say it.
        ranks = None
        if engine.share is not None:
            ranks = (
                f"running as {engine.share.size} ranks (--hosts): each reads and caches its "
                "share of the experts; the other ranks follow each reply"
            )
        notices = [
            n
            for n in (fell_back, source.notice, ranks, engine.quality_note(), *engine.warnings)
            if n
        ]
        self._opened = (source.name, notices)
        return engine

    def _open_in(self, mode: str) -> Engine:
        """The engine thread, the old engine closed: the model in `mode`, or back as it was."""
        previous = self.engine_config
        if previous.mode != "resident":
            self._streaming_page_cache = previous.page_cache_bytes
        page_cache = None if mode == "resident" else self._streaming_page_cache
        self.engine_config = dataclasses.replace(previous, mode=mode, page_cache_bytes=page_cache)
        try:
            return self._open()
        except Edge0Error as e:
            self._post(SwitchFailed(f"cannot load the model {mode}: {e}"))
            self.engine_config = previous
            return self._open()

    def _find(self, model: str) -> None:
        """The engine thread, the engine still open: find `model` (downloading it when it is a
        Hub repo not cached) and check its folder as `edge0 chat` does; Edge0Error when it
        cannot be opened. Keeps the running model's K and mode to load it back with."""
        from engine import check_checkpoint

        engine = self.service.engine
        config = self.engine_config
        if engine is not None:
            config = dataclasses.replace(config, k=engine.k, mode=engine.mode)
        self._back = (self.model, config, self.fallback)
        self._found = None
        source = resolve_model(model, self.cache_dir, self._progress, self.offline)
        check_checkpoint(source.path)  # "config.json: missing (not an ...)", before any close
        self._found = source

    def _open_instead(
        self, model: str, config: EngineConfig, fallback: tuple[EngineConfig, str] | None
    ) -> Engine:
        """The engine thread, the old engine closed: `model`, or the model before, loaded back."""
        source, self._found = self._found, None
        back = self._back
        self.model, self.engine_config, self.fallback = model, config, fallback
        self._streaming_page_cache = config.page_cache_bytes
        try:
            return self._open(source)
        except Edge0Error as e:
            if back is None:
                raise
            self._post(ModelRefused(str(e), reloading=True))
            self.model, self.engine_config, self.fallback = back
            if self.engine_config.mode != "resident":
                self._streaming_page_cache = self.engine_config.page_cache_bytes
            return self._open()
