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
            yield Label("Enter opens · F2 renames · Delete twice deletes", classes="panel-note")

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
        options.add_options([Option(describe(chat, query), id=str(chat.id)) for chat in self.chats])
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
            options = self.query_one(OptionList)
            options.focus()  # back on the list: Up and Down move at once, not after a Tab
            if not title:
                return
            try:
                self.store.rename_chat(chat.id, title)
            except sqlite3.Error as e:
                self._note(f"could not rename the chat: {e}")
                return
            self.show_chats()
            index = next((i for i, c in enumerate(self.chats) if c.id == chat.id), None)
            if index is not None:
                options.highlighted = index  # the renamed chat stays the chosen one

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


# Characters of a matching message shown on each side of the match.
MATCH_CONTEXT = 30


def describe(chat: ChatSummary, query: str = "") -> Text:
    """A chat as the list shows it: its title, when and how long; when searching, where the
    search matched, the match highlighted."""
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(chat.updated_at))
    # The title is what the user (or a file someone sent them) wrote: shown cleaned.
    text = Text(sanitize(f"{chat.title}\n  {when} · {chat.message_count} messages · {chat.model}"))
    if query and chat.match:
        text.append("\n  ")
        text.append_text(match_snippet(chat.match, query))
    return text


def match_snippet(content: str, query: str, context: int = MATCH_CONTEXT) -> Text:
    """One line of `content` around its first match of `query` (ASCII case-insensitive, as the
    search), the match in reverse video."""
    flat = " ".join(sanitize(content).split())
    at = _ascii_lower(flat).find(_ascii_lower(" ".join(query.split())))
    if at < 0:  # matched in the title, or across a line break the flattening moved
        return Text(flat[: 2 * context] + ("…" if len(flat) > 2 * context else ""), style="dim")
    end = at + len(" ".join(query.split()))
    start, stop = max(0, at - context), min(len(flat), end + context)
    snippet = Text("…" if start else "", style="dim")
    snippet.append(flat[start:at], style="dim")
    snippet.append(flat[at:end], style="reverse")
    snippet.append(flat[end:stop], style="dim")
    snippet.append("…" if stop < len(flat) else "", style="dim")
    return snippet


def _ascii_lower(text: str) -> str:
    """Lower case for ASCII letters only (SQLite's LIKE), so positions stay those of `text`."""
    return text.translate({c: c + 32 for c in range(ord("A"), ord("Z") + 1)})
