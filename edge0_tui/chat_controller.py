"""What the chat screen knows and asks for, without Textual: the screen draws, this decides.

`ChatController` holds the conversation shown (its saved id and messages, each written to the
`ChatStore` as it becomes final), the sampling settings and system prompt the next reply is asked
with, whether the engine is ready, and the K and mode switches asked of the engine session and not
yet applied. The chat screen calls its methods (method calls down) and draws what they return: a
`Notice` to say, an `Outcome` (the selector's choice, what to keep and say, the loading screen). It
never touches a widget, so it is tested without a terminal (tests/test_chat_controller.py).
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from engine import HEAD_MODES, Edge0Error, GenerationConfig, KProfile

from .chat_store import ChatHandle, ChatMessage, ChatStore, chat_title
from .engine_session import ReplyRequest
from .live_metrics import LiveMetrics
from .preferences import ModelPreferences
from .sanitize import error_line

if TYPE_CHECKING:
    from .engine_session import EngineSession
    from .messages import EngineReady


@dataclass(frozen=True)
class Notice:
    """A line for the user, as the screen shows it (a toast)."""

    text: str
    severity: Literal["information", "warning", "error"] = "information"
    title: str = ""
    timeout: float | None = None


@dataclass(frozen=True)
class Outcome:
    """What a choice or an engine's news came to, for the screen to draw. `k` / `mode`: what the
    selector shows now (the choice, or what still stands when it was refused; None: as it is);
    `kept`: the choices to keep for this model; `notices`: what to tell the user; `loading`: the
    loading screen goes up (True) or away (False); `changed`: the engine's state changed (ready
    or not, a switch asked for), so the panels and the keys on offer change with it."""

    k: int | None = None
    mode: str | None = None
    kept: dict = field(default_factory=dict)
    notices: tuple[Notice, ...] = ()
    loading: bool | None = None
    changed: bool = False


# How often the panels are drawn while nothing happens (the timer runs at the live rate).
IDLE_PANELS_S = 1.0
# How long the notices shown once the model is loaded stay: toasts sit over the side panel's
# K and mode selectors, so not for long (the demo's notice is one sentence).
STARTUP_NOTICE_S = 8
# Said when a reload is asked for while a reply is written: the reload would cut the reply.
WAIT_FOR_THE_REPLY = Notice(
    "wait for the reply to end (or press Escape) before reloading the model"
)
# Said when another chat is asked for while a reply is written.
STOP_THE_REPLY_FIRST = Notice("a reply is being written: press Escape to stop it first", "warning")


class ChatController:
    """One chat screen's conversation and engine controls; used from the UI thread only."""

    def __init__(self, session: EngineSession, store: ChatStore, settings: GenerationConfig):
        self.session = session
        self.store = store
        self.settings = settings
        self.system_prompt = ""  # from the model's preferences once mounted; "" sends none
        self.chat: ChatHandle | None = None  # None until the chat's first message
        self.messages: list[ChatMessage] = []
        # Tokens the engine saw for this chat's latest reply (prompt and reply); None when unknown
        # (a reopened chat, until its next reply). The engine re-reads the whole chat every reply.
        self.context_tokens: int | None = 0
        self.model_name = session.model
        self.state = "loading model…"
        self.ready = False
        self._panels_metrics: LiveMetrics | None = None  # what the panels last drew, and when
        self._panels_at = float("-inf")
        self.engine_info: dict = {}  # Engine.info() once loaded (the palette shows its BLAS)
        self.wired_limit_bytes: int | None = None  # Metal's, from the engine once loaded
        # What the loaded engine offers, as the selector shows it: its K profiles and the modes.
        self.profiles: list[KProfile] = []
        self.modes: list[str] = []
        # K or mode asked for and not yet applied by the engine (it applies them before its next step).
        self.pending_k: int | None = None
        self.pending_mode: str | None = None

    # -- the conversation --------------------------------------------------------------------------

    @property
    def chat_id(self) -> int | None:
        """The shown chat's id in the database; None for a new chat, or one not written yet."""
        return self.chat.id if self.chat is not None else None

    @property
    def title(self) -> str:
        """The chat's title, as the screen's header shows it."""
        return self.chat.title if self.chat is not None else "new chat"

    @property
    def last_is_reply(self) -> bool:
        """The last message is a finished reply (one Regenerate can write again)."""
        return bool(self.messages) and self.messages[-1].role == "assistant"

    def reply_to_copy(self) -> tuple[str | None, Notice]:
        """The last reply, for the clipboard (None: there is none yet), and what to say."""
        replies = [m.content for m in self.messages if m.role == "assistant"]
        if not replies:
            return None, Notice("no reply to copy yet", "warning")
        return replies[-1], Notice("copied the last reply to the clipboard")

    def new_chat(self) -> None:
        """An empty chat, written to the database with its first message."""
        self.chat, self.messages, self.context_tokens = None, [], 0

    def is_saved(self, chat_id: int) -> bool:
        """Chat `chat_id` is in the database (another edge0 may have deleted it since); False
        when the database cannot be read."""
        saved = self._saved_ids()
        return saved is not None and chat_id in saved

    def shown_chat_deleted(self) -> bool:
        """The chat shown was written and is no longer in the database (deleted in the chat
        list); False when that cannot be told, so that the chat stays on screen."""
        if self.chat_id is None:
            return False
        saved = self._saved_ids()
        return saved is not None and self.chat_id not in saved

    def _saved_ids(self) -> set[int] | None:
        """The ids of the chats in the database; None when it cannot be read."""
        try:
            return {c.id for c in self.store.chats()}
        except sqlite3.Error:
            return None

    def open(self, chat_id: int) -> Notice | None:
        """Continue saved chat `chat_id`: its messages, its context size to count again. A notice
        when it cannot be read (the chat shown stays)."""
        try:
            messages = self.store.messages(chat_id)
        except sqlite3.Error as e:
            return Notice(f"cannot read the chat: {e}", "error")
        self.messages, self.context_tokens = messages, None
        first_user = next((m.content for m in messages if m.role == "user"), "")
        self.chat = ChatHandle(chat_title(first_user), self.model_name, chat_id)
        return None

    def save(self, message: ChatMessage) -> tuple[ChatMessage, Notice | None]:
        """Add a message to the conversation and the database (creating the chat on its first).
        Returns the message as kept (cleaned of terminal control sequences) and what to say
        about saving it: an error, a save left pending, the waiting ones written at last."""
        message = message.cleaned()
        self.messages.append(message)
        if self.chat is None:
            self.chat = ChatHandle(chat_title(message.content), self.model_name)
        were_waiting = self.store.unsaved
        try:
            saved = self.store.save(self.chat, message)
        except sqlite3.Error as e:  # not a lock: this message cannot be written at all
            return message, Notice(f"could not save the message: {e}", "error")
        if not saved:
            return message, Notice(
                f"saving is pending: the chat database is busy ({self.store.last_error}). "
                f"{self.store.unsaved} message(s) are kept in memory and saved once it is free.",
                "warning",
                timeout=10,
            )
        if were_waiting:
            return message, Notice(f"saved the {were_waiting} message(s) that were waiting")
        return message, None

    def drop_last_reply(self) -> Notice | None:
        """Forget the last reply, to write it again; a notice when the database keeps it."""
        try:
            self.store.drop_last_reply(self.chat)
        except sqlite3.Error as e:  # locked past the busy timeout: keep the reply as it is
            return Notice(f"cannot replace the reply now: {e}", "error")
        self.messages.pop()
        return None

    def prompt(self) -> list[dict]:
        """What the engine is sent: the system prompt, then the chat's messages."""
        prompt = [m.as_prompt() for m in self.messages]
        if self.system_prompt:
            prompt.insert(0, {"role": "system", "content": self.system_prompt})
        return prompt

    # -- a reply -----------------------------------------------------------------------------------

    def busy(self, writing: bool) -> Notice | None:
        """Why another chat cannot be shown now (`writing`: a reply is being written), or None."""
        return STOP_THE_REPLY_FIRST if writing else None

    def send_refusal(self, writing: bool) -> Notice | None:
        """Why a message cannot be sent now (`writing`: a reply is being written), or None."""
        if not self.ready:
            return Notice(f"cannot send: {self.state}", "warning")
        if writing:
            return Notice("a reply is being written: wait, or press Escape to stop it")
        return None

    def ask_reply(self) -> None:
        """Ask the engine to answer the chat as it stands, with the settings that stand now."""
        self.session.submit(ReplyRequest(self.prompt(), self.settings))
        self.state = "writing…"

    def stop_reply(self) -> None:
        """Stop the reply being written (the part written is kept when it ends)."""
        self.session.stop_reply()
        self.state = "stopping…"

    def reply_ended(self, text: str, stopped_by: str) -> tuple[str, Notice | None]:
        """A reply ended (finished, stopped or failed): a partial one is kept too, as it is part
        of what the model saw and said. Returns its text as kept and what to say about saving."""
        # The engine thread publishes its last snapshot before posting the message that ends a reply.
        self.context_tokens = self.session.metrics.context_tokens if text else None
        self.state = "ready" if self.ready else self.state  # (another model may be loading)
        if not text:
            return text, None
        message, notice = self.save(ChatMessage("assistant", text, stopped_by))
        return message.content, notice

    def count_context(self) -> None:
        """Once the model is loaded, ask the engine for the size of a chat whose context is not
        known (one reopened); `context_counted` takes the answer."""
        if self.ready and self.chat_id is not None and self.context_tokens is None:
            self.session.count_context(self.chat_id, self.prompt())

    def context_counted(self, chat_id: int, tokens: int, writing: bool) -> None:
        """The engine counted chat `chat_id`'s context: the status line's next refresh shows it."""
        if self.chat_id == chat_id and not writing:  # else a reply's own count is coming
            self.context_tokens = tokens

    def shown_context(self, metrics: LiveMetrics, writing: bool) -> int | None:
        """The context size: while a reply is written, the engine's count as it goes, unknown
        (None) until its first step (a regenerate's prefill, right after a load, showed "context 0
        tokens" for a long moment); otherwise the chat's last count."""
        if not writing:
            return self.context_tokens
        return metrics.context_tokens or None

    def allows(self, action: str, parameters: tuple[object, ...], writing: bool) -> bool | None:
        """The chat screen's `check_action`: True, False (hidden) or None (shown dimmed)."""
        if action in ("next_k", "next_mode", "pick_k") and not self.ready:
            return False  # nothing to switch before the model is loaded
        if action == "pick_k":
            return parameters[0] in self.k_choices()  # only the K this model offers
        if action == "stop_reply":
            return True if writing else None  # dimmed when idle: the keys panel still lists Esc
        if action == "regenerate":  # the last message is a finished reply
            return self.ready and not writing and self.last_is_reply
        if action in ("new_chat", "open_chat"):
            return None if writing else True  # dimmed while a reply is written
        return True

    # -- the engine's state ------------------------------------------------------------------------

    def offer(self, event: EngineReady) -> None:
        """A model loaded: what it offers (K profiles, modes) and its figures. `ready` waits for
        `engine_ready`, once the selector shows the choices."""
        self.profiles, self.modes = event.profiles, offered_modes(event)
        self.engine_info = event.info  # the palette's "BLAS" entry shows its BLAS and kernels
        self.wired_limit_bytes = event.info.get("wired_limit_bytes")

    def engine_ready(self, event: EngineReady) -> Outcome:
        """The model is loaded and its choices shown: chatting can start, once told what to know
        before (`event.notices`)."""
        self.ready, self.model_name, self.state = True, event.model_name, "ready"
        notices = tuple(Notice(n, "warning", timeout=STARTUP_NOTICE_S) for n in event.notices)
        return Outcome(notices=notices, loading=False)

    def use(self, kept: ModelPreferences) -> None:
        """Another model opened in place of the one before: its kept settings take over, and the
        chat's context is counted again, through this model's template."""
        self.settings, self.system_prompt = kept.generation, kept.system_prompt
        self.context_tokens = None

    def loading(self, what: str) -> Outcome:
        """Another model is loading: as at start-up, nothing is sent until it is ready."""
        self.ready, self.state = False, what
        self.pending_k = self.pending_mode = None  # asked of the model before
        return Outcome(loading=True, changed=True)

    def refused(self, error: str, reloading: bool) -> Outcome:
        """The model asked for cannot be opened. Unless the one before is loading again (its
        EngineReady follows), that one never closed: ready as it was."""
        notice = Notice(error, "error", title="cannot open the model", timeout=15)
        if reloading:
            return Outcome(notices=(notice,))
        self.ready, self.state = True, "ready"
        return Outcome(notices=(notice,), loading=False, changed=True)

    def load_failed(self, error: str) -> Outcome:
        """The model could not be loaded: `error` says why, in one line."""
        self.state = "no model"
        notice = Notice(error, "error", title="cannot load the model", timeout=30)
        return Outcome(notices=(notice,), loading=False, changed=True)

    def engine_thread_died(self, error: BaseException) -> Outcome:
        """The engine thread ended on an error that is not an Edge0Error (those arrive as
        messages): a bug, or a library's error edge0 did not translate. Before the model loaded,
        that is the news, with the real reason in one line, not "engine stopped"."""
        if not self.ready:
            return self.load_failed(error_line(error))
        return self.engine_stopped(error)

    def engine_stopped(self, error: BaseException) -> Outcome:
        """A bug (not an Edge0Error) ended the engine thread after the model loaded."""
        self.ready, self.state = False, "engine stopped"
        return Outcome(notices=(Notice(f"the engine stopped on a bug: {error!r}", "error"),))

    def settings_shown(self, kept: ModelPreferences | None) -> ModelPreferences:
        """What the settings dialog opens on: the choices kept for this model (`kept`), with the
        sampling and system prompt in use."""
        current = kept if kept is not None else ModelPreferences()
        return replace(current, generation=self.settings, system_prompt=self.system_prompt)

    def keep_settings(self, chosen: ModelPreferences, before: ModelPreferences) -> Outcome:
        """The settings dialog's choices, kept for this model: the next reply's sampling and
        system prompt, and a page-cache budget changed from `before`, asked of the engine now."""
        self.settings, self.system_prompt = chosen.generation, chosen.system_prompt
        notices = []
        if chosen.page_cache is not None and chosen.page_cache != before.page_cache:
            refused = self.set_page_cache(chosen.page_cache)
            notices += [refused] if refused is not None else []
        kept = {
            "generation": chosen.generation,
            "system_prompt": chosen.system_prompt,
            "expert_cache_bytes": chosen.expert_cache_bytes,
            "page_cache": chosen.page_cache,
        }
        g = chosen.generation
        said = f"temperature {g.temperature}, top-p {g.top_p}, max tokens {g.max_tokens}"
        notices.append(Notice(said, title="settings saved"))
        return Outcome(kept=kept, notices=tuple(notices))

    def set_page_cache(self, page_cache: int | str) -> Notice | None:
        """Ask the engine for another page-cache budget ("off": none); a notice when refused."""
        try:
            self.session.request_page_cache(None if page_cache == "off" else page_cache)
        except Edge0Error as e:
            return Notice(str(e), "error", title="page-cache budget")
        return None

    # -- routing width and mode --------------------------------------------------------------------

    def k_choices(self) -> list[int]:
        """The K the mode that will run can use: those with prerouter heads in a head mode."""
        mode = self.pending_mode or self.session.metrics.mode
        return [p.k for p in self.profiles if p.prerouter or mode not in HEAD_MODES]

    def next_k(self) -> int | None:
        """The next K after the one asked for, among those the mode that will run can use."""
        choices = self.k_choices()
        if not choices:
            return None
        return next_choice(choices, self.pending_k or self.session.metrics.k)

    def next_mode(self) -> tuple[str | None, Notice | None]:
        """The mode to switch to next, or None and why there is none. The streaming modes only:
        resident reloads the model and is chosen on its own (selector, palette), never by
        cycling past it."""
        modes = [m for m in self.modes if m != "resident"]
        running = self.session.metrics.mode
        if running == "resident":
            return "on-demand", None
        if len(modes) > 1:
            return next_choice(modes, self.pending_mode or running), None
        if modes:
            other = "prerouter" if modes[0] == "on-demand" else "on-demand"
            why = f"{modes[0]} is the only mode offered here: {mode_unavailable(other)}"
            return None, Notice(why)
        return None, None

    def choose_k(self, k: int) -> Outcome:
        """Ask for routing width `k`, mid-reply too: the engine applies it before its next step."""
        try:
            profile = self.session.request_k(k)
        except Edge0Error as e:  # the selector goes back to what stands
            stands = self.pending_k or self.session.metrics.k
            return Outcome(k=stands, notices=(Notice(str(e), "error"),))
        self.pending_k = None if k == self.session.metrics.k else k
        notices = ()
        if not profile.recovered:
            why = (
                "prerouter heads but no recovery LoRA for it"
                if profile.prerouter and not profile.lora
                else "no trained adapter for it, so the model's own router is narrowed or widened"
            )
            notices = (Notice(f"quality not recovered at K={k}: {why}", "warning"),)
        return Outcome(k=k, kept={"k": k}, notices=notices, changed=True)

    def reloads_for(self, mode: str) -> bool:
        """Switching to `mode` loads the model again: resident <-> streaming."""
        running = self.session.metrics.mode
        return "resident" in (mode, running) and mode != running

    def choose_mode(self, mode: str) -> Outcome:
        """Ask for streaming mode `mode` (one `reloads_for` says no to), applied before the
        engine's next step; a mode with heads may bring another K."""
        try:
            profile = self.session.request_mode(mode)
        except Edge0Error as e:  # the selector goes back to what stands
            stands = self.pending_mode or self.session.metrics.mode
            return Outcome(mode=stands, notices=(Notice(str(e), "error"),))
        self.pending_mode = None if mode == self.session.metrics.mode else mode
        small = mode == "prefetch" and self.engine_info.get("prefetch_reads_ahead") is False
        notices = (PREFETCH_READS_NOTHING,) if small else ()
        return Outcome(
            mode=mode, kept={"mode": mode, "k": profile.k}, notices=notices, changed=True
        )

    def expert_bytes(self) -> int:
        """What going resident reads into memory: every expert of the model loaded."""
        engine = self.session.engine
        return engine.loaded.index.expert_nbytes if engine is not None else 0

    def reload_refusal(self) -> str | None:
        """Why the model cannot be loaded again now (running as ranks), None when it can."""
        return self.session.reload_refusal()

    def reload(self, mode: str, writing: bool, agreed: bool = True) -> Outcome:
        """Load the model again in `mode` (resident <-> streaming): nothing is sent until it is
        ready. Not while a reply is written (`writing`), nor when the user did not agree to it
        (`agreed`): the mode running stays."""
        if writing or not agreed:
            notices = (WAIT_FOR_THE_REPLY,) if writing else ()
            return Outcome(mode=self.session.metrics.mode, notices=notices)
        if refusal := self.reload_refusal():
            notice = Notice(refusal, "warning", title="cannot load the model again")
            return Outcome(mode=self.session.metrics.mode, notices=(notice,))
        self.ready = False
        self.state = f"loading the model {mode}…"
        self.session.reload(mode)
        return Outcome(kept={"mode": mode}, changed=True)

    def switch_failed(self, error: str) -> Outcome:
        """The engine could not apply a switch: none is pending, and the selector shows the K and
        mode that still stand."""
        metrics = self.session.metrics
        self.pending_k = self.pending_mode = None
        notice = Notice(error, "error", title="cannot switch")
        return Outcome(k=metrics.k, mode=metrics.mode, notices=(notice,), changed=True)

    def settle(self, metrics: LiveMetrics) -> bool:
        """Forget the switches `metrics` shows applied. True when a mode switch just applied: it
        may bring its own K (prerouter mode needs a K with trained heads) for the selector."""
        if self.pending_k == metrics.k:
            self.pending_k = None
        if self.pending_mode is not None and self.pending_mode == metrics.mode:
            self.pending_mode = None
            return True
        return False

    def panels_due(self, metrics: LiveMetrics, writing: bool, now: float | None = None) -> bool:
        """Whether the panels' timer should draw them now: always while a reply is written or
        the engine published something new; idle, once every `IDLE_PANELS_S` (only the
        machine's memory moves then, and reading and drawing it six times a second kept an idle
        app busy)."""
        now = time.monotonic() if now is None else now
        idle = not writing and metrics is self._panels_metrics and self.pending_k is None
        if idle and self.pending_mode is None and now - self._panels_at < IDLE_PANELS_S:
            return False
        self._panels_metrics, self._panels_at = metrics, now
        return True


# Said when prefetch is chosen on a model whose experts are too small for a read ahead to pay:
# the panels then show nothing read ahead, by design, not broken.
PREFETCH_READS_NOTHING = Notice(
    "prefetch reads nothing ahead on this model: its experts are under 1 MiB, cheaper read when "
    "needed"
)


def offered_modes(event: EngineReady) -> list[str]:
    """The modes the selector offers: the engine's own, and the others it reloads into
    (resident from a streaming mode; the streaming modes from resident)."""
    if event.modes == ["resident"]:
        has_heads = any(p.prerouter for p in event.profiles)
        return ["resident", "on-demand", *(HEAD_MODES if has_heads else ()), "prefetch"]
    return [*event.modes, "resident"]


def mode_unavailable(mode: str) -> str:
    """Why `mode` is not offered by the running engine, and what to do about it."""
    if mode in HEAD_MODES:
        return (
            f"{mode} mode needs prerouter heads for this model: train them with "
            "`edge0 train heads MODEL --k K`, or pass `--adapters DIR|REPO_ID`"
        )
    return f"{mode} mode is not available while the model runs resident: restart without --mode"


def next_choice(choices: list, current: object) -> object:
    """The choice after `current`, wrapping round (the first one when `current` is not offered)."""
    if current not in choices:
        return choices[0]
    return choices[(choices.index(current) + 1) % len(choices)]
