"""A yes/no question before something costly (loading every expert resident)."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label

from engine import format_bytes

from ..system_memory import SystemMemory


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


def resident_question(expert_bytes: int, memory: SystemMemory) -> str:
    """What loading every expert resident asks for, against what the machine has free now."""
    free = (
        ""
        if memory.used_bytes is None
        else (
            f"; {format_bytes(memory.total_bytes - memory.used_bytes)} of "
            f"{format_bytes(memory.total_bytes)} {memory.source} is free now"
        )
    )
    return (
        f"Resident mode reads every expert into memory: {format_bytes(expert_bytes)} more{free}. "
        "Past what is free the system swaps or stops edge0. The chat stays."
    )
