"""The memory bar: edge0's own memory split by what the OS can take back, readable in every theme
and on a small model (issue 17, item 2)."""

from __future__ import annotations

import itertools

from rich.color import Color as RichColor
from rich.text import Text
from test_tui_parts import _step
from textual.app import App, ComposeResult

from edge0_tui.live_metrics import LiveMetrics
from edge0_tui.system_memory import SystemMemory
from edge0_tui.widgets.memory_bar import MemoryBar, MemoryBreakdown, bar_cells, machine_lines

MIB, GIB = 1 << 20, 1 << 30
SEGMENT_CLASSES = ("memory-bar--wired", "memory-bar--reclaimable", "memory-bar--rest")
# The demo model's figures: tens of MiB on a machine with tens of GiB.
DEMO_STEP = _step(
    mlx_active_bytes=30 * MIB,
    mlx_cache_bytes=4 * MIB,
    page_cache_expert_bytes=14 * MIB,
    rss_bytes=300 * MIB,
)
MACHINE = SystemMemory(24 * GIB, 9 * GIB, "RAM", file_cache_bytes=6 * GIB, free_bytes=3 * GIB)
# Below this RGB distance two truecolor segments would be hard to tell apart side by side (the
# closest pair in the built-in themes, rose-pine's cyan and lavender, is 58 apart).
MIN_COLOUR_DISTANCE = 50


class BarApp(App):
    CSS = "MemoryBar { width: 41; }"

    def compose(self) -> ComposeResult:
        yield MemoryBar()


def demo_breakdown() -> MemoryBreakdown:
    return MemoryBreakdown.of(LiveMetrics(last_step=DEMO_STEP), MACHINE)


def test_breakdown_is_edge0s_own_memory_split_by_reclaimability():
    breakdown = demo_breakdown()
    assert {s.name: s.nbytes for s in breakdown.segments} == {
        "MLX, not reclaimable": 34 * MIB,
        "checkpoint, reclaimable": 14 * MIB,
        "rest of edge0": 266 * MIB,  # RSS less the MLX buffers it holds
    }
    assert breakdown.own_bytes == 314 * MIB
    # What the figure is made of (wired on a Mac, anonymous memory on Linux: the name says
    # "not reclaimable" for both), short enough for the narrow panel with KiB figures.
    assert breakdown.segments[0].detail == "active 30.00 MiB, cache 4.00 MiB"
    # RSS read a moment before MLX grew: the rest is clamped, never negative.
    early = _step(mlx_active_bytes=GIB, rss_bytes=GIB // 2)
    rest = MemoryBreakdown.of(LiveMetrics(last_step=early), MACHINE).segments[2]
    assert rest.nbytes == 0
    # Before the first step everything is zero, and nothing fails.
    assert MemoryBreakdown.of(LiveMetrics(), MACHINE).own_bytes == 0


def test_bar_cells_give_a_tiny_part_one_cell():
    cells = bar_cells([1000, 1, 0], 40)
    assert cells == [39, 1, 0]
    assert bar_cells([1, 1], 1) == [1, 0]  # no room for both: the cells still add up


def test_machine_lines_say_the_total_and_use():
    total, use = machine_lines(MACHINE, 314 * MIB)
    assert total == "of 24.00 GiB RAM (edge0 1%)"
    assert use == "used 9.00 GiB, file cache 6.00 GiB"
    limited = SystemMemory(4 * GIB, GIB, "cgroup v2 limit")
    assert machine_lines(limited, GIB) == (
        "of 4.00 GiB cgroup v2 limit (edge0 25%)",
        "used 1.00 GiB",
    )
    assert machine_lines(SystemMemory(8 * GIB, None, "RAM"), 0)[1] == "machine use unknown here"


def _bar_cells_by_colour(rendered: Text) -> dict[RichColor, int]:
    """How many cells of the bar's line each colour takes."""
    bar_line = rendered.split("\n")[0]
    cells: dict[RichColor, int] = {}
    for span in bar_line.spans:
        cells[span.style.color] = cells.get(span.style.color, 0) + span.end - span.start
    return cells


async def test_a_small_models_figures_fill_the_bar_and_the_legend_is_in_bytes():
    app = BarApp()
    async with app.run_test(size=(60, 20)) as pilot:
        bar = app.query_one(MemoryBar)
        bar.show(demo_breakdown())
        await pilot.pause()
        rendered = bar.render()
        colours = [bar.get_component_rich_style(c).color for c in SEGMENT_CLASSES]
        cells = _bar_cells_by_colour(rendered)
        # The full width is edge0's memory: every part shows, none is lost in "free".
        assert sum(cells.values()) == bar.size.width == 41
        assert all(cells.get(c, 0) >= 1 for c in colours)
        lines = rendered.plain.split("\n")
        assert lines[1].startswith("■ MLX, not reclaimable") and lines[1].endswith("34.00 MiB")
        assert lines[3].startswith("■ checkpoint, reclaimable") and lines[3].endswith("14.00 MiB")
        assert lines[4].startswith("■ rest of edge0") and lines[4].endswith("266.00 MiB")
        assert "of 24.00 GiB RAM" in rendered.plain
        assert all(len(line) <= 41 for line in lines)


async def test_before_the_first_step_the_bar_is_an_empty_line():
    app = BarApp()
    async with app.run_test(size=(60, 20)) as pilot:
        bar = app.query_one(MemoryBar)
        bar.show(MemoryBreakdown.of(LiveMetrics(), MACHINE))
        await pilot.pause()
        assert bar.render().plain.split("\n")[0] == "─" * 41


def _distance(a: RichColor, b: RichColor) -> float:
    return sum((x - y) ** 2 for x, y in zip(a.get_truecolor(), b.get_truecolor())) ** 0.5


async def test_segment_colours_differ_in_every_builtin_theme():
    app = BarApp()
    async with app.run_test(size=(60, 20)) as pilot:
        bar = app.query_one(MemoryBar)
        bar.show(demo_breakdown())
        for theme in app.available_themes:
            app.theme = theme
            await pilot.pause()
            colours = [bar.get_component_rich_style(c).color for c in SEGMENT_CLASSES]
            assert None not in colours, theme
            assert len(set(colours)) == len(colours), f"{theme}: {colours}"
            # ANSI themes name their colours (the terminal picks the RGB); the others must also
            # be far enough apart to tell apart at a glance.
            if all(c.triplet is not None for c in colours):
                for a, b in itertools.combinations(colours, 2):
                    assert _distance(a, b) >= MIN_COLOUR_DISTANCE, f"{theme}: {a} vs {b}"


async def test_a_macs_metal_wired_limit_is_shown_and_absent_elsewhere():
    from engine.runtime.metrics import metal_wired_limit_bytes

    assert metal_wired_limit_bytes() is None  # no Metal on this machine: no made-up figure
    app = BarApp()
    async with app.run_test(size=(60, 20)) as pilot:
        bar = app.query_one(MemoryBar)
        bar.show(MemoryBreakdown.of(LiveMetrics(last_step=DEMO_STEP), MACHINE, 11 << 30))
        await pilot.pause()
        assert "Metal wired limit 11.00 GiB" in bar.render().plain
        bar.show(demo_breakdown())
        await pilot.pause()
        assert "Metal wired limit" not in bar.render().plain


def test_the_memory_of_the_load_is_shown_before_the_first_forward(checkpoint_dir):
    """Before the first message (and after a model switch) the bar shows what the load holds,
    not 0 B; the first forward's figures take over from it."""
    import threading

    from edge0_tui.engine_service import EngineOpened, EngineService
    from engine import Engine, EngineConfig

    system = SystemMemory(total_bytes=8 << 30, used_bytes=4 << 30, source="RAM")
    opened = threading.Event()
    service = EngineService(
        lambda: Engine(checkpoint_dir(), EngineConfig()),
        lambda event: opened.set() if isinstance(event, EngineOpened) else None,
    )
    service.start()
    try:
        assert opened.wait(60)
        loaded = service.live.loaded_memory
        assert loaded is not None and loaded.mlx_active_bytes > 0 and loaded.rss_bytes > 0
        before = MemoryBreakdown.of(service.live, system)
        assert before.segments[0].nbytes == loaded.mlx_active_bytes + loaded.mlx_cache_bytes > 0
        assert before.own_bytes >= loaded.rss_bytes - 1
        after = MemoryBreakdown.of(LiveMetrics(last_step=_step(), loaded_memory=loaded), system)
        assert after.segments[0].nbytes != before.segments[0].nbytes  # the step's, not the load's
    finally:
        service.shutdown()
        assert service.closed.wait(60)
