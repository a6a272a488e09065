"""The saved chats, most recent first; Enter reopens one."""

from __future__ import annotations

import time

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList
from textual.widgets.option_list import Option

from ..chat_store import ChatSummary
from ..sanitize import sanitize


class ChatListScreen(ModalScreen[int | None]):
    """Dismissed with the chosen chat's id, or None."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Close", id="chats.close")]

    def __init__(self, chats: list[ChatSummary]) -> None:
        super().__init__()
        self.chats = chats

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("Saved chats", classes="dialog-title")
            if not self.chats:
                yield Label("No saved chats yet.")
            # Text, not a str: a chat's title is what the user typed, never markup.
            yield OptionList(
                *(Option(Text(_describe(chat)), id=str(chat.id)) for chat in self.chats),
                id="chats",
            )

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(int(event.option.id))


def _describe(chat: ChatSummary) -> str:
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(chat.updated_at))
    # The title is what the user (or a file someone sent them) wrote: shown cleaned.
    return sanitize(f"{chat.title}\n  {when} · {chat.message_count} messages · {chat.model}")
