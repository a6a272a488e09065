"""Settings: how replies are sampled (temperature, top-p, max tokens).

A value out of range (NaN, inf, a negative temperature, top-p outside (0, 1], max tokens below 1) is
refused in the dialog itself, naming the field and what it accepts; the dialog stays open.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label

from engine import Edge0Error, GenerationConfig


@dataclass(frozen=True)
class Field:
    name: str  # the GenerationConfig field, and the input's id
    label: str
    kind: type  # float or int
    minimum: float
    maximum: float

    def parse(self, text: str) -> float | int | None:
        """The value `text` gives this field; None when it is not a finite number in range."""
        try:
            value = self.kind(text.strip())
        except ValueError:
            return None
        if not math.isfinite(value) or not self.minimum <= value <= self.maximum:
            return None
        return value

    def rule(self) -> str:
        kind = "a whole number" if self.kind is int else "a number"
        return f"{self.label.split(' (')[0]} must be {kind} from {self.minimum} to {self.maximum}"


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
            yield Label("", id="error", classes="dialog-error", markup=False)
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
            value = field.parse(box.value)
            if value is None:
                box.focus()
                self.refuse(f"{field.rule()}, not {box.value!r}")
                return
            values[field.name] = value
        try:
            settings = replace(self.settings, **values)
        except Edge0Error as e:  # the engine's own check of a GenerationConfig, where it has one
            self.refuse(str(e))
            return
        self.dismiss(settings)

    def refuse(self, reason: str) -> None:
        """Say in the dialog why the settings cannot be saved."""
        self.query_one("#error", Label).update(reason)
