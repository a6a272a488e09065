"""The prompt: a multi-line text area where Enter sends and Ctrl+J starts a new line."""

from __future__ import annotations

from dataclasses import dataclass

from textual import events
from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea

from ..sanitize import sanitize


class PromptInput(TextArea):
    BINDINGS = [
        # priority: TextArea would otherwise insert a newline for Enter itself.
        Binding("enter", "submit", "Send", priority=True, id="prompt.send"),
        # Ctrl+J is what most terminals send for Shift+Enter too.
        Binding("ctrl+j,shift+enter", "newline", "New line", id="prompt.newline"),
    ]

    @dataclass
    class Submitted(Message):
        """The user pressed Enter. The text stays in the prompt until the screen accepts it."""

        prompt: PromptInput
        text: str

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, soft_wrap=True, show_line_numbers=False, tab_behavior="focus")

    def _on_paste(self, event: events.Paste) -> None:
        # Textual runs each class's handler, this one before TextArea's, which inserts the text:
        # pasted terminal control sequences are dropped before they are shown.
        event.text = sanitize(event.text)

    def action_submit(self) -> None:
        if self.text.strip():
            self.post_message(self.Submitted(self, self.text.strip()))

    def action_newline(self) -> None:
        self.insert("\n")
