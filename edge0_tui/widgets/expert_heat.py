"""The expert heat view: one row per MoE layer, one cell per expert (or per bin of experts), saying
what each did in the latest step and how often it was used lately.

    layer  experts 0-31 (1 a cell)                         hit ahead warm cold
        0  ·○●··■·○·◆··●·○·□···◇·○··●····○··                 3    1    1    1

A glyph says what happened in the step (legend below); the cell's shading how often the expert was
routed over the recent one-token steps. Where a layer has more experts than the width holds, each
cell is a bin of experts: it shows the most telling event among them (a cold read over a hit) and
the hottest one's shading. The view only displays: its screen hands it the engine's latest
`LiveMetrics`, whose `HeatPicture` the engine thread published.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widget import Widget
from textual.widgets import Static

from engine import ExpertEvent, HeatPicture

from ..live_metrics import LiveMetrics

# Glyph and component class of each event; NONE splits into in the cache or not.
POOLED, OUT = "pooled", "out"
GLYPHS = {
    OUT: "·",
    POOLED: "○",
    ExpertEvent.HIT: "●",
    ExpertEvent.AHEAD_USED: "◆",
    ExpertEvent.AHEAD_UNUSED: "◇",
    ExpertEvent.READ_WARM: "□",
    ExpertEvent.READ_COLD: "■",
}
CLASSES = {
    OUT: "expert-heat--out",
    POOLED: "expert-heat--pooled",
    ExpertEvent.HIT: "expert-heat--hit",
    ExpertEvent.AHEAD_USED: "expert-heat--ahead-used",
    ExpertEvent.AHEAD_UNUSED: "expert-heat--ahead-unused",
    ExpertEvent.READ_WARM: "expert-heat--warm",
    ExpertEvent.READ_COLD: "expert-heat--cold",
}
# "read": the layer waited for it (a miss), from the page cache (warm) or from disk (cold).
LEGEND = (
    (ExpertEvent.HIT, "hit"),
    (ExpertEvent.AHEAD_USED, "read ahead, used"),
    (ExpertEvent.AHEAD_UNUSED, "ahead, unused"),
    (ExpertEvent.READ_WARM, "read warm"),
    (ExpertEvent.READ_COLD, "read cold"),
    (POOLED, "cached"),
    (OUT, "not cached"),
)
# Shading by use: the share of recent one-token steps that routed the expert (out of 255), from
# which each level starts. A K=8-of-32 model routes an expert a quarter of the steps on average.
USE_LEVELS = (1, 26, 77, 153)  # above 0, a tenth, three tenths, six tenths
USE_CLASSES = tuple(f"expert-heat--use-{n}" for n in range(1, len(USE_LEVELS) + 1))
# The per-layer counts at each row's end: together they are the layer's routed experts.
SUMMARY = (
    ("hit", (ExpertEvent.HIT,)),
    ("ahead", (ExpertEvent.AHEAD_USED,)),
    ("warm", (ExpertEvent.READ_WARM,)),
    ("cold", (ExpertEvent.READ_COLD,)),
)
SUMMARY_WIDTH = sum(len(name) + 1 for name, _ in SUMMARY)


@dataclass(frozen=True)
class HeatLayout:
    """How a row's experts map to columns: `per_cell` experts a cell, `cells` cells of
    `cell_width` columns (2 leaves a space between experts where the width allows)."""

    per_cell: int
    cells: int
    cell_width: int


def heat_layout(experts: int, columns: int) -> HeatLayout:
    """The layout of `experts` in `columns` columns (at least one cell)."""
    columns = max(1, columns)
    if experts * 2 <= columns:
        return HeatLayout(1, experts, 2)
    if experts <= columns:
        return HeatLayout(1, experts, 1)
    per_cell = math.ceil(experts / columns)
    return HeatLayout(per_cell, math.ceil(experts / per_cell), 1)


@dataclass(frozen=True)
class BinnedPicture:
    """A picture's arrays with each row's experts grouped `per_cell` a cell: `[layers, cells]`."""

    events: np.ndarray  # the largest event in the cell
    pooled: np.ndarray  # any expert of the cell in the cache
    use: np.ndarray  # the hottest expert's use
    valid: np.ndarray  # the cell holds an expert of its layer (rows may differ in length)


def binned(picture: HeatPicture, layout: HeatLayout) -> BinnedPicture:
    width = layout.cells * layout.per_cell
    rows = len(picture.layers)

    def group(array: np.ndarray) -> np.ndarray:
        padded = np.zeros((rows, width), array.dtype)
        padded[:, : array.shape[1]] = array
        return padded.reshape(rows, layout.cells, layout.per_cell).max(axis=2)

    first = np.arange(layout.cells) * layout.per_cell
    valid = first[None, :] < np.array(picture.experts)[:, None]
    return BinnedPicture(group(picture.events), group(picture.pooled), group(picture.use), valid)


def cell_kind(event: int, pooled: bool) -> object:
    """The key of GLYPHS and CLASSES for a cell."""
    if event != ExpertEvent.NONE:
        return ExpertEvent(event)
    return POOLED if pooled else OUT


def use_level(use: int) -> int:
    """0 (never used lately) to len(USE_LEVELS)."""
    return sum(use >= start for start in USE_LEVELS)


def layer_counts(picture: HeatPicture) -> list[tuple[int, ...]]:
    """Per layer, the SUMMARY counts."""
    counts = picture.counts()
    return [tuple(int(sum(row[e] for e in events)) for _, events in SUMMARY) for row in counts]


def summary_line(metrics: LiveMetrics) -> str:
    """The line above the rows: which step, how long it waited, what the cells are."""
    picture = metrics.expert_heat
    if picture is None:
        if metrics.mode == "resident":
            return "Resident mode: every expert is in memory; nothing is read from disk."
        return "No step yet: send a message and each layer's experts show here as it is answered."
    totals = picture.counts().sum(axis=0)
    routed = int(totals[ExpertEvent.HIT :].sum())
    missed = int(totals[ExpertEvent.READ_WARM] + totals[ExpertEvent.READ_COLD])
    parts = [
        f"step {picture.step}",
        f"blocked {picture.blocked_ms:.1f} ms",
        f"read {missed} of {routed} routed",
        f"{int(totals[ExpertEvent.AHEAD_UNUSED])} ahead unused",
        f"{int(picture.pooled.sum())} cached",
    ]
    return " · ".join(parts)


class HeatRows(Widget):
    """The rows themselves (one per MoE layer), rendered to the width they have."""

    COMPONENT_CLASSES = {*CLASSES.values(), *USE_CLASSES}
    # Glyph colours say the event: red for a read from disk, yellow for one from the page cache,
    # green for a hit, blue for reads ahead (the accent is the warning's orange in the default
    # theme). Use shades the background in greys, under any glyph colour and in any theme.
    DEFAULT_CSS = """
    HeatRows {
        height: auto;
        text-wrap: nowrap;
        & > .expert-heat--out { color: $text-muted 50%; }
        & > .expert-heat--pooled { color: $text-muted; }
        & > .expert-heat--hit { color: $text-success; text-style: bold; }
        & > .expert-heat--ahead-used { color: $text-primary; text-style: bold; }
        & > .expert-heat--ahead-unused { color: $text-primary 70%; }
        & > .expert-heat--warm { color: $text-warning; text-style: bold; }
        & > .expert-heat--cold { color: $text-error; text-style: bold; }
        & > .expert-heat--use-1 { background: $foreground 8%; }
        & > .expert-heat--use-2 { background: $foreground 16%; }
        & > .expert-heat--use-3 { background: $foreground 27%; }
        & > .expert-heat--use-4 { background: $foreground 40%; }
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.picture: HeatPicture | None = None

    def show(self, picture: HeatPicture | None) -> None:
        if picture is not self.picture:
            rows_changed = (picture is None) != (self.picture is None) or (
                picture is not None and picture.layers != self.picture.layers
            )
            self.picture = picture
            self.refresh(layout=rows_changed)

    def get_content_height(self, container, viewport, width: int) -> int:
        return len(self.picture.layers) if self.picture is not None else 0

    def label_width(self) -> int:
        if self.picture is None or not self.picture.layers:
            return 5
        return max(5, len(str(self.picture.layers[-1])))  # "layer" heads the column

    def layout_for(self, width: int) -> HeatLayout | None:
        """The cells' layout at this widget's `width`."""
        if self.picture is None:
            return None
        columns = width - self.label_width() - 2 - SUMMARY_WIDTH
        return heat_layout(max(self.picture.experts, default=1), columns)

    def render(self) -> Text:
        picture = self.picture
        text = Text(no_wrap=True, overflow="crop")
        if picture is None:
            return text
        layout = self.layout_for(self.size.width)
        cells = binned(picture, layout)
        glyph_styles = {kind: self._colour(name) for kind, name in CLASSES.items()}
        shade_styles = [Style()] + [self._shade(name) for name in USE_CLASSES]
        label_width = self.label_width()
        pad = " " * (layout.cell_width - 1)
        for row, (layer, counts) in enumerate(zip(picture.layers, layer_counts(picture))):
            if row:
                text.append("\n")
            text.append(f"{layer:>{label_width}}  ")
            for cell in range(layout.cells):
                if not cells.valid[row, cell]:
                    text.append(" " * layout.cell_width)
                    continue
                kind = cell_kind(cells.events[row, cell], cells.pooled[row, cell])
                shade = shade_styles[use_level(int(cells.use[row, cell]))]
                text.append(GLYPHS[kind], glyph_styles[kind] + shade)
                text.append(pad, shade)  # a two-column cell is shaded whole
            text.append(" ")
            for (name, _), count in zip(SUMMARY, counts):
                text.append(f"{count:>{len(name) + 1}}")
        return text

    def _colour(self, name: str) -> Style:
        style = self.get_component_rich_style(name)
        return Style(color=style.color, bold=style.bold)

    def _shade(self, name: str) -> Style:
        return Style(bgcolor=self.get_component_rich_style(name).bgcolor)


class HeatHeader(Static):
    """The column titles over the rows, laid out as the rows are."""

    def show(self, rows: HeatRows, width: int) -> None:
        layout = rows.layout_for(width)
        if layout is None:
            self.update("")
            return
        label = f"{'layer':>{rows.label_width()}}  "
        experts = max(rows.picture.experts)
        cells = f"experts 0-{experts - 1}"
        if layout.per_cell > 1:
            cells += f", {layout.per_cell} a cell"
        span = layout.cells * layout.cell_width
        names = "".join(f"{name:>{len(name) + 1}}" for name, _ in SUMMARY)
        self.update(f"{label}{cells[:span]:<{span}} {names}")


def legend_text(widget: Widget, width: int) -> Text:
    """The glyphs and the shading, styled as the rows style them, in lines of at most `width`
    that never split an entry."""
    entries = []
    for kind, what in LEGEND:
        style = widget.get_component_rich_style(CLASSES[kind])
        entries.append(
            Text.assemble((GLYPHS[kind], Style(color=style.color, bold=style.bold)), f" {what}")
        )
    shading = Text(f"use lately (half-life {HeatPicture.half_life_steps} tokens): rare ")
    for name in USE_CLASSES:
        shading.append("  ", Style(bgcolor=widget.get_component_rich_style(name).bgcolor))
    shading.append(" often")
    entries.append(shading)
    text = Text(no_wrap=True, overflow="crop")
    line = 0
    for entry in entries:
        if line and line + 2 + len(entry) > width:
            text.append("\n")
            line = 0
        elif line:
            text.append("  ")
            line += 2
        text.append_text(entry)
        line += len(entry)
    return text


class ExpertHeatView(Vertical):
    """The summary line, the legend, the column titles and the rows (which scroll)."""

    DEFAULT_CSS = """
    ExpertHeatView {
        & #heat-summary { height: auto; }
        & #heat-legend { height: auto; color: $text-muted; margin-bottom: 1; }
        & #heat-header { height: 1; color: $text-muted; text-style: bold; text-wrap: nowrap; }
        & #heat-scroll { height: 1fr; scrollbar-size-vertical: 1; }
    }
    """

    def compose(self) -> ComposeResult:
        yield Static("", id="heat-summary", markup=False)
        yield Static("", id="heat-legend", markup=False)
        yield HeatHeader("", id="heat-header", markup=False)
        with VerticalScroll(id="heat-scroll"):
            yield HeatRows(id="heat-rows")

    legend_width = 0  # the width the legend was packed for

    def show(self, metrics: LiveMetrics) -> None:
        rows = self.query_one(HeatRows)
        rows.show(metrics.expert_heat)
        width = rows.size.width or self.query_one("#heat-scroll").size.width
        if self.size.width != self.legend_width:
            self.legend_width = self.size.width
            self.query_one("#heat-legend", Static).update(legend_text(rows, self.size.width))
        self.query_one("#heat-summary", Static).update(summary_line(metrics))
        self.query_one(HeatHeader).show(rows, width)
