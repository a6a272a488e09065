"""Open another model (Ctrl+L, or "Open model..." in the palette): the models `edge0 list` finds,
each with family, size, native K and the K profiles found, and a box to type a folder or a Hub id.

The list is read off the UI thread (it scans the Hugging Face cache: config files and shard headers
of every repo there, at most MAX_HUB_REPOS of them) and arrives as a message. Dismissed with what
to open (as `edge0 chat MODEL` takes it: demo, a folder, a repo id), or None.

A Hub id typed in the box, with no copy here, is planned from its headers (as `edge0 info
OWNER/NAME --memory` does: nothing downloaded), on a worker thread once typing pauses: the note
under the box says whether it fits this machine before a byte of its weights is fetched.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rich.text import Text
from textual import events, on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Input, Label, OptionList
from textual.widgets.option_list import Option

from engine import Edge0Error, EngineConfig, format_bytes

from ..model_list import NOT_RECOVERED_NOTE, any_not_recovered, known_models, profiles_text
from ..model_source import is_hub_id, needs_hub_plan
from ..model_start import AUTO, DEFAULT_MODE, expert_cache_config
from ..preferences import PreferenceStore, model_key
from ..sanitize import error_line, sanitize

# Hugging Face cache repos read for the list: each costs a few small file reads, and a cache
# can hold hundreds of repos (most of them no MoE).
MAX_HUB_REPOS = 200
# A typed Hub id is planned once typing has paused this long (each plan asks the Hub).
PLAN_AFTER_S = 0.6


def describe(row: dict, in_use: bool) -> Text:
    """A model as the list shows it: its name, then family, size, native K, profiles and where it
    was found; or why it does not open. Every part cleaned: names come from a settings file."""
    text = Text(sanitize(row["name"]), style="bold")
    if in_use:
        text.append("  (in use)", style="italic")
    if "error" in row:
        text.append(f"\n  {sanitize(row['where'])}: {sanitize(row['error'])}", style="dim")
        return text
    details = (
        f"\n  {sanitize(row['family'])} · {format_bytes(row['disk_bytes'])} · "
        f"K {row['native_k']} · profiles {profiles_text(row)} · {sanitize(row['where'])}"
    )
    text.append(details, style="dim")
    return text


class ModelPickerScreen(ModalScreen[str | None]):
    """Dismissed with the model to open, or None."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Close", id="models.close")]

    @dataclass
    class Found(Message):
        """The list, read on a worker thread; `error`: why it could not be read."""

        rows: list[dict]
        left: int  # HF cache repos not read (past MAX_HUB_REPOS)
        error: str | None = None

    @dataclass
    class Planned(Message):
        """A typed Hub id's memory plan from its headers (or why there is none), as one line."""

        model: str
        line: str

    def __init__(
        self,
        store: PreferenceStore | None,
        config: EngineConfig,
        in_use: str,
        writing: bool = False,
    ) -> None:
        """`store`: the kept settings, whose models are the "used" ones (None: none listed);
        `config` gives the adapter search (the data folder); `in_use`: the running model, as
        given; `writing`: a reply is being written (opening a model stops it)."""
        super().__init__()
        self.store = store
        self.config = config
        self.in_use = model_key(in_use)
        self.writing = writing
        self.rows: list[dict] = []
        self.plan_timer = None

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="models-dialog"):
            yield Label("Open a model", classes="dialog-title")
            yield Input(
                placeholder="a checkpoint folder, or a Hugging Face id owner/name",
                id="path",
                select_on_focus=False,  # typing moves here from the list: keep what it typed
            )
            yield Label("", id="plan-note", classes="panel-note", markup=False)
            yield OptionList(id="models")
            yield Label("looking for models…", id="models-note", classes="panel-note", markup=False)
            keys = "Enter opens · Tab moves · Escape closes; the chat stays"
            if self.writing:
                keys += " (the reply being written is stopped)"
            yield Label(keys, classes="panel-note")

    def on_mount(self) -> None:
        self.query_one("#path", Input).focus()
        self.find_models()

    @work(thread=True, exclusive=True, group="models", exit_on_error=False)
    def find_models(self) -> None:
        """On a worker thread: the models, posted back (workers never touch widgets)."""
        try:
            rows, left = known_models(self.store, self.config, MAX_HUB_REPOS)
        except Edge0Error as e:
            self.post_message(self.Found([], 0, str(e)))
        except Exception as e:  # a cache folder in a state nobody foresaw: said, not raised
            self.post_message(self.Found([], 0, f"cannot list the models: {error_line(e)}"))
        else:
            self.post_message(self.Found(rows, left))

    def on_model_picker_screen_found(self, event: Found) -> None:
        self.rows = event.rows
        options = self.query_one("#models", OptionList)
        options.clear_options()
        options.add_options(
            [Option(describe(row, model_key(row["name"]) == self.in_use)) for row in self.rows]
        )
        notes = [event.error] if event.error else []
        if not self.rows and not event.error:
            notes.append("No models found: type a folder or a Hub id above.")
        if event.left:
            notes.append(f"{event.left} more Hugging Face cache repos not read")
        if any_not_recovered(self.rows):
            notes.append(NOT_RECOVERED_NOTE)
        note = self.query_one("#models-note", Label)
        note.update(sanitize("\n".join(notes)))
        note.display = bool(notes)
        if self.rows:
            options.highlighted = 0
            if not self.query_one("#path", Input).value:
                options.focus()  # nothing typed yet: Up, Down and Enter pick from the list

    def on_key(self, event: events.Key) -> None:
        """Typing with the list focused goes to the path field: what a user types is a path or
        a Hub id, never a key of the list (Up, Down and Enter still pick from it)."""
        options = self.query_one("#models", OptionList)
        if options.has_focus and event.is_printable and event.character:
            box = self.query_one("#path", Input)
            box.focus()
            box.insert_text_at_cursor(event.character)
            event.stop()
            event.prevent_default()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self.rows[event.option_index]["name"])

    @on(Input.Changed, "#path")
    def plan_when_typing_pauses(self, event: Input.Changed) -> None:
        model = event.value.strip()
        self.query_one("#plan-note", Label).update("")
        if self.plan_timer is not None:
            self.plan_timer.stop()
        if is_hub_id(model):
            self.plan_timer = self.set_timer(PLAN_AFTER_S, lambda: self.plan_hub_model(model))

    @work(thread=True, exclusive=True, group="plan", exit_on_error=False)
    def plan_hub_model(self, model: str) -> None:
        """On a worker thread: the plan of a Hub repo with no copy here, posted back as a line
        (the plan the app would open it with: the default mode, the expert cache `auto`)."""
        from engine import plan_hub_model

        if not needs_hub_plan(model):
            return  # a folder, or a cached copy: the list and the load say what it is
        config = dataclasses.replace(
            self.config, mode=DEFAULT_MODE, **expert_cache_config(AUTO), refuse_over_plan=False
        )
        try:
            line = plan_hub_model(model, config).verdict_line()
        except Edge0Error as e:
            line = str(e)
        except Exception as e:  # a hub answering in a way nobody foresaw: said, not raised
            line = f"{model}: cannot plan it from the Hub ({error_line(e)})"
        self.post_message(self.Planned(model, line))

    def on_model_picker_screen_planned(self, event: Planned) -> None:
        if event.model == self.query_one("#path", Input).value.strip():  # still what is typed
            self.query_one("#plan-note", Label).update(sanitize(event.line))

    @on(Input.Submitted, "#path")
    def typed(self, event: Input.Submitted) -> None:
        model = sanitize(event.value.strip())
        if model:
            self.dismiss(model)
