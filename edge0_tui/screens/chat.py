"""The chat screen: the conversation, the prompt, the live panels and the status line.

It draws and takes input; what it shows and asks for is its `ChatController`'s (the conversation,
saved as it goes, and the engine's K and mode), which it calls and draws from. It starts the
engine's thread worker: the engine thread posts messages here (`edge0_tui.messages`), and the
panels are refreshed by one timer that reads the engine's latest metrics snapshot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import Header
from textual.worker import Worker, WorkerState, get_current_worker

from engine import GenerationConfig

from .. import messages
from ..chat_controller import ChatController, Notice, Outcome
from ..chat_store import ChatMessage, ChatStore
from ..engine_session import EngineSession
from ..key_order import switch_keys_first
from ..last_session import LastSession
from ..live_metrics import LiveMetrics
from ..model_source import DEMO
from ..preferences import ModelPreferences
from ..system_memory import SystemMemory, read_system_memory
from ..widgets.conversation import AssistantTurn, Conversation
from ..widgets.first_steps import DEMO_PROMPTS, FirstSteps
from ..widgets.fitting_footer import FittingFooter
from ..widgets.memory_bar import MemoryBreakdown
from ..widgets.memory_panel import MemoryPanel
from ..widgets.metrics_panel import MetricsPanel
from ..widgets.prompt import PromptInput
from ..widgets.routing_selector import RoutingSelector
from ..widgets.status_line import Status, StatusLine
from ..widgets.wall_strip import WallStrip
from .chat_list import ChatListScreen
from .confirm import ConfirmScreen, resident_question
from .model_loading import ModelLoadingScreen
from .settings import SettingsScreen

if TYPE_CHECKING:
    from engine import MemoryPlan

# How often the panels read the engine's metrics snapshot (4-10 Hz reads as live).
PANEL_REFRESH_HZ = 6


class ChatScreen(Screen):
    # Below 110 columns the side panel narrows, so an 80-column terminal still has room to chat.
    # Below 100 columns or 36 rows the side panels do not fit beside a readable chat: the compact
    # layout shows the wall in one line above the prompt, and F6 swaps the chat for the panels.
    # From 150 columns the side panel takes a share of the width (app.tcss, -widest). Under 56
    # rows the panels take their dense form (one line for the speed and for the plan, no blank
    # lines); from 56 rows, their full one.
    HORIZONTAL_BREAKPOINTS = [(0, "-cramped"), (100, "-narrow"), (110, "-wide"), (150, "-widest")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (36, "-tall"), (56, "-tallest")]
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
        self.controller = ChatController(session, store, settings)
        self.reply: AssistantTurn | None = None  # the reply being written, if any
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
            # Two columns: the decode figures, then memory and the switches (side by side under
            # F6 in the compact layout). It scrolls only on a terminal too short for either.
            with VerticalScroll(id="side"):
                yield MetricsPanel(id="metrics")
                with Vertical(id="side-rest"):
                    yield MemoryPanel(id="memory-panel")
                    yield RoutingSelector(id="routing")
        yield StatusLine(id="status")
        yield FittingFooter()

    @property
    def active_bindings(self):
        return switch_keys_first(super().active_bindings)  # the K and mode keys first

    def notify(self, message: str, *, markup: bool = False, **options: Any) -> None:
        # Plain text: a path, model name or error it quotes holding `[/x]` would stop the app.
        super().notify(message, markup=markup, **options)

    def say(self, *notices: Notice | None) -> bool:
        """Show what the controller says; True when it said anything (for a refusal: stop)."""
        for n in notices:
            if n is not None:
                self.notify(n.text, title=n.title, severity=n.severity, timeout=n.timeout)
        return any(n is not None for n in notices)

    def on_mount(self) -> None:
        self.app.push_screen(ModelLoadingScreen())
        self.run_engine()
        self.panel_timer = self.set_interval(1 / PANEL_REFRESH_HZ, self.refresh_panels)
        self.query_one(PromptInput).focus()
        self.refresh_panels(force=True)
        self.show_title_and_hints()
        if self.reopen is not None:
            self.call_later(self._reopen, self.reopen)

    async def _reopen(self, last: LastSession) -> None:
        """The chat shown at the last quit, with its unsent text back in the prompt. A chat
        deleted since (another edge0) leaves a new chat, the text still kept."""
        if last.draft:
            self.prompt_input.give_back(last.draft)
        if last.chat_id is not None and self.controller.is_saved(last.chat_id):
            await self.open_chat(last.chat_id)

    def show_title_and_hints(self) -> None:
        """The chat's title, and the empty chat's hints (for the demo, what it is and prompts to
        try), hidden once the chat has a message."""
        self.sub_title = self.controller.title
        demo = self.controller.model_name == DEMO
        self.query_one(FirstSteps).show_while_empty(not self.controller.messages, demo)

    def action_suggest(self, index: int) -> None:
        """Put suggested prompt `index` in the message box (from a click on it, or the palette)."""
        self.prompt_input.suggest(DEMO_PROMPTS[index % len(DEMO_PROMPTS)])

    def session_to_keep(self) -> LastSession:
        """What the next start reopens: this chat and the prompt's unsent text."""
        # The widget, not a query: at the app's unmount the screen's children are already gone.
        return LastSession(self.controller.chat_id, self.prompt_input.text)

    # -- the engine thread -------------------------------------------------------------------------

    @work(thread=True, exclusive=True, group="engine", exit_on_error=False, name="engine")
    def run_engine(self) -> None:
        """The engine's one thread, for the whole session (see EngineSession)."""
        worker = get_current_worker()
        self.session.serve(self.post_message, lambda: worker.is_cancelled)

    async def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.worker.name != "engine" or event.state != WorkerState.ERROR:
            return
        loaded = self.controller.ready  # loaded: keep the chat, end the reply it interrupted
        self.show_outcome(self.controller.engine_thread_died(event.worker.error))
        if loaded and self.reply is not None:
            await self._end_reply(self.reply.text, "error")

    def on_model_progress(self, event: messages.ModelProgress) -> None:
        self.controller.state = event.what
        if isinstance(self.app.screen, ModelLoadingScreen):
            self.app.screen.report(event.what, event.done, event.total)

    async def on_engine_ready(self, event: messages.EngineReady) -> None:
        info, control = event.info, self.controller
        control.offer(event)
        await self.query_one(RoutingSelector).set_choices(
            control.profiles, control.modes, info["k"], info["mode"], info.get("profile_quality")
        )
        if self.app.opening is not None:  # opened in place of the model before: its settings
            note, kept = self.app.model_opened(self.session.model)
            control.use(kept)
            await self.query_one(Conversation).add_note(note)
        # Only now: the panel timer shows the selector's state once `ready`.
        ready = control.engine_ready(event)
        self.show_title_and_hints()  # the demo's own hints, now that the model is known
        self.show_outcome(ready)  # the loading screen goes, what to know first is said
        self.app.apply_kept_choices(event)
        self.refresh_bindings()  # F4/F5 are offered again (hidden while the model (re)loaded)
        control.count_context()  # a chat reopened at start
        self.refresh_panels(force=True)

    def loading(self, what: str) -> None:
        """Another model is loading: as at start-up, nothing is sent until it is ready."""
        self.show_outcome(self.controller.loading(what))

    def on_model_refused(self, event: messages.ModelRefused) -> None:
        self.app.opening = None
        self.show_outcome(self.controller.refused(event.error, event.reloading))

    def on_engine_failed(self, event: messages.EngineFailed) -> None:
        self.show_outcome(self.controller.load_failed(event.error))

    # -- a reply -----------------------------------------------------------------------------------

    async def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        if not await self.send(event.text):
            event.prompt.give_back(event.text)

    async def send(self, text: str) -> bool:
        """Start a reply to `text`; False (and a notification) when one cannot start now."""
        if self.say(self.controller.send_refusal(writing=self.reply is not None)):
            return False
        message, notice = self.controller.save(ChatMessage("user", text))
        self.show_title_and_hints()
        self.say(notice)
        await self.query_one(Conversation).add_user_turn(message.content)
        await self._write_reply()
        return True

    async def _write_reply(self) -> None:
        """The reply's turn on screen, and the engine asked to write it."""
        self.reply = await self.query_one(Conversation).add_reply()
        self.controller.ask_reply()
        self.refresh_bindings()

    async def on_reply_text(self, event: messages.ReplyText) -> None:
        if self.reply is not None:
            await self.reply.append(event.text)

    async def on_reply_finished(self, event: messages.ReplyFinished) -> None:
        await self._end_reply(event.text, event.stopped_by, event.nonfinite_repaired)

    async def on_reply_failed(self, event: messages.ReplyFailed) -> None:
        self.notify(event.error, title="the reply stopped", severity="error", timeout=15)
        await self._end_reply(event.text, "error", event.nonfinite_repaired)

    async def _end_reply(self, text: str, stopped_by: str, nonfinite_repaired: int = 0) -> None:
        reply, self.reply = self.reply, None
        if reply is None:
            return
        text, notice = self.controller.reply_ended(text, stopped_by)
        self.show_title_and_hints()
        self.say(notice)
        self.refresh_bindings()
        await reply.finish(text, stopped_by, nonfinite_repaired)

    # -- actions -----------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        return self.controller.allows(action, parameters, writing=self.reply is not None)

    def action_stop_reply(self) -> None:
        if self.reply is not None:
            self.controller.stop_reply()

    async def action_new_chat(self) -> None:
        if self.say(self.controller.busy(writing=self.reply is not None)):
            return
        self.controller.new_chat()
        self.show_title_and_hints()
        await self.query_one(Conversation).show([])
        self.query_one(PromptInput).focus()

    def action_open_chat(self) -> None:
        if self.say(self.controller.busy(writing=self.reply is not None)):
            return

        async def closed(chat_id: int | None) -> None:
            if chat_id is not None:
                await self.open_chat(chat_id)
            elif self.controller.shown_chat_deleted():
                await self.action_new_chat()  # the open chat was deleted in the list

        self.app.push_screen(ChatListScreen(self.controller.store), closed)

    async def open_chat(self, chat_id: int) -> None:
        """Show a saved chat and continue it."""
        if self.say(self.controller.open(chat_id)):  # it cannot be read: the chat shown stays
            return
        self.show_title_and_hints()
        await self.query_one(Conversation).show(self.controller.messages)
        self.query_one(PromptInput).focus()
        # The footer's bindings depend on the messages (Regenerate: the last is a finished
        # reply); focus staying on the prompt would not refresh them.
        self.refresh_bindings()
        self.controller.count_context()  # the status line shows it once the engine has counted

    def on_context_counted(self, event: messages.ContextCounted) -> None:
        self.controller.context_counted(event.chat_id, event.tokens, self.reply is not None)

    def action_settings(self) -> None:
        kept = self.app.preferences
        current = self.controller.settings_shown(kept.current if kept is not None else None)

        def saved(chosen: ModelPreferences | None) -> None:
            if chosen is not None:
                self.show_outcome(self.controller.keep_settings(chosen, current))

        running = self.session.engine_config
        self.app.push_screen(
            SettingsScreen(current, running.expert_cache_bytes, running.page_cache_bytes), saved
        )

    @property
    def compact(self) -> bool:
        """True in the compact layout (a terminal under 100 columns or 36 rows)."""
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
        if self.reply is not None or not self.controller.last_is_reply:
            return
        if self.say(self.controller.drop_last_reply()):  # the database keeps it for now
            return
        await self.query_one(Conversation).drop_last_reply()
        await self._write_reply()

    def action_copy_reply(self) -> None:
        reply, notice = self.controller.reply_to_copy()
        if reply is not None:
            self.app.copy_to_clipboard(reply)
        self.say(notice)

    # -- routing width and mode --------------------------------------------------------------------

    @on(RoutingSelector.KChosen)
    def k_chosen(self, event: RoutingSelector.KChosen) -> None:
        self.choose_k(event.k)

    @on(RoutingSelector.ModeChosen)
    def mode_chosen(self, event: RoutingSelector.ModeChosen) -> None:
        self.choose_mode(event.mode)

    def action_next_k(self) -> None:
        k = self.controller.next_k()
        if k is not None:
            self.choose_k(k)

    def action_pick_k(self, k: int) -> None:
        self.choose_k(k)

    def action_next_mode(self) -> None:
        mode, why_not = self.controller.next_mode()
        self.say(why_not)
        if mode is not None:
            self.choose_mode(mode)

    def choose_k(self, k: int, remember: bool = True) -> None:
        """Switch routing width, mid-reply too: the engine applies it before its next step."""
        self.show_outcome(self.controller.choose_k(k), remember)

    def choose_mode(self, mode: str, remember: bool = True) -> None:
        """A streaming mode applies before the engine's next step; resident and back reload the
        model. Going resident reads every expert into memory, so it asks first, with what that
        needs and what the machine has free."""
        control, writing = self.controller, self.reply is not None
        if not control.reloads_for(mode):
            self.show_outcome(control.choose_mode(mode), remember)
        elif mode != "resident" or writing or control.reload_refusal():
            self.show_outcome(control.reload(mode, writing))  # (says why it does not)
        else:
            question = resident_question(control.expert_bytes(), read_system_memory())

            def answered(yes: bool | None) -> None:
                self.show_outcome(control.reload(mode, self.reply is not None, agreed=bool(yes)))

            self.app.push_screen(ConfirmScreen("Load every expert?", question, "Load"), answered)

    def show_outcome(self, outcome: Outcome, remember: bool = True) -> None:
        """Draw what the controller's news came to: the selector shows what stands, the loading
        screen goes up or away, the choices are kept for this model (unless `remember` is False),
        the notices are said, and the panels and keys refreshed when the engine's state changed."""
        self.query_one(RoutingSelector).select(k=outcome.k, mode=outcome.mode)
        if outcome.loading:
            self.app.push_screen(ModelLoadingScreen())
        elif outcome.loading is False and isinstance(self.app.screen, ModelLoadingScreen):
            self.app.pop_screen()
        if remember and outcome.kept:
            self.app.remember(**outcome.kept)
        self.say(*outcome.notices)
        if outcome.changed:
            self.refresh_bindings()
            self.refresh_panels(force=True)

    def on_quality_kept(self, event: messages.QualityKept) -> None:
        """An eval run beside the app: the K selector's labels show its figures now."""
        self.query_one(RoutingSelector).set_quality(event.quality)

    def on_switch_failed(self, event: messages.SwitchFailed) -> None:
        self.show_outcome(self.controller.switch_failed(event.error))

    # -- the panels --------------------------------------------------------------------------------

    def refresh_panels(self, force: bool = False) -> None:
        """The one timer's callback (idle: once a second): the engine's latest snapshot, shown."""
        engine, metrics = self.session.engine, self.session.metrics  # (the plan follows K)
        if self.controller.panels_due(metrics, self.reply is not None) or force:
            plan = engine.memory_plan if self.controller.ready and engine is not None else None
            self.show_panels(metrics, read_system_memory(), plan)

    def show_panels(
        self, metrics: LiveMetrics, memory: SystemMemory, plan: MemoryPlan | None = None
    ) -> None:
        """`plan`: the memory plan the engine keeps (None before a model is loaded)."""
        control, selector = self.controller, self.query_one(RoutingSelector)
        if control.settle(metrics):  # a mode switch applied, perhaps with its own K
            selector.select(k=metrics.k)
        breakdown = MemoryBreakdown.of(metrics, memory, control.wired_limit_bytes)
        self.query_one(MetricsPanel).show(metrics)
        memory_panel = self.query_one(MemoryPanel)
        memory_panel.show(breakdown)
        memory_panel.show_plan(plan)
        self.query_one(WallStrip).show(metrics)
        if control.ready:
            selector.show_pending(metrics.k, control.pending_k, control.pending_mode)
        self.query_one(StatusLine).show(
            Status(
                model=control.model_name,
                state=control.state,
                k=metrics.k if control.ready else None,
                pending_k=control.pending_k,
                mode=metrics.mode if control.ready else None,
                pending_mode=control.pending_mode,
                context_tokens=control.shown_context(metrics, self.reply is not None),
                peak_memory_bytes=metrics.peak_memory_bytes,
                peak_rss_bytes=metrics.peak_rss_bytes,
                unsaved=control.store.unsaved,
            )
        )
