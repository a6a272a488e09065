"""Shown while the model is prepared: downloaded from the Hub, or the demo model written.

Progress may arrive before the screen has composed its widgets (the engine's thread reports as
soon as it starts, and a busy machine may not have drawn the screen yet): the latest report is
kept and shown once the screen is mounted.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, ProgressBar

from ..sanitize import sanitize


class ModelLoadingScreen(ModalScreen[None]):
    def __init__(self) -> None:
        super().__init__()
        self.latest: tuple[str, float, float | None] | None = None

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("Preparing the model", classes="dialog-title")
            # Plain text: `what` quotes the model's path or repo id.
            yield Label("", id="what", markup=False)
            yield ProgressBar(total=None, show_eta=False, id="progress")

    def on_mount(self) -> None:
        self._show()

    def report(self, what: str, done: float, total: float | None) -> None:
        self.latest = (sanitize(what), done, total)
        if self.is_mounted:
            self._show()

    def _show(self) -> None:
        if self.latest is not None:
            what, done, total = self.latest
            self.query_one("#what", Label).update(what)
            self.query_one("#progress", ProgressBar).update(total=total, progress=done)
