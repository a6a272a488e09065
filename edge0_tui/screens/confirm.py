"""A yes/no question before something costly (loading every expert resident)."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label


class ConfirmScreen(ModalScreen[bool]):
    """Dismissed with True for the action, False for Cancel or Escape."""

    BINDINGS = [Binding("escape", "dismiss(False)", "Cancel", id="confirm.cancel")]
    AUTO_FOCUS = "#cancel"  # Enter alone does not start a costly load

    def __init__(self, title: str, question: str, action: str) -> None:
        super().__init__()
        self.title_text, self.question, self.action_label = title, question, action

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(self.title_text, classes="dialog-title", markup=False)
            yield Label(self.question, markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button(self.action_label, variant="warning", id="confirm")
                yield Button("Cancel", id="cancel")

    @on(Button.Pressed, "#confirm")
    def confirm(self) -> None:
        self.dismiss(True)

    @on(Button.Pressed, "#cancel")
    def cancel(self) -> None:
        self.dismiss(False)
