"""The memory bar: where the machine's memory is, split five ways, with a legend in bytes.

MLX active | MLX cache | checkpoint in page cache | other used | free. The first two are what MLX
holds (the model's resident weights, experts and KV cache; freed buffers MLX keeps for reuse). The
checkpoint's pages in the OS page cache are reclaimable: the kernel drops them under pressure, which
is exactly when expert loads turn cold and slow. "Other used" is everything else not reclaimable.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.widget import Widget

from engine import format_bytes

from ..live_metrics import LiveMetrics
from ..system_memory import SystemMemory


@dataclass(frozen=True)
class MemorySegment:
    name: str
    nbytes: int
    style_class: str  # component class giving its colour


@dataclass(frozen=True)
class MemoryBreakdown:
    total_bytes: int
    source: str  # "RAM" or the cgroup limit the total comes from
    segments: tuple[MemorySegment, ...]

    @classmethod
    def of(cls, metrics: LiveMetrics, system: SystemMemory) -> MemoryBreakdown:
        step = metrics.last_step
        total = system.total_bytes
        active = step.mlx_active_bytes if step else 0
        cache = step.mlx_cache_bytes if step else 0
        checkpoint = step.page_cache_expert_bytes if step else 0
        # MLX's memory is part of the system's used memory; the rest of it is "other". Clamp so
        # the parts never add up past the total (the page cache figure and the used figure come
        # from different probes at different moments).
        other = max(0, (system.used_bytes or 0) - active - cache)
        other = min(other, max(0, total - active - cache - checkpoint))
        free = max(0, total - active - cache - checkpoint - other)
        segments = (
            MemorySegment("MLX active", active, "memory-bar--mlx-active"),
            MemorySegment("MLX cache", cache, "memory-bar--mlx-cache"),
            MemorySegment("checkpoint in page cache", checkpoint, "memory-bar--checkpoint"),
            MemorySegment("other used", other, "memory-bar--other"),
            MemorySegment("free", free, "memory-bar--free"),
        )
        return cls(total, system.source, segments)


def bar_cells(sizes: list[int], width: int) -> list[int]:
    """Split `width` cells in proportion to `sizes` (largest remainder: the cells add up)."""
    total = sum(sizes)
    if total <= 0 or width <= 0:
        return [0] * len(sizes)
    exact = [s * width / total for s in sizes]
    cells = [int(x) for x in exact]
    by_remainder = sorted(range(len(sizes)), key=lambda i: exact[i] - cells[i], reverse=True)
    for i in by_remainder[: width - sum(cells)]:
        cells[i] += 1
    return cells


class MemoryBar(Widget):
    COMPONENT_CLASSES = {
        "memory-bar--mlx-active",
        "memory-bar--mlx-cache",
        "memory-bar--checkpoint",
        "memory-bar--other",
        "memory-bar--free",
    }
    DEFAULT_CSS = """
    MemoryBar {
        height: auto;
        & > .memory-bar--mlx-active { color: $error; }
        & > .memory-bar--mlx-cache { color: $warning; }
        & > .memory-bar--checkpoint { color: $accent; }
        & > .memory-bar--other { color: $secondary; }
        & > .memory-bar--free { color: $surface-lighten-2; }
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.breakdown: MemoryBreakdown | None = None

    def show(self, breakdown: MemoryBreakdown) -> None:
        if breakdown != self.breakdown:
            # The legend's lines appear with the first figures: only then does the height change.
            self.refresh(layout=self.breakdown is None)
            self.breakdown = breakdown

    def render(self) -> Text:
        if self.breakdown is None:
            return Text("…", style="dim")
        segments = self.breakdown.segments
        styles = [self.get_component_rich_style(s.style_class) for s in segments]
        text = Text()
        for cells, style in zip(bar_cells([s.nbytes for s in segments], self.size.width), styles):
            text.append("█" * cells, style)
        # "■ name" on the left, the size flush right: the legend fits whatever the panel's width.
        name_width = max(8, self.size.width - 2 - 11)
        for segment, style in zip(segments, styles):
            name = (
                segment.name
                if len(segment.name) <= name_width
                else segment.name[: name_width - 1] + "…"
            )
            text.append("\n■ ", style)
            text.append(f"{name:<{name_width}}{format_bytes(segment.nbytes):>11}")
        text.append(f"\n  of {format_bytes(self.breakdown.total_bytes)} ({self.breakdown.source})")
        return text
