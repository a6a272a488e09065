"""The chat screen: the conversation, the prompt, the live panels and the status line.

It owns one conversation at a time (its saved id and messages) and the engine's thread worker. The
engine thread posts messages here (`edge0_tui.messages`); the panels are refreshed by one timer that
reads the engine's latest metrics snapshot.
"""

from __future__ import annotations

import sqlite3
from dataclasses import replace

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.notifications import SeverityLevel
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import Footer, Header
from textual.worker import Worker, WorkerState, get_current_worker

from engine import HEAD_MODES, Edge0Error, GenerationConfig

from ..chat_store import ChatHandle, ChatMessage, ChatStore, chat_title
from ..engine_session import EngineSession, ReplyRequest
from ..last_session import LastSession
from ..live_metrics import LiveMetrics
from ..messages import (
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
from ..model_source import DEMO
from ..preferences import ModelPreferences
from ..sanitize import error_line
from ..system_memory import SystemMemory, read_system_memory
from ..widgets.conversation import AssistantTurn, Conversation
from ..widgets.first_steps import DEMO_PROMPTS, FirstSteps
from ..widgets.memory_bar import MemoryBreakdown
from ..widgets.metrics_panel import MetricsPanel
from ..widgets.prompt import PromptInput
from ..widgets.routing_selector import (
    RoutingSelector,
    mode_unavailable,
    next_choice,
    offered_modes,
)
from ..widgets.status_line import Status, StatusLine
from ..widgets.wall_strip import WallStrip
from .chat_list import ChatListScreen
from .confirm import ConfirmScreen, resident_question
from .model_loading import ModelLoadingScreen
from .settings import SettingsScreen

# How often the panels read the engine's metrics snapshot (4-10 Hz reads as live).
PANEL_REFRESH_HZ = 6
# How long the notices shown once the model is loaded stay: toasts sit over the side panel's
# K and mode selectors, so not for long (the demo's notice is one sentence).
STARTUP_NOTICE_S = 8
# The switch keys, the heat view and Quit, listed before every other key in the footer and the
# keys panel (F1): at 80 columns the footer cuts what comes after.
SWITCH_BINDING_IDS = ("chat.next_k", "chat.next_mode", "chat.panels", "app.heat", "app.quit")


class ChatScreen(Screen):
    # Below 110 columns the side panel narrows, so an 80-column terminal still has room to chat.
    # Below 100 columns or 30 rows the side panels do not fit beside a readable chat: the compact
    # layout shows the wall in one line above the prompt, and F6 swaps the chat for the panels.
    # From 150 columns the side panel takes a share of the width (app.tcss, -widest).
    HORIZONTAL_BREAKPOINTS = [(0, "-cramped"), (100, "-narrow"), (110, "-wide"), (150, "-widest")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (30, "-tall")]
    BINDINGS = [
        # F4/F5 work while typing (the prompt consumes letters and digits); k, m and 2/4/8 work
        # when the prompt does not have the focus (Tab or a click away from it). Textual leaves
        # keys the focused prompt would type out of the footer and keys panel by itself.
        Binding("f4,k", "next_k", "Next K", id="chat.next_k"),
        Binding("f5,m", "next_mode", "Next mode", id="chat.next_mode"),
        Binding("2", "pick_k(2)", "K=2", show=False),
        Binding("4", "pick_k(4)", "K=4", show=False),
        Binding("8", "pick_k(8)", "K=8", show=False),
        Binding("escape", "stop_reply", "Stop reply", id="chat.stop"),
        Binding("ctrl+n", "new_chat", "New chat", id="chat.new"),
        Binding("ctrl+o", "open_chat", "Chats", id="chat.open"),
        Binding("f2", "settings", "Settings", id="chat.settings"),
        Binding("f3", "copy_reply", "Copy reply", id="chat.copy"),
        Binding("ctrl+r", "regenerate", "Regenerate", id="chat.regenerate"),
        # priority: the prompt (a TextArea) binds F6 to "select line".
        Binding("f6", "toggle_panels", "Panels", id="chat.panels", priority=True),
    ]

    def __init__(self, session: EngineSession, store: ChatStore, settings: GenerationConfig):
        super().__init__()
        self.session = session
        self.store = store
        self.settings = settings
        self.system_prompt = ""  # from the model's preferences once mounted; "" sends none
        self.wired_limit_bytes: int | None = None  # Metal's, from the engine once loaded
        self.engine_info: dict = {}  # Engine.info() once loaded (the palette shows its BLAS)
        self.chat: ChatHandle | None = None  # None until the chat's first message
        self.messages: list[ChatMessage] = []
        self.reply: AssistantTurn | None = None  # the reply being written, if any
        # Tokens the engine saw for this chat's latest reply (prompt and reply); None when unknown
        # (a reopened chat, until its next reply). The engine re-reads the whole chat every reply.
        self.context_tokens: int | None = 0
        self.model_name = session.model
        self.state = "loading model…"
        self.ready = False
        # K or mode asked for and not yet applied by the engine (it applies them before its next step).
        self.pending_k: int | None = None
        self.pending_mode: str | None = None
        self.panel_timer: Timer | None = None
        # The chat and unsent text to start on (the app's `reopen`); None: a new chat.
        self.reopen: LastSession | None = None

    def compose(self) -> ComposeResult:
        self.prompt_input = PromptInput(id="prompt")
        yield Header()
        with Horizontal(id="main"):
            with Vertical(id="chat"):
                yield FirstSteps(id="first-steps")
                yield Conversation(id="conversation")
                yield WallStrip(id="wall-strip")
                yield self.prompt_input
            with Vertical(id="side"):
                yield MetricsPanel(id="metrics")
                yield RoutingSelector(id="routing")
        yield StatusLine(id="status")
        yield Footer()

    @property
    def active_bindings(self):
        # Textual lists the focused widget's keys first (the prompt's Send, New line): the K and
        # mode keys, the reason to have this app, come before them in the footer and F1 panel.
        bindings = super().active_bindings
        first = sorted(
            (SWITCH_BINDING_IDS.index(active.binding.id), key)
            for key, active in bindings.items()
            if active.binding.id in SWITCH_BINDING_IDS
        )
        return {**{key: bindings[key] for _, key in first}, **bindings}

    def notify(
        self,
        message: str,
        *,
        title: str = "",
        severity: SeverityLevel = "information",
        timeout: float | None = None,
        markup: bool = False,
    ) -> None:
        # Plain text, never markup: what this screen reports quotes paths, model names and errors,
        # and a `[/x]` in one of them would otherwise stop the app (Textual's MarkupError).
        super().notify(message, title=title, severity=severity, timeout=timeout, markup=markup)

    def on_mount(self) -> None:
        self.sub_title = "new chat"
        self.app.push_screen(ModelLoadingScreen())
        self.run_engine()
        self.panel_timer = self.set_interval(1 / PANEL_REFRESH_HZ, self.refresh_panels)
        self.query_one(PromptInput).focus()
        self.refresh_panels()
        self.show_first_steps()
        if self.reopen is not None:
            self.call_later(self._reopen, self.reopen)

    async def _reopen(self, last: LastSession) -> None:
        """The chat shown at the last quit, with its unsent text back in the prompt. A chat
        deleted since (another edge0) leaves a new chat, the text still kept."""
        if last.draft:
            self.prompt_input.give_back(last.draft)
        if last.chat_id is not None and self._exists(last.chat_id):
            await self.open_chat(last.chat_id)

    def _exists(self, chat_id: int) -> bool:
        try:
            return any(c.id == chat_id for c in self.store.chats())
        except sqlite3.Error:
            return False

    def show_first_steps(self) -> None:
        """The empty chat's hints (for the demo, what it is and prompts to try); hidden once the
        chat has a message."""
        steps = self.query_one(FirstSteps)
        steps.display = not self.messages
        if steps.display:
            steps.show_for(self.model_name == DEMO)

    def action_suggest(self, index: int) -> None:
        """Put suggested prompt `index` in the message box (from a click on it, or the palette)."""
        prompt = self.prompt_input
        prompt.text = DEMO_PROMPTS[index % len(DEMO_PROMPTS)]
        prompt.move_cursor(prompt.document.end)
        prompt.focus()

    def session_to_keep(self) -> LastSession:
        """What the next start reopens: this chat and the prompt's unsent text."""
        # The widget, not a query: at the app's unmount the screen's children are already gone.
        return LastSession(self.chat_id, self.prompt_input.text)

    # -- the engine thread -------------------------------------------------------------------------

    @work(thread=True, exclusive=True, group="engine", exit_on_error=False, name="engine")
    def run_engine(self) -> None:
        """The engine's one thread, for the whole session (see EngineSession)."""
        worker = get_current_worker()
        self.session.serve(self.post_message, lambda: worker.is_cancelled)

    async def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.worker.name != "engine" or event.state != WorkerState.ERROR:
            return
        # Not an Edge0Error (those arrive as messages): a bug, or a library's error edge0 did not
        # translate. Say so in one line, keep the conversation, and end the reply it interrupted.
        if not self.ready:
            # The model never loaded: that is the news, with the real reason, not "engine stopped".
            self._load_failed(error_line(event.worker.error))
            return
        self.ready = False
        self.notify(f"the engine stopped on a bug: {event.worker.error!r}", severity="error")
        if self.reply is not None:
            await self._end_reply(self.reply.text, "error")
        self.state = "engine stopped"

    def on_model_progress(self, event: ModelProgress) -> None:
        self.state = event.what
        if isinstance(self.app.screen, ModelLoadingScreen):
            self.app.screen.report(event.what, event.done, event.total)

    async def on_engine_ready(self, event: EngineReady) -> None:
        info = event.info
        self.wired_limit_bytes = info.get("wired_limit_bytes")
        self.engine_info = info  # the palette's "BLAS" entry shows its BLAS and prefill kernels
        await self.query_one(RoutingSelector).set_choices(
            event.profiles,
            offered_modes(event),
            info["k"],
            info["mode"],
            info.get("profile_quality"),
        )
        if self.app.opening is not None:  # opened in place of the model before: its settings
            note, kept = self.app.model_opened(self.session.model)
            self.settings, self.system_prompt = kept.generation, kept.system_prompt
            self.context_tokens = None  # counted again below, through this model's template
            await self.query_one(Conversation).add_note(note)
        # Only now: the panel timer shows the selector's state once `ready`.
        self.ready = True
        self.model_name = event.model_name
        self.show_first_steps()  # the demo's own hints, now that the model is known
        self.state = "ready"
        self._dismiss_loading()
        for notice in event.notices:
            self.notify(notice, severity="warning", timeout=STARTUP_NOTICE_S)
        self.app.apply_kept_choices(event)
        self.refresh_bindings()  # F4/F5 are offered again (hidden while the model (re)loaded)
        if self.chat is not None and self.chat.id is not None and self.context_tokens is None:
            self.session.count_context(self.chat.id, self._prompt())  # a chat reopened at start
        self.refresh_panels()

    def loading(self, what: str) -> None:
        """Another model is loading: as at start-up, nothing is sent until it is ready."""
        self.ready, self.state = False, what
        self.pending_k = self.pending_mode = None  # asked of the model before
        self.app.push_screen(ModelLoadingScreen())
        self.refresh_bindings()
        self.refresh_panels()

    def on_model_refused(self, event: ModelRefused) -> None:
        self.app.opening = None
        self.notify(event.error, title="cannot open the model", severity="error", timeout=15)
        if not event.reloading:  # never closed: ready as it was (else its EngineReady follows)
            self.ready, self.state = True, "ready"
            self._dismiss_loading()
            self.refresh_bindings()

    def on_engine_failed(self, event: EngineFailed) -> None:
        self._load_failed(event.error)

    def _load_failed(self, error: str) -> None:
        self._dismiss_loading()
        self.state = "no model"
        self.notify(error, title="cannot load the model", severity="error", timeout=30)
        self.refresh_panels()

    def _dismiss_loading(self) -> None:
        if isinstance(self.app.screen, ModelLoadingScreen):
            self.app.pop_screen()

    # -- a reply -----------------------------------------------------------------------------------

    async def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        if not await self.send(event.text):
            event.prompt.give_back(event.text)

    async def send(self, text: str) -> bool:
        """Start a reply to `text`; False (and a notification) when one cannot start now."""
        if not self.ready:
            self.notify(f"cannot send: {self.state}", severity="warning")
            return False
        if self.reply is not None:
            self.notify("a reply is being written: wait, or press Escape to stop it")
            return False
        message = self._save(ChatMessage("user", text))
        conversation = self.query_one(Conversation)
        await conversation.add_user_turn(message.content)
        self.reply = await conversation.add_reply()
        self.session.submit(ReplyRequest(self._prompt(), self.settings))
        self.state = "writing…"
        self.refresh_bindings()
        return True

    async def on_reply_text(self, event: ReplyText) -> None:
        if self.reply is not None:
            await self.reply.append(event.text)

    async def on_reply_finished(self, event: ReplyFinished) -> None:
        await self._end_reply(event.text, event.stopped_by, event.nonfinite_repaired)

    async def on_reply_failed(self, event: ReplyFailed) -> None:
        self.notify(event.error, title="the reply stopped", severity="error", timeout=15)
        await self._end_reply(event.text, "error", event.nonfinite_repaired)

    async def _end_reply(self, text: str, stopped_by: str, nonfinite_repaired: int = 0) -> None:
        reply, self.reply = self.reply, None
        if reply is None:
            return
        # The engine thread publishes its last snapshot before posting the message that ends a reply.
        self.context_tokens = self.session.metrics.context_tokens if text else None
        self.state = "ready" if self.ready else self.state  # (another model may be loading)
        if text:  # a partial reply is kept: it is part of what the model saw and said
            text = self._save(ChatMessage("assistant", text, stopped_by)).content
        self.refresh_bindings()
        await reply.finish(text, stopped_by, nonfinite_repaired)

    def _save(self, message: ChatMessage) -> ChatMessage:
        """Add a message to the conversation and the database (creating the chat on its first).
        Returns the message as kept: cleaned of terminal control sequences."""
        message = message.cleaned()
        self.messages.append(message)
        self.show_first_steps()
        if self.chat is None:
            self.chat = ChatHandle(chat_title(message.content), self.model_name)
            self.sub_title = self.chat.title
        were_waiting = self.store.unsaved
        try:
            saved = self.store.save(self.chat, message)
        except sqlite3.Error as e:  # not a lock: this message cannot be written at all
            self.notify(f"could not save the message: {e}", severity="error")
            return message
        if not saved:
            self.notify(
                f"saving is pending: the chat database is busy ({self.store.last_error}). "
                f"{self.store.unsaved} message(s) are kept in memory and saved once it is free.",
                severity="warning",
                timeout=10,
            )
        elif were_waiting:
            self.notify(f"saved the {were_waiting} message(s) that were waiting")
        return message

    @property
    def chat_id(self) -> int | None:
        """The shown chat's id in the database; None for a new chat, or one not written yet."""
        return self.chat.id if self.chat is not None else None

    # -- actions -----------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in ("next_k", "next_mode", "pick_k") and not self.ready:
            return False  # nothing to switch before the model is loaded
        if action == "pick_k":
            return parameters[0] in self.k_choices()  # only the K this model offers
        if action == "stop_reply":
            return self.reply is not None  # only shown while a reply is written
        if action == "regenerate":  # the last message is a finished reply
            last_is_reply = bool(self.messages) and self.messages[-1].role == "assistant"
            return self.ready and self.reply is None and last_is_reply
        if action in ("new_chat", "open_chat"):
            return None if self.reply is not None else True  # dimmed while a reply is written
        return True

    def action_stop_reply(self) -> None:
        if self.reply is not None:
            self.session.stop_reply()
            self.state = "stopping…"

    async def action_new_chat(self) -> None:
        if self._refuse_while_writing():
            return
        self.chat, self.messages, self.context_tokens = None, [], 0
        self.sub_title = "new chat"
        self.show_first_steps()
        await self.query_one(Conversation).show([])
        self.query_one(PromptInput).focus()

    def action_open_chat(self) -> None:
        if self._refuse_while_writing():
            return

        async def closed(chat_id: int | None) -> None:
            if chat_id is not None:
                await self.open_chat(chat_id)
            elif self.chat is not None and self.chat.id is not None and not self._still_saved():
                await self.action_new_chat()  # the open chat was deleted in the list

        self.app.push_screen(ChatListScreen(self.store), closed)

    def _still_saved(self) -> bool:
        try:
            return any(c.id == self.chat.id for c in self.store.chats())
        except sqlite3.Error:
            return True  # cannot tell: keep the chat on screen

    async def open_chat(self, chat_id: int) -> None:
        """Show a saved chat and continue it."""
        try:
            messages = self.store.messages(chat_id)
        except sqlite3.Error as e:
            self.notify(f"cannot read the chat: {e}", severity="error")
            return
        self.messages, self.context_tokens = messages, None
        first_user = next((m.content for m in self.messages if m.role == "user"), "")
        self.chat = ChatHandle(chat_title(first_user), self.model_name, chat_id)
        self.sub_title = self.chat.title
        self.show_first_steps()
        await self.query_one(Conversation).show(self.messages)
        self.query_one(PromptInput).focus()
        # The footer's bindings depend on the messages (Regenerate: the last is a finished
        # reply); focus staying on the prompt would not refresh them.
        self.refresh_bindings()
        if self.ready:  # the status line shows it once the engine has counted
            self.session.count_context(chat_id, self._prompt())

    def on_context_counted(self, event: ContextCounted) -> None:
        if self.chat is not None and self.chat.id == event.chat_id and self.reply is None:
            self.context_tokens = event.tokens  # the panel timer's next tick shows it

    def _prompt(self) -> list[dict]:
        """What the engine is sent: the system prompt, then the chat's messages."""
        prompt = [m.as_prompt() for m in self.messages]
        if self.system_prompt:
            prompt.insert(0, {"role": "system", "content": self.system_prompt})
        return prompt

    def action_settings(self) -> None:
        kept = self.app.preferences
        current = kept.current if kept is not None else ModelPreferences()
        current = replace(current, generation=self.settings, system_prompt=self.system_prompt)

        def saved(chosen: ModelPreferences | None) -> None:
            if chosen is None:
                return
            self.settings, self.system_prompt = chosen.generation, chosen.system_prompt
            if chosen.page_cache is not None and chosen.page_cache != current.page_cache:
                self._set_page_cache(chosen.page_cache)
            self.app.remember(
                generation=chosen.generation,
                system_prompt=chosen.system_prompt,
                expert_cache_bytes=chosen.expert_cache_bytes,
                page_cache=chosen.page_cache,
            )
            settings = chosen.generation
            self.notify(
                f"temperature {settings.temperature}, top-p {settings.top_p}, "
                f"max tokens {settings.max_tokens}",
                title="settings saved",
            )

        running = self.session.engine_config
        self.app.push_screen(
            SettingsScreen(current, running.expert_cache_bytes, running.page_cache_bytes), saved
        )

    def _set_page_cache(self, page_cache: int | str) -> None:
        try:
            self.session.request_page_cache(None if page_cache == "off" else page_cache)
        except Edge0Error as e:
            self.notify(str(e), title="page-cache budget", severity="error")

    @property
    def compact(self) -> bool:
        """True in the compact layout (a terminal under 100 columns or 30 rows)."""
        return self.has_class("-cramped") or self.has_class("-short")

    def action_toggle_panels(self) -> None:
        """Compact layout: the full panels in place of the chat, and back. Elsewhere the panels
        are always beside the chat, and this says so."""
        if not self.compact:
            self.notify("the panels are on the right; F6 swaps them with the chat when small")
            return
        self.toggle_class("-panels")
        if not self.has_class("-panels"):
            self.query_one(PromptInput).focus()

    async def action_regenerate(self) -> None:
        """Write the last reply again (with the settings, K and mode that stand now)."""
        if self.reply is not None or not self.messages or self.messages[-1].role != "assistant":
            return
        try:
            self.store.drop_last_reply(self.chat)
        except sqlite3.Error as e:  # locked past the busy timeout: keep the reply as it is
            self.notify(f"cannot replace the reply now: {e}", severity="error")
            return
        self.messages.pop()
        conversation = self.query_one(Conversation)
        await conversation.drop_last_reply()
        self.reply = await conversation.add_reply()
        self.session.submit(ReplyRequest(self._prompt(), self.settings))
        self.state = "writing…"
        self.refresh_bindings()

    def action_copy_reply(self) -> None:
        replies = [m.content for m in self.messages if m.role == "assistant"]
        if not replies:
            self.notify("no reply to copy yet", severity="warning")
            return
        self.app.copy_to_clipboard(replies[-1])
        self.notify("copied the last reply to the clipboard")

    def _refuse_while_writing(self) -> bool:
        if self.reply is not None:
            self.notify(
                "a reply is being written: press Escape to stop it first", severity="warning"
            )
        return self.reply is not None

    # -- routing width and mode --------------------------------------------------------------------

    @on(RoutingSelector.KChosen)
    def k_chosen(self, event: RoutingSelector.KChosen) -> None:
        self.choose_k(event.k)

    @on(RoutingSelector.ModeChosen)
    def mode_chosen(self, event: RoutingSelector.ModeChosen) -> None:
        self.choose_mode(event.mode)

    def action_next_k(self) -> None:
        """The next K after the one asked for, among those the mode that will run can use."""
        choices = self.k_choices()
        if choices:
            self.choose_k(next_choice(choices, self.pending_k or self.session.metrics.k))

    def action_pick_k(self, k: int) -> None:
        self.choose_k(k)

    def action_next_mode(self) -> None:
        # The streaming modes: resident reloads the model and is chosen on its own (selector,
        # palette), never by cycling past it.
        modes = [m for m in self.query_one(RoutingSelector).modes if m != "resident"]
        if self.session.metrics.mode == "resident":
            self.choose_mode("on-demand")
        elif len(modes) > 1:
            self.choose_mode(next_choice(modes, self.pending_mode or self.session.metrics.mode))
        elif modes:
            other = "prerouter" if modes[0] == "on-demand" else "on-demand"
            self.notify(f"{modes[0]} is the only mode offered here: {mode_unavailable(other)}")

    def _reload_in(self, mode: str) -> None:
        """Resident <-> streaming: the model is loaded again. Going resident reads every expert
        into memory, so it asks first, with what that needs and what the machine has free."""
        selector = self.query_one(RoutingSelector)
        if self.reply is not None:
            self.notify("wait for the reply to end (or press Escape) before reloading the model")
            selector.select(mode=self.session.metrics.mode)
            return
        if mode != "resident":
            self._start_reload(mode)
            return
        engine = self.session.engine
        needs = engine.loaded.index.expert_nbytes if engine is not None else 0
        question = resident_question(needs, read_system_memory())

        def answered(yes: bool | None) -> None:
            if yes:
                self._start_reload("resident")
            else:
                selector.select(mode=self.session.metrics.mode)

        self.app.push_screen(ConfirmScreen("Load every expert?", question, "Load"), answered)

    def _start_reload(self, mode: str) -> None:
        self.ready = False
        self.state = f"loading the model {mode}…"
        self.session.reload(mode)
        self.app.remember(mode=mode)
        self.refresh_bindings()
        self.refresh_panels()

    def k_choices(self) -> list[int]:
        """The K the mode that will run can use: those with prerouter heads in a head mode."""
        mode = self.pending_mode or self.session.metrics.mode
        profiles = self.query_one(RoutingSelector).profiles
        return [p.k for p in profiles if p.prerouter or mode not in HEAD_MODES]

    @on(QualityKept)
    def quality_kept(self, event: QualityKept) -> None:
        """An eval run beside the app: the K selector's labels show its figures now."""
        self.query_one(RoutingSelector).set_quality(event.quality)

    @on(SwitchFailed)
    def switch_failed(self, event: SwitchFailed) -> None:
        self.notify(event.error, title="cannot switch", severity="error")
        metrics = self.session.metrics  # the K and mode that still stand
        self.pending_k = self.pending_mode = None
        self.query_one(RoutingSelector).select(k=metrics.k, mode=metrics.mode)
        self.refresh_panels()

    def choose_k(self, k: int, remember: bool = True) -> None:
        """Switch routing width, mid-reply too: the engine applies it before its next step."""
        selector = self.query_one(RoutingSelector)
        try:
            profile = self.session.request_k(k)
        except Edge0Error as e:
            self.notify(str(e), severity="error")
            selector.select(k=self.pending_k or self.session.metrics.k)  # back to what stands
            return
        selector.select(k=k)  # when chosen from the palette
        self.pending_k = None if k == self.session.metrics.k else k
        if remember:
            self.app.remember(k=k)
        if not profile.recovered:
            why = (
                "prerouter heads but no recovery LoRA for it"
                if profile.prerouter and not profile.lora
                else "no trained adapter for it, so the model's own router is narrowed or widened"
            )
            self.notify(f"quality not recovered at K={k}: {why}", severity="warning")
        self.refresh_panels()

    def choose_mode(self, mode: str, remember: bool = True) -> None:
        selector = self.query_one(RoutingSelector)
        if "resident" in (mode, self.session.metrics.mode) and mode != self.session.metrics.mode:
            self._reload_in(mode)
            return
        try:
            profile = self.session.request_mode(mode)
        except Edge0Error as e:
            self.notify(str(e), severity="error")
            selector.select(mode=self.pending_mode or self.session.metrics.mode)
            return
        selector.select(mode=mode)
        self.pending_mode = None if mode == self.session.metrics.mode else mode
        if remember:
            self.app.remember(mode=mode, k=profile.k)
        self.refresh_panels()

    # -- the panels --------------------------------------------------------------------------------

    def refresh_panels(self) -> None:
        """The one timer's callback: read the engine's latest snapshot and show it."""
        engine = self.session.engine  # its plan follows K (a K switch plans its expert cache)
        plan = engine.memory_plan.line() if self.ready and engine is not None else ""
        self.show_panels(self.session.metrics, read_system_memory(), plan)

    def show_panels(self, metrics: LiveMetrics, memory: SystemMemory, plan: str = "") -> None:
        """`plan`: the memory plan's line, as `generate` and `serve` print it at start."""
        if self.pending_k == metrics.k:
            self.pending_k = None
        if self.pending_mode is not None and self.pending_mode == metrics.mode:
            self.pending_mode = None
            # A mode switch may bring its own K (prerouter mode needs a K with trained heads).
            self.query_one(RoutingSelector).select(k=metrics.k)
        breakdown = MemoryBreakdown.of(metrics, memory, self.wired_limit_bytes)
        panel = self.query_one(MetricsPanel)
        panel.show(metrics, breakdown)
        panel.show_plan(plan)
        self.query_one(WallStrip).show(metrics)
        if self.ready:
            self.query_one(RoutingSelector).show_pending(
                metrics.k, self.pending_k, self.pending_mode
            )
        self.query_one(StatusLine).show(
            Status(
                model=self.model_name,
                state=self.state,
                k=metrics.k if self.ready else None,
                pending_k=self.pending_k,
                mode=metrics.mode if self.ready else None,
                pending_mode=self.pending_mode,
                context_tokens=self._shown_context(metrics),
                peak_memory_bytes=metrics.peak_memory_bytes,
                peak_rss_bytes=metrics.peak_rss_bytes,
                unsaved=self.store.unsaved,
            )
        )

    def _shown_context(self, metrics: LiveMetrics) -> int | None:
        """The context size: while a reply is written, the engine's count as it goes, unknown
        (None) until its first step (a regenerate's prefill, right after a load, showed "context 0
        tokens" for a long moment); otherwise the chat's last count."""
        if self.reply is None:
            return self.context_tokens
        return metrics.context_tokens or None
