"""The edge0 chat app: chat with a streaming-MoE model and watch the memory wall while it answers.

The app owns the long-lived services (the engine session, the chat database, the settings) and the
app-wide keys and palette commands; the chat screen does the chatting. Run it with `edge0 chat`.
"""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import Iterable
from functools import partial
from pathlib import Path

from platformdirs import user_cache_path, user_data_path, user_downloads_path
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.notifications import SeverityLevel
from textual.screen import Screen

from engine import MODES, Edge0Error, EngineConfig, GenerationConfig

from .chat_controller import mode_unavailable
from .chat_store import ChatStore
from .engine_session import EngineSession
from .last_session import LastSession, LastSessionFile
from .messages import EngineReady
from .model_source import DEMO
from .model_start import DEFAULT_SETTINGS, ModelStart, model_start
from .preferences import KeptPreferences, ModelPreferences, fit_to_model, model_key
from .sanitize import sanitize
from .screens.chat import ChatScreen
from .screens.expert_heat import ExpertHeatScreen
from .screens.model_picker import ModelPickerScreen
from .series_export import FORMATS, write_series
from .widgets.first_steps import DEMO_PROMPTS


def screenshot_folder(data_dir: Path) -> Path:
    """Where the palette's Screenshot saves: the Downloads folder, or edge0's data folder where
    there is no Downloads folder."""
    downloads = user_downloads_path()
    return downloads if downloads.is_dir() else data_dir


class Edge0App(App[None]):
    CSS_PATH = "app.tcss"
    TITLE = "edge0"
    BINDINGS = [
        Binding("f1", "toggle_keys", "Keys", id="app.keys"),
        # priority: the prompt (a TextArea) binds F7 to "select all".
        Binding("f7", "expert_heat", "Heat", id="app.heat", priority=True),
        Binding("ctrl+l", "open_model", "Model", id="app.model"),
        # Textual's own Ctrl+Q, shown: a new user looks for how to quit in the footer.
        Binding("ctrl+q", "quit", "Quit", id="app.quit", priority=True),
    ]

    def __init__(
        self,
        model: str = DEMO,
        engine_config: EngineConfig | None = None,
        data_dir: str | Path | None = None,
        cache_dir: str | Path | None = None,
        settings: GenerationConfig | None = None,
        offline: bool = False,
        preferences: KeptPreferences | None = None,
        reopen: bool = True,
    ) -> None:
        """`model`: "demo", a checkpoint directory or a Hugging Face repo id. `data_dir` holds the
        chat database (default: the platform's user data directory); `cache_dir` the demo model.
        `preferences`: the model's stored choices, saved as they change (None: nothing kept).
        `reopen`: start on the chat shown at the last quit, its unsent text in the prompt (else
        the latest chat); False: on a new chat."""
        super().__init__()
        data_dir = Path(data_dir) if data_dir else user_data_path("edge0")
        self.store = ChatStore(data_dir)
        self.last_session = LastSessionFile(data_dir)
        self._session_kept = False
        self.session = EngineSession(
            model,
            engine_config or EngineConfig(),
            Path(cache_dir) if cache_dir else user_cache_path("edge0"),
            offline=offline,
        )
        self.preferences = preferences
        if preferences is not None and settings is None:
            settings = preferences.current.generation
        self.chat_screen = ChatScreen(self.session, self.store, settings or DEFAULT_SETTINGS)
        if reopen:
            self.chat_screen.reopen = self.last_session.load() or self._latest_chat()
        if preferences is not None:
            self.chat_screen.controller.system_prompt = preferences.current.system_prompt
        self._warned_unsaved = False
        # Another model being opened in place of the running one (`open_model`): the model as
        # named before, and how the new one starts; None when none is.
        self.opening: tuple[str, ModelStart] | None = None

    def on_mount(self) -> None:
        if self.session.runs_as_ranks:  # the header says so, with each rank's latest share
            self._show_ranks()
            self.set_interval(1.0, self._show_ranks)

    def _show_ranks(self) -> None:
        self.title = f"{self.TITLE} · {self.session.ranks_line()}"

    def remember(self, **changes) -> None:
        """Keep what the user chose for this model (sampling, K, mode, budgets) for next time."""
        if self.preferences is None:
            return
        try:
            self.preferences.update(**changes)
        except Edge0Error as e:  # kept for this run; said once per failure
            self.chat_screen.notify(str(e), title="settings not kept", severity="warning")

    def apply_kept_choices(self, event: EngineReady) -> None:
        """Once a model is loaded: the K and mode it ran with last time, unless the command line
        chose them; a kept max tokens that does not fit its context falls back. A K or mode this
        model no longer offers (its adapters moved) is said and skipped."""
        kept, chat = self.preferences, self.chat_screen
        control = chat.controller
        if kept is None:
            return
        try:
            kept.store.remember(kept.model)  # listed as used, whether or not a choice is kept
        except Edge0Error as e:
            chat.notify(str(e), title="settings not kept", severity="warning")
        if kept.store.warning:
            chat.notify(kept.store.warning, title="settings file", severity="warning")
        engine = self.session.engine
        if engine is not None:
            fitted, warning = fit_to_model(
                kept.current, engine.context_limit, GenerationConfig(), kept.store.path
            )
            if warning:
                kept.current = fitted
                max_tokens = fitted.generation.max_tokens
                control.settings = dataclasses.replace(control.settings, max_tokens=max_tokens)
                chat.notify(warning, title="settings file", severity="warning")
        wanted = kept.current
        if wanted.mode and not kept.mode_from_command_line and wanted.mode != event.info["mode"]:
            if wanted.mode in event.modes:
                chat.choose_mode(wanted.mode, remember=False)
            else:
                chat.notify(f"the {wanted.mode} mode kept for this model is not available now")
        if wanted.k and not kept.k_from_command_line and wanted.k != event.info["k"]:
            if wanted.k in control.k_choices():
                chat.choose_k(wanted.k, remember=False)
            else:
                chat.notify(f"K={wanted.k}, kept for this model, is not offered now")

    def _latest_chat(self) -> LastSession | None:
        """The chat written to last, when no session was kept (a first start, a crash)."""
        try:
            chats = self.store.chats()
        except sqlite3.Error:
            return None
        return LastSession(chats[0].id) if chats else None

    def get_default_screen(self) -> Screen:
        return self.chat_screen

    async def action_quit(self) -> None:
        if self._unsaved_on_quit():
            return
        # The engine thread stops its reply within one step, closes the engine and returns; the
        # process does not wait for a reply to finish.
        self.session.shutdown()
        try:
            self._keep_session()
        except Edge0Error as e:  # said once the terminal is back: the app is closing
            self.exit(message=f"edge0: {e}")
            return
        self.exit()

    def _keep_session(self) -> None:
        """The chat on screen and the prompt's unsent text, for the next start."""
        if not self._session_kept and self.chat_screen.is_mounted:
            self._session_kept = True
            self.last_session.save(self.chat_screen.session_to_keep())

    def _unsaved_on_quit(self) -> bool:
        """True when messages the database refused still cannot be written: the user is told
        once, and the next quit goes ahead without them."""
        if not self.store.unsaved or self._warned_unsaved:
            return False  # nothing waits, or the user knows: closing the store makes a last try
        try:
            if self.store.flush():
                return False
        except sqlite3.Error:
            return False  # a message that can never be written (a bug); closing retries the rest
        self._warned_unsaved = True
        self.chat_screen.notify(
            f"{self.store.unsaved} message(s) are not saved: the chat database is still busy "
            f"({self.store.last_error}). Quit again to leave without them.",
            title="not saved yet",
            severity="error",
            timeout=20,
        )
        return True

    def on_unmount(self) -> None:
        self.session.shutdown()  # whatever way the app ends
        try:
            self._keep_session()  # when it ends other than by quitting
        except Edge0Error:
            pass  # the terminal is being handed back: nowhere left to say it
        self.store.close()  # a last try at writing messages the database refused

    def notify(
        self,
        message: str,
        *,
        title: str = "",
        severity: SeverityLevel = "information",
        timeout: float | None = None,
        markup: bool = True,
    ) -> None:
        # Every notification, whoever sends it, reaches the terminal cleaned: errors quote paths,
        # model names and the model's own words.
        super().notify(
            sanitize(message),
            title=sanitize(title),
            severity=severity,
            timeout=timeout,
            markup=markup,
        )

    def deliver_screenshot(
        self,
        filename: str | None = None,
        path: str | None = None,
        time_format: str | None = None,
    ) -> str | None:
        # Textual saves into the Downloads folder and fails where there is none (a server, a
        # container): then into edge0's data folder, next to the chats. The notification that
        # follows names the file.
        return super().deliver_screenshot(
            filename, path or str(screenshot_folder(self.store.path.parent)), time_format
        )

    def action_toggle_keys(self) -> None:
        if self.screen.query("HelpPanel"):
            self.action_hide_help_panel()
        else:
            self.action_show_help_panel()

    def action_expert_heat(self) -> None:
        """Every MoE layer's experts, live (F7); F7 again or Escape goes back to the chat."""
        if isinstance(self.screen, ExpertHeatScreen):
            self.pop_screen()
        elif self.screen is self.chat_screen:
            self.push_screen(ExpertHeatScreen(self.session))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "expert_heat":  # from the chat, not over a dialog or the loading screen
            return self.screen is self.chat_screen or isinstance(self.screen, ExpertHeatScreen)
        return True

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        chat = self.chat_screen
        yield SystemCommand(
            "New chat", "Start an empty conversation (ctrl+n)", chat.action_new_chat
        )
        yield SystemCommand("Open a saved chat", "List saved chats (ctrl+o)", chat.action_open_chat)
        if chat.reply is not None:
            yield SystemCommand("Stop the reply", "Stop writing (escape)", chat.action_stop_reply)
        yield SystemCommand(
            "Open model...",
            "Another model in place of this one; the chat stays (ctrl+l)",
            self.action_open_model,
        )
        yield SystemCommand("Settings", "Temperature, top-p, max tokens (f2)", chat.action_settings)
        yield SystemCommand("Copy the last reply", "To the clipboard (f3)", chat.action_copy_reply)
        yield SystemCommand(
            "Expert heat",
            "Each MoE layer's experts: in the cache, used, read cold, read ahead (f7)",
            self.action_expert_heat,
        )
        if chat.controller.model_name == DEMO:
            for i, prompt in enumerate(DEMO_PROMPTS):
                yield SystemCommand(
                    f"Suggested prompt: {prompt}",
                    "Put it in the message box (the demo writes longer replies to these)",
                    partial(chat.action_suggest, i),
                )
        for fmt in FORMATS:
            yield SystemCommand(
                f"Export the steps as {fmt.upper()}",
                "The live series (tok/s, blocked ms, cold share, memory, hit rates per step) "
                "to a file",
                partial(self.export_series, fmt),
            )
        yield from self._switch_commands(chat)
        yield from self._engine_commands(chat)

    def action_open_model(self) -> None:
        """The model picker; what is chosen is opened in place of the running model."""
        chat = self.chat_screen
        if self.screen is not chat:
            return  # a dialog is open, or the model is loading
        if not chat.controller.ready:
            chat.notify(
                f"cannot open another model now: {chat.controller.state}", severity="warning"
            )
            return
        if refusal := self.session.reload_refusal():
            chat.notify(refusal, title="cannot open another model", severity="warning")
            return
        store = self.preferences.store if self.preferences is not None else None
        picker = ModelPickerScreen(
            store, self.session.engine_config, self.session.model, chat.reply is not None
        )
        self.push_screen(picker, self.open_model)

    def open_model(self, model: str | None) -> None:
        """Load `model` (demo, a folder, a Hub id) in place of the running one, the chat kept.
        A reply being written is stopped first: the model was chosen in a dialog that said so,
        and the part written is kept, as Escape keeps it. Its kept settings apply once loaded."""
        chat = self.chat_screen
        if not model:
            return
        if not chat.controller.ready:  # something else began loading while the picker was open
            chat.notify(f"cannot open {model} now: {chat.controller.state}", severity="warning")
            return
        if model_key(model) == model_key(self.session.model):
            chat.notify(f"{model} is the model in use")
            return
        store = self.preferences.store if self.preferences is not None else None
        # What holds for the run stays (exact kernels, the data folder); --adapters named the
        # first model's, and its K, mode and budgets are its own.
        running = dataclasses.replace(self.session.engine_config, adapter_dirs=())
        start = model_start(model, store, running)
        self.opening = (self.session.model, start)
        chat.action_stop_reply()
        chat.loading(f"opening {model}…")
        self.session.open_model(model, start.engine_config, start.fallback)

    def model_opened(self, model: str) -> tuple[str, ModelPreferences]:
        """The model `open_model` asked for is loaded: its kept settings take over. Returns the
        note the chat shows (which model answers from here) and the settings to chat with."""
        before, start = self.opening
        self.opening = None
        self.preferences = start.preferences
        return f"model: {before} -> {model}", start.stored

    def export_series(self, fmt: str) -> None:
        """Save the steps the panels show, next to screenshots (Downloads, or the data folder)."""
        folder = screenshot_folder(self.store.path.parent)
        try:
            path, rows = write_series(self.session.metrics, folder, fmt)
        except Edge0Error as e:
            self.chat_screen.notify(str(e), title="export", severity="warning")
            return
        self.chat_screen.notify(f"{rows} steps saved to {path}", title="export")

    def _engine_commands(self, chat: ChatScreen) -> Iterable[SystemCommand]:
        """What multiplies the matrices: the BLAS in use and how prefill computes the experts."""
        info = chat.controller.engine_info
        if "blas" not in info:
            return
        blas = f"BLAS: {info['blas']['text']}"
        kernels = f"prefill experts: {info['prefill_kernels']}"
        yield SystemCommand(
            blas, kernels, partial(chat.notify, f"{blas}\n{kernels}", title="matrix products")
        )

    def _switch_commands(self, chat: ChatScreen) -> Iterable[SystemCommand]:
        """K and mode, findable by "K", "mode" or a mode's name; a mode this engine cannot run
        here is listed too, saying why, so that searching for it is not a dead end."""
        offered = chat.controller  # the K profiles and modes, as the selector shows them
        if not offered.ready:
            return
        yield SystemCommand("Next K", "Cycle the routing width K (f4, k)", chat.action_next_k)
        yield SystemCommand(
            "Next mode", "Cycle the expert-loading mode (f5, m)", chat.action_next_mode
        )
        for profile in offered.profiles:
            note = "" if profile.recovered else " (quality not recovered)"
            yield SystemCommand(
                f"Routing width K={profile.k}",
                f"Route each token to {profile.k} experts{note}",
                partial(chat.choose_k, profile.k),
            )
        for mode in MODES:
            if mode in offered.modes:
                yield SystemCommand(
                    f"Mode: {mode}",
                    f"Expert loading: switch to {mode} mode",
                    partial(chat.choose_mode, mode),
                )
            else:
                why = mode_unavailable(mode)
                yield SystemCommand(
                    f"Mode: {mode} (not available)",
                    why,
                    partial(chat.notify, why, title=f"{mode} mode", severity="warning"),
                )
