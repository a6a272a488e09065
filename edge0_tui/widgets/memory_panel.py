"""The memory panel: edge0's memory bar and the memory plan the engine keeps.

The plan has two forms: every term a line (as `generate` and `serve` print it, reflowed) where the
terminal is tall enough, and otherwise its total and the expert cache, the term a K switch changes.
The app's stylesheet shows one of the two.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Label

from engine import format_bytes

from .memory_bar import MemoryBar, MemoryBreakdown

if TYPE_CHECKING:  # the plan's module imports MLX; the panel only reads a plan it is given
    from engine import MemoryPlan


class MemoryPanel(Vertical):
    def compose(self) -> ComposeResult:
        yield Label("edge0's memory", classes="panel-title")
        yield MemoryBar(id="memory")
        # What the engine planned to hold, as `generate` and `serve` print it at start.
        yield Label("", id="memory-plan", classes="panel-note", markup=False)
        yield Label("", id="memory-plan-short", classes="panel-note", markup=False)

    def show(self, memory: MemoryBreakdown) -> None:
        self.query_one(MemoryBar).show(memory)

    def show_plan(self, plan: MemoryPlan | None) -> None:
        """The engine's memory plan; None before a model is loaded."""
        for label_id, text in (
            ("#memory-plan", plan_lines(plan.line()) if plan else ""),
            ("#memory-plan-short", plan_summary(plan) if plan else ""),
        ):
            label = self.query_one(label_id, Label)
            if str(label.content) != text:
                label.update(text)


def plan_lines(line: str) -> str:
    """`MemoryPlan.line()` (what generate and serve print) one term a line: wrapped at the
    panel's width, a term's figure and unit came apart. The line's own text, only reflowed."""
    head, sep, terms = line.rpartition(": ")
    if not sep or ": " not in head:  # not the plan line's shape: as it is
        return line
    return head + ":\n" + "\n".join(f"  {term}" for term in terms.split(", "))


def plan_summary(plan: MemoryPlan) -> str:
    """The plan in two lines: its total against what the machine has, and the expert cache."""
    limit = f" of {format_bytes(plan.limit_bytes)}" if plan.limit_bytes is not None else ""
    cache = next(
        f"{name} {format_bytes(n)}" for name, n in plan.terms() if name.startswith("expert cache")
    )
    return f"memory plan: {format_bytes(plan.total_bytes)}{limit}\n  {cache}"
