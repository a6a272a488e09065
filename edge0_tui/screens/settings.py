"""Settings: how replies are sampled (temperature, top-p, max tokens)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label

from engine import GenerationConfig


@dataclass(frozen=True)
class Field:
    name: str  # the GenerationConfig field, and the input's id
    label: str
    kind: type  # float or int
    minimum: float
    maximum: float


FIELDS = (
    Field("temperature", "temperature (0 is greedy)", float, 0, 5),
    Field("top_p", "top-p (1 keeps every token)", float, 0.01, 1),
    Field("max_tokens", "max tokens per reply", int, 1, 1_000_000),
)


class SettingsScreen(ModalScreen[GenerationConfig | None]):
    """Dismissed with the new settings, or None when cancelled."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel", id="settings.cancel")]

    def __init__(self, settings: GenerationConfig) -> None:
        super().__init__()
        self.settings = settings

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("Settings", classes="dialog-title")
            for field in FIELDS:
                yield Label(f"{field.label}, {field.minimum} to {field.maximum}")
                yield Input(
                    str(getattr(self.settings, field.name)),
                    type="integer" if field.kind is int else "number",
                    id=field.name,
                )
            with Horizontal(classes="dialog-buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    @on(Button.Pressed, "#cancel")
    def cancel(self) -> None:
        self.dismiss(None)

    @on(Button.Pressed, "#save")
    @on(Input.Submitted)
    def save(self) -> None:
        values = {}
        for field in FIELDS:
            box = self.query_one(f"#{field.name}", Input)
            try:
                value = field.kind(box.value)
            except ValueError:
                value = None
            if value is None or not field.minimum <= value <= field.maximum:
                box.focus()
                self.notify(f"{field.label}: {field.minimum} to {field.maximum}", severity="error")
                return
            values[field.name] = value
        self.dismiss(replace(self.settings, **values))
