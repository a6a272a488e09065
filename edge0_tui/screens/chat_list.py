"""The saved chats, most recent first: Enter reopens one, / searches titles and messages, F2
renames, Delete deletes (pressed twice: the first press asks)."""

from __future__ import annotations

import sqlite3
import time

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList
from textual.widgets.option_list import Option

from ..chat_store import ChatStore, ChatSummary
from ..sanitize import sanitize


class ChatListScreen(ModalScreen[int | None]):
    """Dismissed with the chosen chat's id, or None."""

    BINDINGS = [
        Binding("escape", "dismiss(None)", "Close", id="chats.close"),
        Binding("slash", "search", "Search", id="chats.search"),
        Binding("f2", "rename", "Rename", id="chats.rename"),
        Binding("delete", "delete", "Delete", id="chats.delete"),
    ]

    def __init__(self, store: ChatStore) -> None:
        super().__init__()
        self.store = store
        self.chats: list[ChatSummary] = []
        self._delete_armed: int | None = None  # the chat a first Delete press asked about

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("Saved chats", classes="dialog-title")
            yield Input(placeholder="search titles and messages (/)", id="chat-search")
            yield OptionList(id="chats")
            yield Label("", id="chats-note", classes="panel-note", markup=False)
            yield Label("Enter opens · F2 renames · Delete deletes", classes="panel-note")

    def on_mount(self) -> None:
        self.show_chats()
        self.query_one(OptionList).focus()

    def show_chats(self) -> None:
        query = self.query_one("#chat-search", Input).value.strip()
        try:
            self.chats = self.store.chats(matching=query)
        except sqlite3.Error as e:
            self.chats = []
            self._note(f"cannot read the saved chats: {e}")
        options = self.query_one(OptionList)
        options.clear_options()
        # Text, not a str: a chat's title is what the user typed, never markup.
        options.add_options([Option(Text(_describe(chat)), id=str(chat.id)) for chat in self.chats])
        if self.chats:
            options.highlighted = 0
        elif query:
            self._note(f"no chat holds {query!r}")
        else:
            self._note("No saved chats yet.")

    @on(Input.Changed, "#chat-search")
    def search_changed(self) -> None:
        self._delete_armed = None
        self._note("")
        self.show_chats()

    @on(Input.Submitted, "#chat-search")
    def search_done(self) -> None:
        self.query_one(OptionList).focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(int(event.option.id))

    def on_option_list_option_highlighted(self) -> None:
        self._delete_armed = None

    def action_search(self) -> None:
        self.query_one("#chat-search", Input).focus()

    def _highlighted(self) -> ChatSummary | None:
        index = self.query_one(OptionList).highlighted
        return self.chats[index] if index is not None and index < len(self.chats) else None

    def action_delete(self) -> None:
        chat = self._highlighted()
        if chat is None:
            return
        if self._delete_armed != chat.id:
            self._delete_armed = chat.id
            self._note(
                f"Press Delete again to delete {chat.title!r} ({chat.message_count} messages)"
            )
            return
        try:
            self.store.delete_chat(chat.id)
        except sqlite3.Error as e:
            self._note(f"could not delete the chat: {e}")
            return
        self._delete_armed = None
        self.show_chats()
        self._note(f"deleted {chat.title!r}")

    def action_rename(self) -> None:
        chat = self._highlighted()
        if chat is None:
            return

        def renamed(title: str | None) -> None:
            if not title:
                return
            try:
                self.store.rename_chat(chat.id, title)
            except sqlite3.Error as e:
                self._note(f"could not rename the chat: {e}")
                return
            self.show_chats()

        self.app.push_screen(RenameScreen(chat.title), renamed)

    def _note(self, text: str) -> None:
        self.query_one("#chats-note", Label).update(sanitize(text))


class RenameScreen(ModalScreen[str | None]):
    """A chat's new title: dismissed with it, or None when cancelled or left empty."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel", id="rename.cancel")]

    def __init__(self, title: str) -> None:
        super().__init__()
        self.title_now = title

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("Rename the chat", classes="dialog-title")
            yield Input(self.title_now, max_length=200, id="new-title")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Rename", variant="primary", id="rename")
                yield Button("Cancel", id="cancel")

    @on(Button.Pressed, "#cancel")
    def cancel(self) -> None:
        self.dismiss(None)

    @on(Button.Pressed, "#rename")
    @on(Input.Submitted)
    def rename(self) -> None:
        self.dismiss(sanitize(self.query_one("#new-title", Input).value.strip()) or None)


def _describe(chat: ChatSummary) -> str:
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(chat.updated_at))
    # The title is what the user (or a file someone sent them) wrote: shown cleaned.
    return sanitize(f"{chat.title}\n  {when} · {chat.message_count} messages · {chat.model}")
