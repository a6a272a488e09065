"""The chat screen: the conversation, the prompt, the live panels and the status line.

It owns one conversation at a time (its saved id and messages) and the engine's thread worker. The
engine thread posts messages here (`edge0_tui.messages`); the panels are refreshed by one timer that
reads the engine's latest metrics snapshot.
"""

from __future__ import annotations

import sqlite3

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import Footer, Header
from textual.worker import Worker, WorkerState, get_current_worker

from engine import Edge0Error, GenerationConfig

from ..chat_store import ChatMessage, ChatStore, chat_title
from ..engine_session import EngineSession, ReplyRequest
from ..live_metrics import LiveMetrics
from ..messages import (
    EngineFailed,
    EngineReady,
    ModelProgress,
    ReplyFailed,
    ReplyFinished,
    ReplyText,
)
from ..system_memory import SystemMemory, read_system_memory
from ..widgets.conversation import AssistantTurn, Conversation
from ..widgets.memory_bar import MemoryBreakdown
from ..widgets.metrics_panel import MetricsPanel
from ..widgets.prompt import PromptInput
from ..widgets.routing_selector import RoutingSelector
from ..widgets.status_line import Status, StatusLine
from .chat_list import ChatListScreen
from .model_loading import ModelLoadingScreen
from .settings import SettingsScreen

# How often the panels read the engine's metrics snapshot (4-10 Hz reads as live).
PANEL_REFRESH_HZ = 6


class ChatScreen(Screen):
    # Below 110 columns the side panel narrows, so an 80-column terminal still has room to chat.
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (110, "-wide")]
    BINDINGS = [
        Binding("escape", "stop_reply", "Stop reply", id="chat.stop"),
        Binding("ctrl+n", "new_chat", "New chat", id="chat.new"),
        Binding("ctrl+o", "open_chat", "Chats", id="chat.open"),
        Binding("f2", "settings", "Settings", id="chat.settings"),
        Binding("f3", "copy_reply", "Copy reply", id="chat.copy"),
    ]

    def __init__(self, session: EngineSession, store: ChatStore, settings: GenerationConfig):
        super().__init__()
        self.session = session
        self.store = store
        self.settings = settings
        self.chat_id: int | None = None
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

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            with Vertical(id="chat"):
                yield Conversation(id="conversation")
                yield PromptInput(id="prompt")
            with Vertical(id="side"):
                yield MetricsPanel(id="metrics")
                yield RoutingSelector(id="routing")
        yield StatusLine(id="status")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "new chat"
        self.app.push_screen(ModelLoadingScreen())
        self.run_engine()
        self.panel_timer = self.set_interval(1 / PANEL_REFRESH_HZ, self.refresh_panels)
        self.query_one(PromptInput).focus()
        self.refresh_panels()

    # -- the engine thread -------------------------------------------------------------------------

    @work(thread=True, exclusive=True, group="engine", exit_on_error=False, name="engine")
    def run_engine(self) -> None:
        """The engine's one thread, for the whole session (see EngineSession)."""
        worker = get_current_worker()
        self.session.serve(self.post_message, lambda: worker.is_cancelled)

    async def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.worker.name == "engine" and event.state == WorkerState.ERROR:
            # Not an Edge0Error (those arrive as messages): a bug. Say so in one line, keep the
            # conversation, and end the reply it interrupted.
            self._dismiss_loading()
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
        await self.query_one(RoutingSelector).set_choices(
            event.profiles, event.modes, info["k"], info["mode"]
        )
        # Only now: the panel timer shows the selector's state once `ready`.
        self.ready = True
        self.model_name = event.model_name
        self.state = "ready"
        self._dismiss_loading()
        for notice in event.notices:
            self.notify(notice, severity="warning", timeout=20)
        self.refresh_panels()

    def on_engine_failed(self, event: EngineFailed) -> None:
        self._dismiss_loading()
        self.state = "no model"
        self.notify(event.error, title="cannot load the model", severity="error", timeout=30)
        self.refresh_panels()

    def _dismiss_loading(self) -> None:
        if isinstance(self.app.screen, ModelLoadingScreen):
            self.app.pop_screen()

    # -- a reply -----------------------------------------------------------------------------------

    async def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        if await self.send(event.text):
            event.prompt.clear()

    async def send(self, text: str) -> bool:
        """Start a reply to `text`; False (and a notification) when one cannot start now."""
        if not self.ready:
            self.notify(f"cannot send: {self.state}", severity="warning")
            return False
        if self.reply is not None:
            self.notify("a reply is being written: wait, or press Escape to stop it")
            return False
        self._save(ChatMessage("user", text))
        conversation = self.query_one(Conversation)
        await conversation.add_user_turn(text)
        self.reply = await conversation.add_reply()
        prompt = [m.as_prompt() for m in self.messages]
        self.session.submit(ReplyRequest(prompt, self.settings))
        self.state = "writing…"
        self.refresh_bindings()
        return True

    async def on_reply_text(self, event: ReplyText) -> None:
        if self.reply is not None:
            await self.reply.append(event.text)

    async def on_reply_finished(self, event: ReplyFinished) -> None:
        await self._end_reply(event.text, event.stopped_by)

    async def on_reply_failed(self, event: ReplyFailed) -> None:
        self.notify(event.error, title="the reply stopped", severity="error", timeout=15)
        await self._end_reply(event.text, "error")

    async def _end_reply(self, text: str, stopped_by: str) -> None:
        reply, self.reply = self.reply, None
        if reply is None:
            return
        # The engine thread publishes its last snapshot before posting the message that ends a reply.
        self.context_tokens = self.session.metrics.context_tokens if text else None
        self.state = "ready"
        if text:  # a partial reply is kept: it is part of what the model saw and said
            self._save(ChatMessage("assistant", text, stopped_by))
        self.refresh_bindings()
        await reply.finish(text, stopped_by)

    def _save(self, message: ChatMessage) -> None:
        """Add a message to the conversation and the database (creating the chat on its first)."""
        self.messages.append(message)
        try:
            if self.chat_id is None:
                self.chat_id = self.store.create_chat(chat_title(message.content), self.model_name)
                self.sub_title = chat_title(message.content)
            self.store.add_message(self.chat_id, message)
        except sqlite3.Error as e:
            self.notify(f"could not save the chat: {e}", severity="error")

    # -- actions -----------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "stop_reply":
            return self.reply is not None  # only shown while a reply is written
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
        self.chat_id, self.messages, self.context_tokens = None, [], 0
        self.sub_title = "new chat"
        await self.query_one(Conversation).show([])
        self.query_one(PromptInput).focus()

    def action_open_chat(self) -> None:
        if self._refuse_while_writing():
            return

        async def opened(chat_id: int | None) -> None:
            if chat_id is not None:
                await self.open_chat(chat_id)

        self.app.push_screen(ChatListScreen(self.store.chats()), opened)

    async def open_chat(self, chat_id: int) -> None:
        """Show a saved chat and continue it."""
        self.chat_id, self.context_tokens = chat_id, None
        self.messages = self.store.messages(chat_id)
        first_user = next((m.content for m in self.messages if m.role == "user"), "")
        self.sub_title = chat_title(first_user)
        await self.query_one(Conversation).show(self.messages)
        self.query_one(PromptInput).focus()

    def action_settings(self) -> None:
        def saved(settings: GenerationConfig | None) -> None:
            if settings is not None:
                self.settings = settings
                self.notify(
                    f"temperature {settings.temperature}, top-p {settings.top_p}, "
                    f"max tokens {settings.max_tokens}",
                    title="settings saved",
                )

        self.app.push_screen(SettingsScreen(self.settings), saved)

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

    def choose_k(self, k: int) -> None:
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
        if not profile.recovered:
            self.notify(
                f"quality not recovered at K={k}: no trained adapter for it, so the model's own "
                "router is narrowed or widened",
                severity="warning",
            )
        self.refresh_panels()

    def choose_mode(self, mode: str) -> None:
        selector = self.query_one(RoutingSelector)
        try:
            self.session.request_mode(mode)
        except Edge0Error as e:
            self.notify(str(e), severity="error")
            selector.select(mode=self.pending_mode or self.session.metrics.mode)
            return
        selector.select(mode=mode)
        self.pending_mode = None if mode == self.session.metrics.mode else mode
        self.refresh_panels()

    # -- the panels --------------------------------------------------------------------------------

    def refresh_panels(self) -> None:
        """The one timer's callback: read the engine's latest snapshot and show it."""
        self.show_panels(self.session.metrics, read_system_memory())

    def show_panels(self, metrics: LiveMetrics, memory: SystemMemory) -> None:
        if self.pending_k == metrics.k:
            self.pending_k = None
        if self.pending_mode is not None and self.pending_mode == metrics.mode:
            self.pending_mode = None
            # A mode switch may bring its own K (prerouter mode needs a K with trained heads).
            self.query_one(RoutingSelector).select(k=metrics.k)
        self.query_one(MetricsPanel).show(metrics, MemoryBreakdown.of(metrics, memory))
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
                context_tokens=metrics.context_tokens if self.reply else self.context_tokens,
                peak_memory_bytes=metrics.peak_memory_bytes,
            )
        )
