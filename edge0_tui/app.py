"""The edge0 chat app: chat with a streaming-MoE model and watch the memory wall while it answers.

The app owns the long-lived services (the engine session, the chat database, the settings) and the
app-wide keys and palette commands; the chat screen does the chatting. Run it with `edge0 chat`.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from pathlib import Path

from platformdirs import user_cache_path, user_data_path
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen

from engine import EngineConfig, GenerationConfig

from .chat_store import ChatStore
from .engine_session import EngineSession
from .model_source import DEMO
from .screens.chat import ChatScreen
from .widgets.routing_selector import RoutingSelector

DEFAULT_SETTINGS = GenerationConfig(max_tokens=512, temperature=0.7, top_p=0.9)


class Edge0App(App[None]):
    CSS_PATH = "app.tcss"
    TITLE = "edge0"
    BINDINGS = [Binding("f1", "toggle_keys", "Keys", id="app.keys")]

    def __init__(
        self,
        model: str = DEMO,
        engine_config: EngineConfig | None = None,
        data_dir: str | Path | None = None,
        cache_dir: str | Path | None = None,
        settings: GenerationConfig | None = None,
        offline: bool = False,
    ) -> None:
        """`model`: "demo", a checkpoint directory or a Hugging Face repo id. `data_dir` holds the
        chat database (default: the platform's user data directory); `cache_dir` the demo model."""
        super().__init__()
        self.store = ChatStore(Path(data_dir) if data_dir else user_data_path("edge0"))
        self.session = EngineSession(
            model,
            engine_config or EngineConfig(),
            Path(cache_dir) if cache_dir else user_cache_path("edge0"),
            offline=offline,
        )
        self.chat_screen = ChatScreen(self.session, self.store, settings or DEFAULT_SETTINGS)

    def get_default_screen(self) -> Screen:
        return self.chat_screen

    async def action_quit(self) -> None:
        # The engine thread stops its reply within one step, closes the engine and returns; the
        # process does not wait for a reply to finish.
        self.session.shutdown()
        self.exit()

    def on_unmount(self) -> None:
        self.session.shutdown()  # whatever way the app ends
        self.store.close()

    def action_toggle_keys(self) -> None:
        if self.screen.query("HelpPanel"):
            self.action_hide_help_panel()
        else:
            self.action_show_help_panel()

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        chat = self.chat_screen
        yield SystemCommand(
            "New chat", "Start an empty conversation (ctrl+n)", chat.action_new_chat
        )
        yield SystemCommand("Open a saved chat", "List saved chats (ctrl+o)", chat.action_open_chat)
        if chat.reply is not None:
            yield SystemCommand("Stop the reply", "Stop writing (escape)", chat.action_stop_reply)
        yield SystemCommand("Settings", "Temperature, top-p, max tokens (f2)", chat.action_settings)
        yield SystemCommand("Copy the last reply", "To the clipboard (f3)", chat.action_copy_reply)
        routing = chat.query_one(RoutingSelector)
        for profile in routing.profiles:
            note = "" if profile.recovered else " (quality not recovered)"
            yield SystemCommand(
                f"Routing width K={profile.k}",
                f"Route each token to {profile.k} experts{note}",
                partial(chat.choose_k, profile.k),
            )
        for mode in routing.modes:
            yield SystemCommand(
                f"Expert loading: {mode}", f"Switch to {mode} mode", partial(chat.choose_mode, mode)
            )
