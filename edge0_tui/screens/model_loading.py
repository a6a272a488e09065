"""Shown while the model is prepared: downloaded from the Hub, or the demo model written."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, ProgressBar

from ..sanitize import sanitize


class ModelLoadingScreen(ModalScreen[None]):
    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("Preparing the model", classes="dialog-title")
            # Plain text: `what` quotes the model's path or repo id.
            yield Label("", id="what", markup=False)
            yield ProgressBar(total=None, show_eta=False, id="progress")

    def report(self, what: str, done: float, total: float | None) -> None:
        self.query_one("#what", Label).update(sanitize(what))
        self.query_one("#progress", ProgressBar).update(total=total, progress=done)
