"""The K selector (routing width: experts per token) and the expert-loading mode switch.

The selector offers only what the engine reports (its K profiles and modes). Picking one posts
`KChosen` / `ModeChosen`; the screen asks the engine for it. The buttons show what was asked for:
the screen moves them only for a choice made elsewhere (the command palette) or one the engine
refused (`select`), never from its refresh timer, which could otherwise undo a click still on its
way through the message queue. `show_pending` marks a switch the engine has not applied yet.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Label, RadioButton, RadioSet

from engine import EXACT_MODES, KProfile


class RoutingSelector(Vertical):
    @dataclass
    class KChosen(Message):
        k: int

    @dataclass
    class ModeChosen(Message):
        mode: str

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.profiles: list[KProfile] = []
        self.modes: list[str] = []
        # Measured perplexity over the native model's, per K and routing (`edge0 eval --profiles`).
        self.quality: dict[int, dict[str, float]] = {}
        # What the radio buttons show as chosen. Pressing a button from code posts the same
        # Changed message a click does; comparing with these tells the two apart.
        self._shown_k: int | None = None
        self._shown_mode: str | None = None

    def compose(self) -> ComposeResult:
        # A RadioSet learns which button is pressed when it mounts, so new choices mean new sets.
        yield Label("routing width K", classes="panel-title")
        yield RadioSet(
            *(
                RadioButton(
                    _k_label(p, self.quality.get(p.k, {})), p.k == self._shown_k, id=f"k-{p.k}"
                )
                for p in self.profiles
            ),
            id="k-choice",
            compact=True,
        )
        yield Label(self._k_notes(), id="k-notes", classes="panel-note")
        yield Label("expert loading", classes="panel-title")
        yield RadioSet(
            *(
                RadioButton(_mode_label(m), m == self._shown_mode, id=f"mode-{m}")
                for m in self.modes
            ),
            id="mode-choice",
            compact=True,
        )
        yield Label("", id="switch-note", classes="panel-note")

    async def set_choices(
        self,
        profiles: list[KProfile],
        modes: list[str],
        k: int,
        mode: str,
        quality: dict[int, dict[str, float]] | None = None,
    ):
        """Offer the engine's K profiles and modes, `k` and `mode` chosen; `quality`: each
        profile's measured perplexity ratio, where an evaluation was kept."""
        self.profiles, self.modes, self.quality = profiles, modes, quality or {}
        self._shown_k, self._shown_mode = k, mode
        await self.recompose()

    def set_quality(self, quality: dict[int, dict[str, float]]) -> None:
        """New measured figures for the K labels, changed in place (a recompose would leave the
        panel timer a moment without the selector's widgets); the choices shown stay."""
        self.quality = quality
        for profile in self.profiles:
            for button in self.query(f"#k-{profile.k}").results(RadioButton):
                button.label = _k_label(profile, quality.get(profile.k, {}))
        for notes in self.query("#k-notes").results(Label):
            notes.update(self._k_notes())

    def _k_notes(self) -> str:
        unrecovered = not all(p.recovered for p in self.profiles)
        notes = ["* quality not recovered at this K"] if unrecovered else []
        if any(p.k in self.quality for p in self.profiles):
            notes.append("%: measured perplexity over native")
        return "\n".join(notes)

    def select(self, k: int | None = None, mode: str | None = None) -> None:
        """Show `k` and/or `mode` as chosen."""
        # Record what is shown before pressing a button, so the Changed it posts is not taken
        # for the user's choice (see on_radio_set_changed).
        # A choice without its button (a model's K before its choices are offered, or a set
        # being rebuilt) is left to `set_choices`, which shows what stands.
        if k is not None and k != self._shown_k:
            for button in self.query(f"#k-{k}").results(RadioButton):
                self._shown_k = k
                button.value = True
        if mode is not None and mode != self._shown_mode:
            for button in self.query(f"#mode-{mode}").results(RadioButton):
                self._shown_mode = mode
                button.value = True

    def show_pending(self, k: int, pending_k: int | None, pending_mode: str | None) -> None:
        """Mark a switch the engine will apply at its next step as loading."""
        self.query_one("#k-choice").set_class(pending_k is not None, "-pending")
        self.query_one("#mode-choice").set_class(pending_mode is not None, "-pending")
        note = self.query_one("#switch-note", Label)
        if pending_k is not None:
            note.update(f"switching K {k} → {pending_k} at the next step…")
        elif pending_mode is not None:
            note.update(f"switching to {pending_mode} at the next step…")
        else:
            note.update("")

    def on_radio_set_changed(self, event: RadioSet.Changed) -> None:
        event.stop()
        chosen = (event.pressed.id or "").split("-", 1)[1]
        if event.radio_set.id == "k-choice" and int(chosen) != self._shown_k:
            self._shown_k = int(chosen)
            self.post_message(self.KChosen(int(chosen)))
        elif event.radio_set.id == "mode-choice" and chosen != self._shown_mode:
            self._shown_mode = chosen
            self.post_message(self.ModeChosen(chosen))


def _mode_label(mode: str) -> str:
    """A mode as the switch shows it, saying whether its tokens are the model's own."""
    return f"{mode} · {'exact' if mode in EXACT_MODES else 'approx.'}"


def _k_label(profile: KProfile, quality: dict[str, float]) -> str:
    """`4`, `4*` (quality not recovered), `4 +8.7%` or `4 +23%`: the profile's perplexity over
    the native model's as it routes in prerouter mode (with its LoRA where it has one), measured by
    `edge0 eval --profiles` (the note under the buttons says so: three labels fit a line)."""
    label = f"{profile.k}{'' if profile.recovered else '*'}"
    ratio = quality.get("heads + LoRA" if profile.lora else "heads only")
    if ratio is None:
        return label
    percent = 100 * (ratio - 1)
    return f"{label} {percent:+.{1 if abs(percent) < 10 else 0}f}%"
