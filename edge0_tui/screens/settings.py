"""Settings: how replies are sampled (temperature, top-p, max tokens, seed), the system prompt,
and the memory budgets (expert cache, page cache). They are kept per model (`preferences`).

A value out of range (NaN, inf, a negative temperature, top-p outside (0, 1], max tokens below 1, a
size that is not one) is refused in the dialog itself, naming the field and what it accepts; the
dialog stays open.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label

from engine import MAX_SEED, Edge0Error, format_bytes, parse_size

from ..preferences import MAX_SYSTEM_PROMPT_CHARS, ModelPreferences
from ..sanitize import sanitize


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


class SettingsScreen(ModalScreen[ModelPreferences | None]):
    """Dismissed with the new preferences, or None when cancelled."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel", id="settings.cancel")]
    AUTO_FOCUS = "#temperature"  # the first field: typing changes it at once

    def __init__(
        self,
        preferences: ModelPreferences,
        expert_cache_bytes: int = 0,
        page_cache_bytes: int | None = None,
    ) -> None:
        """`expert_cache_bytes`: the budget running now, shown when none is stored.
        `page_cache_bytes`: the page-cache budget running now (None: off), which an empty
        page-cache field keeps."""
        super().__init__()
        self.preferences = preferences
        self.settings = preferences.generation
        self.expert_cache_bytes = preferences.expert_cache_bytes or expert_cache_bytes
        self.page_cache_bytes = page_cache_bytes

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="settings-dialog"):
            yield Label("Settings", classes="dialog-title")
            yield from self._field_widgets()
            yield Label("", id="error", classes="dialog-error", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        # Focusing the first field scrolls it into view before the layout settles, hiding its
        # label on a short terminal: start at the top once it has.
        fields = self.query_one("#settings-fields", VerticalScroll)
        self.call_after_refresh(fields.scroll_home, animate=False)

    def _field_widgets(self) -> ComposeResult:
        # In a scroll of their own: on a short terminal the buttons stay in view.
        with VerticalScroll(id="settings-fields"):
            for field in FIELDS:
                yield Label(f"{field.label}, {field.minimum} to {field.maximum}")
                yield Input(
                    str(getattr(self.settings, field.name)),
                    type="integer" if field.kind is int else "number",
                    id=field.name,
                )
            seed = self.settings.seed
            yield Label("seed (empty: a new one every reply)")
            yield Input("" if seed is None else str(seed), type="integer", id="seed")
            yield Label("system prompt (empty: none)")
            yield Input(
                self.preferences.system_prompt,
                max_length=MAX_SYSTEM_PROMPT_CHARS,
                id="system_prompt",
            )
            yield Label("expert cache, e.g. 512M or 2G (applies at the next start)")
            cache = self.expert_cache_bytes
            yield Input(format_bytes(cache) if cache else "", id="expert_cache")
            yield Label("page-cache budget for the experts, e.g. 4M, or off (applies now)")
            page_cache = self.preferences.page_cache
            shown = "" if page_cache is None else page_cache
            yield Input(
                shown if isinstance(shown, str) else format_bytes(shown),
                placeholder=f"empty: this model's default ({self._running_page_cache()} now)",
                id="page_cache",
            )

    def _running_page_cache(self) -> str:
        budget = self.page_cache_bytes
        return "off" if budget is None else format_bytes(budget)

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
            values["seed"] = self._seed_value()
            settings = replace(self.settings, **values)
            extras = {
                "system_prompt": sanitize(self.query_one("#system_prompt", Input).value.strip()),
                "expert_cache_bytes": self._size_value("expert_cache", "expert cache", off=False),
                "page_cache": self._size_value("page_cache", "page-cache budget", off=True),
            }
        except Edge0Error as e:  # the engine's own checks, or a size that is not one
            self.refuse(str(e))
            return
        self.dismiss(replace(self.preferences, generation=settings, **extras))

    def _seed_value(self) -> int | None:
        box = self.query_one("#seed", Input)
        text = box.value.strip()
        if not text:
            return None
        if not text.isdigit() or int(text) > MAX_SEED:
            box.focus()
            raise Edge0Error(f"seed must be a whole number from 0 to {MAX_SEED}, not {text!r}")
        return int(text)

    def _size_value(self, box_id: str, name: str, off: bool) -> int | str | None:
        """A size box's value: bytes, "off" where allowed, None when left empty."""
        box = self.query_one(f"#{box_id}", Input)
        text = box.value.strip()
        if not text:
            return None
        if off and text.lower() == "off":
            return "off"
        try:
            value = parse_size(text)
        except Edge0Error:
            value = -1
        if value < 0 or (value == 0 and not off):  # a page-cache budget of 0 is a wall too
            box.focus()
            accepted = "a size such as 4M or 2G" + (", or off" if off else "")
            raise Edge0Error(f"{name} must be {accepted}, not {text!r}")
        return value

    def refuse(self, reason: str) -> None:
        """Say in the dialog why the settings cannot be saved."""
        self.query_one("#error", Label).update(reason)
