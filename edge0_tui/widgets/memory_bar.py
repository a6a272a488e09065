"""The memory bar: edge0's own memory, split by what the OS can take back, with a legend in bytes.

The bar's full width is edge0's memory, so a small model's figures are as visible as a large one's;
the machine's total and use are text beneath it. Three parts:

- not reclaimable: what MLX holds, active (weights, resident experts, KV cache) and cached (freed
  buffers MLX keeps for reuse). On a Mac it is wired memory; on Linux, anonymous memory. Neither
  goes back to the OS under pressure.
- reclaimable: the checkpoint's bytes in the OS page cache. The OS drops them under pressure, which
  is exactly when expert loads turn cold and slow.
- the rest of edge0: the process's resident memory outside MLX (Python, the tokenizer, the UI).
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.widget import Widget

from engine import format_bytes

from ..live_metrics import LiveMetrics
from ..system_memory import SystemMemory

TOOLTIP = (
    "edge0's memory. Not reclaimable: MLX's active memory and buffer cache (wired on a Mac). "
    "Reclaimable: the checkpoint's pages in the OS page cache, dropped first under pressure. "
    "Rest: the process's resident memory outside MLX. Below: the machine's total and use."
)


@dataclass(frozen=True)
class MemorySegment:
    name: str
    nbytes: int
    style_class: str  # component class giving its colour
    detail: str = ""  # a second legend line: what the figure is made of


@dataclass(frozen=True)
class MemoryBreakdown:
    # edge0's own memory: the bar's full width is their sum.
    segments: tuple[MemorySegment, ...]
    # The machine (or cgroup) edge0 runs in, shown as text beside the bar.
    system: SystemMemory
    # On a Mac: how much memory Metal lets MLX wire (None elsewhere).
    wired_limit_bytes: int | None = None

    @property
    def own_bytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    @classmethod
    def of(
        cls, metrics: LiveMetrics, system: SystemMemory, wired_limit_bytes: int | None = None
    ) -> MemoryBreakdown:
        step = metrics.last_step or metrics.loaded_memory  # before the first forward: the load's
        active = step.mlx_active_bytes if step else 0
        cache = step.mlx_cache_bytes if step else 0
        checkpoint = step.page_cache_expert_bytes if step else 0
        # MLX's buffers live in the process, so RSS counts them; the checkpoint is read with
        # pread, not mapped, so its page cache is not in RSS. Clamp: the figures are read at
        # slightly different moments.
        rest = max(0, (step.rss_bytes if step else 0) - active - cache)
        segments = (
            MemorySegment(
                "MLX, not reclaimable",
                active + cache,
                "memory-bar--wired",
                f"active {format_bytes(active)}, cache {format_bytes(cache)}",
            ),
            MemorySegment("checkpoint, reclaimable", checkpoint, "memory-bar--reclaimable"),
            MemorySegment("rest of edge0", rest, "memory-bar--rest"),
        )
        return cls(segments, system, wired_limit_bytes)


def bar_cells(sizes: list[int], width: int) -> list[int]:
    """Split `width` cells in proportion to `sizes` (largest remainder: the cells add up).

    A part too small for a whole cell still gets one, taken from the largest, so no figure in the
    legend is missing from the bar.
    """
    total = sum(sizes)
    if total <= 0 or width <= 0:
        return [0] * len(sizes)
    exact = [s * width / total for s in sizes]
    cells = [int(x) for x in exact]
    by_remainder = sorted(range(len(sizes)), key=lambda i: exact[i] - cells[i], reverse=True)
    for i in by_remainder[: width - sum(cells)]:
        cells[i] += 1
    for i, size in enumerate(sizes):
        largest = max(range(len(cells)), key=lambda j: cells[j])
        if size > 0 and cells[i] == 0 and cells[largest] > 1:
            cells[i], cells[largest] = 1, cells[largest] - 1
    return cells


def machine_lines(system: SystemMemory, own_bytes: int) -> tuple[str, str]:
    """The two text lines under the legend: the machine's total, then its use."""
    share = f" (edge0 {own_bytes / system.total_bytes:.0%})" if system.total_bytes else ""
    total = f"of {format_bytes(system.total_bytes)} {system.source}{share}"
    if system.used_bytes is None:
        return total, "machine use unknown here"
    used = f"used {format_bytes(system.used_bytes)}"
    if system.file_cache_bytes is None:
        return total, used
    return total, f"{used}, file cache {format_bytes(system.file_cache_bytes)}"


def fitted(line: str, width: int) -> list[str]:
    """`line` as rows of at most `width`, broken after its commas (between "used ..." and "file
    cache ..."), so a figure keeps its unit; a part longer than `width` alone is left to be cut."""
    rows: list[str] = []
    for part in line.split(", "):
        if rows and len(rows[-1]) + 2 + len(part) <= width:
            rows[-1] += ", " + part
        else:
            if rows:
                rows[-1] += ","
            rows.append(part)
    return rows


class MemoryBar(Widget):
    COMPONENT_CLASSES = {
        "memory-bar--wired",
        "memory-bar--reclaimable",
        "memory-bar--rest",
        "memory-bar--empty",
        "memory-bar--detail",
    }
    # Red for what cannot be given back, green for what can: the three differ in every built-in
    # theme (tests/test_memory_bar.py checks), where $warning and $accent do not.
    DEFAULT_CSS = """
    MemoryBar {
        height: auto;
        /* A legend line longer than the panel is cut, never wrapped (a unit on its own line). */
        text-wrap: nowrap;
        text-overflow: ellipsis;
        & > .memory-bar--wired { color: $error; }
        & > .memory-bar--reclaimable { color: $success; }
        & > .memory-bar--rest { color: $primary; }
        & > .memory-bar--empty { color: $text-muted; }
        & > .memory-bar--detail { color: $text-muted; }
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.breakdown: MemoryBreakdown | None = None
        self.tooltip = TOOLTIP

    def show(self, breakdown: MemoryBreakdown) -> None:
        if breakdown != self.breakdown:
            # The legend's lines appear with the first figures: only then does the height change.
            self.refresh(layout=self.breakdown is None)
            self.breakdown = breakdown

    def render(self) -> Text:
        if self.breakdown is None:
            return Text("…", style="dim")
        width = self.size.width
        segments = self.breakdown.segments
        styles = [self.get_component_rich_style(s.style_class) for s in segments]
        detail_style = self.get_component_rich_style("memory-bar--detail")
        # Long lines are cut, not wrapped: the legend keeps its height whatever the panel's width.
        text = Text(no_wrap=True, overflow="ellipsis")
        if self.breakdown.own_bytes == 0:
            text.append("─" * width, self.get_component_rich_style("memory-bar--empty"))
        for cells, style in zip(bar_cells([s.nbytes for s in segments], width), styles):
            text.append("█" * cells, style)
        for segment, style in zip(segments, styles):
            size = format_bytes(segment.nbytes)
            # "■ name" on the left, the size flush right.
            name_width = max(8, width - 3 - len(size))
            name = (
                segment.name
                if len(segment.name) <= name_width
                else segment.name[: name_width - 1] + "…"
            )
            text.append("\n■ ", style)
            text.append(f"{name:<{name_width}} {size}")
            for line in fitted(segment.detail, width - 2) if segment.detail else ():
                text.append(f"\n  {line}", detail_style)
        for machine_line in machine_lines(self.breakdown.system, self.breakdown.own_bytes):
            for line in fitted(machine_line, width - 2):
                text.append(f"\n  {line}")
        if self.breakdown.wired_limit_bytes:
            text.append(f"\n  Metal wired limit {format_bytes(self.breakdown.wired_limit_bytes)}")
        return text
