"""The prompt: a multi-line text area where Enter sends and Ctrl+J starts a new line.

Enter and the new-line keys are handled in the widget's own key handler, in the order the keys
arrived, not as priority bindings: the app runs a priority binding as soon as the key reaches it,
while the keys before it may still wait in this widget's queue. A paste without bracketed paste
(or `tmux send-keys 'text' Enter`) arrives as one burst of keys, and a priority Enter then sent
"Tell me a l", or found the box still empty and was lost.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual import events
from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea

from ..sanitize import sanitize

SUBMIT_KEYS = ("enter",)
# Ctrl+J is what most terminals send for Shift+Enter too.
NEWLINE_KEYS = ("ctrl+j", "shift+enter")


def pasted_lines(text: str) -> str:
    """A bracketed paste's line breaks as newlines: xterm, VTE and tmux send each one as CR (the
    Enter key's byte), and Windows text brings CRLF. `sanitize` would drop a bare CR, running
    the lines together."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


class PromptInput(TextArea):
    # For the footer and the keys panel only: the keys themselves are handled in `_on_key`.
    BINDINGS = [
        Binding("enter", "submit", "Send", id="prompt.send"),
        Binding("ctrl+j,shift+enter", "newline", "New line", id="prompt.newline"),
    ]

    @dataclass
    class Submitted(Message):
        """The user pressed Enter. The prompt is empty by then (keys typed after Enter belong to
        the next message); the screen gives the text back (`give_back`) when it cannot send it."""

        prompt: PromptInput
        text: str

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, soft_wrap=True, show_line_numbers=False, tab_behavior="focus")

    async def _on_key(self, event: events.Key) -> None:
        # Runs before TextArea's handler (Textual calls each class's, subclass first), which would
        # insert a newline for Enter.
        if event.key in SUBMIT_KEYS or event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            if event.key in SUBMIT_KEYS:
                self.action_submit()
            else:
                self.action_newline()

    def _on_paste(self, event: events.Paste) -> None:
        # Textual runs each class's handler, this one before TextArea's, which inserts the text:
        # pasted terminal control sequences are dropped before they are shown.
        event.text = sanitize(pasted_lines(event.text))

    def action_submit(self) -> None:
        text = self.text.strip()
        if text:
            self.clear()
            self.post_message(self.Submitted(self, text))

    def action_newline(self) -> None:
        self.insert("\n")

    def suggest(self, text: str) -> None:
        """Put a suggested prompt in the box, in place of what is there, ready to send."""
        self.text = text
        self.move_cursor(self.document.end)
        self.focus()

    def give_back(self, text: str) -> None:
        """Put back a message the screen could not send, before anything typed since."""
        self.text = f"{text}{self.text}"
        self.move_cursor(self.document.end)
