"""The expert heat view (F7), driven through Pilot on the real app and a real tiny engine: it opens
with one key and closes with Escape, has a row per MoE layer, shows after a reply the experts the
engine routed (its own routing trace) and the pool's content, updates while a reply streams, bins
experts when they do not fit, and fits 80x24 to 160x48."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_bad_inputs_app import shown
from test_tui_app import (
    LONG,
    SHORT,
    SIZE,
    SNAPSHOT,
    check_snapshot,
    make_app,
    ready,
    reply_done,
    reply_streaming,
    send,
    wait_until,
)
from textual.widgets import Static
from textual.widgets._footer import FooterKey

import engine.train.synth as synth
from edge0_tui.app import Edge0App
from edge0_tui.live_metrics import LiveMetrics
from edge0_tui.screens.chat import ChatScreen
from edge0_tui.screens.expert_heat import ExpertHeatScreen
from edge0_tui.widgets.expert_heat import (
    GLYPHS,
    LEGEND,
    OUT,
    POOLED,
    HeatHeader,
    HeatRows,
    binned,
    heat_layout,
)
from engine import EngineConfig, ExpertEvent, HeatPicture
from engine.train.synth_families import SHAPES

USED_GLYPHS = {GLYPHS[e] for e in ExpertEvent if e >= ExpertEvent.HIT}


@pytest.fixture
def model(checkpoint_dir) -> Path:
    return checkpoint_dir("qwen3_moe", "tiny")


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> Path:
    """A tiny-shaped qwen3_moe with 128 experts in 24 MoE layers: more experts than 80 columns
    hold, more layers than 24 rows show."""
    shape = {**SHAPES["tiny"], "experts": 128, "layers": 24}
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(SHAPES, "wide", shape)
        patch.setattr(synth, "family_presets", lambda family: ("tiny", "small", "wide"))
        out = tmp_path_factory.mktemp("wide") / "qwen3_moe-wide"
        return synth.write_synthetic_checkpoint(out, "qwen3_moe", "wide")


def rows_text(app: Edge0App) -> list[str]:
    """The rows as drawn: one line per MoE layer."""
    return str(app.screen.query_one(HeatRows).render()).split("\n")


def cells_of(line: str, rows: HeatRows, width: int) -> str:
    """A row's cells, one character each (the space after each dropped where cells are 2 wide)."""
    layout = rows.layout_for(width)
    start = rows.label_width() + 2
    drawn = line[start : start + layout.cells * layout.cell_width]
    return drawn[:: layout.cell_width]


def summary_of(line: str) -> list[int]:
    return [int(n) for n in line.split()[-4:]]


async def open_heat(app: Edge0App, pilot) -> HeatRows:
    await pilot.press("f7")
    await wait_until(pilot, lambda: isinstance(app.screen, ExpertHeatScreen), "the heat view")
    await pilot.pause()
    return app.screen.query_one(HeatRows)


async def test_f7_opens_the_view_with_a_row_per_moe_layer_and_escape_closes_it(model, tmp_path):
    app = make_app(model, tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(app, pilot)
        # In the footer at 80 columns, before the keys that get cut.
        assert "f7" in [key.key for key in app.screen.query(FooterKey)]
        await open_heat(app, pilot)
        summary = str(app.screen.query_one("#heat-summary", Static).render())
        assert summary.startswith("No step yet")
        await pilot.press("escape")
        assert isinstance(app.screen, ChatScreen)

        await send(app, pilot, "hi")
        await reply_done(app, pilot)
        rows = await open_heat(app, pilot)
        moe_layers = sorted(app.session.engine.loaded.index.layers)
        await wait_until(pilot, lambda: rows.picture is not None, "the picture")
        assert list(rows.picture.layers) == moe_layers
        drawn = rows_text(app)
        assert [int(line.split()[0]) for line in drawn] == moe_layers
        await pilot.press("f1")  # the keys panel lists the view's keys
        table = app.screen.query_one("HelpPanel BindingsTable").render_bindings_table()
        keys = [str(cell) for cell in table.columns[0].cells]
        assert any(k.startswith("esc") for k in keys) and any(k.startswith("f7") for k in keys)
        await pilot.press("f1")
        await pilot.press("f7")  # F7 again closes it too
        assert isinstance(app.screen, ChatScreen)
        # And the palette has it.
        command = next(c for c in app.get_system_commands(app.screen) if c.title == "Expert heat")
        command.callback()
        await pilot.pause()
        assert isinstance(app.screen, ExpertHeatScreen)


async def test_after_a_reply_the_cells_show_what_the_engine_routed_and_the_pool(model, tmp_path):
    app = make_app(model, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        engine = app.session.engine
        engine.store.trace = []  # the engine's own record of what each layer routed, per step
        await send(app, pilot, "hi")
        await reply_done(app, pilot)
        rows = await open_heat(app, pilot)
        picture = app.session.metrics.expert_heat
        assert rows.picture is picture
        last_step = max(step for step, _, _ in engine.store.trace)
        assert picture.step == last_step  # the reply's last step, kept after it ended
        table = app.session.metrics.last_step.routed_by_layer
        pool = set(engine.store.pool.keys())  # the engine is idle: read from here
        width = rows.size.width
        assert rows.layout_for(width).per_cell == 1  # 16 experts fit 120 columns
        for row, line in enumerate(rows_text(app)):
            layer = picture.layers[row]
            cells = cells_of(line, rows, width)
            routed = set().union(
                *(set(ex) for s, n, ex in engine.store.trace if s == last_step and n == layer)
            )
            assert {e for e, glyph in enumerate(cells) if glyph in USED_GLYPHS} == routed
            ahead_unused = {e for e, g in enumerate(cells) if g == GLYPHS[ExpertEvent.AHEAD_UNUSED]}
            pooled = {e for (n, e) in pool if n == layer}
            assert {e for e, g in enumerate(cells) if g == GLYPHS[POOLED]} == (
                pooled - routed - ahead_unused
            )
            assert {e for e, g in enumerate(cells) if g == GLYPHS[OUT]} == (
                set(range(len(cells))) - pooled - routed - ahead_unused
            )
            hit, ahead, warm, cold = summary_of(line)
            counts = table[layer]
            assert hit == counts["resident"]
            assert ahead == counts["heads"] + counts["lookahead"]
            assert warm + cold == counts["missed"]
        # Shading: every expert routed in the last step was used lately.
        for row in range(len(picture.layers)):
            assert all(picture.use[row, e] > 0 for e in picture.routed(row))


async def test_the_view_updates_while_a_reply_streams(model, tmp_path):
    app = make_app(model, tmp_path, LONG)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        await send(app, pilot, "tell me a long story")
        await reply_streaming(app, pilot)
        rows = await open_heat(app, pilot)
        summary = app.screen.query_one("#heat-summary", Static)
        await wait_until(pilot, lambda: rows.picture is not None, "a first picture")
        first = rows.picture.step
        await wait_until(pilot, lambda: rows.picture.step > first, "a later step's picture")
        assert app.chat_screen.reply is not None  # still writing
        assert str(summary.render()).startswith(f"step {rows.picture.step} ")
        await pilot.press("escape")  # closes the view; the reply goes on
        assert isinstance(app.screen, ChatScreen) and app.chat_screen.reply is not None
        await pilot.press("escape")  # now stops the reply
        await reply_done(app, pilot)


async def test_experts_are_binned_and_layers_scroll_at_80x24(wide_model, tmp_path):
    app = make_app(wide_model, tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(app, pilot)
        await send(app, pilot, "hi")
        await reply_done(app, pilot)
        rows = await open_heat(app, pilot)
        picture = rows.picture
        assert picture.experts[0] == 128 and len(picture.layers) == 24
        width = rows.size.width
        layout = rows.layout_for(width)
        assert layout.per_cell > 1 and layout.cells * layout.per_cell >= 128
        header = str(app.screen.query_one(HeatHeader).render())
        assert f"{layout.per_cell} a cell" in header
        drawn = rows_text(app)
        assert all(len(line) <= width for line in drawn)
        for row, line in enumerate(drawn):
            cells = cells_of(line, rows, width)
            used_cells = {e // layout.per_cell for e in picture.routed(row)}
            # A cell shows a used glyph exactly where it holds a routed expert.
            assert {c for c, glyph in enumerate(cells) if glyph in USED_GLYPHS} == used_cells
        # The layers that do not fit scroll into view.
        scroll = app.screen.query_one("#heat-scroll")
        assert scroll.virtual_size.height == 24 > scroll.size.height
        scroll.scroll_end(animate=False)
        await pilot.pause()
        assert scroll.scroll_y > 0


def test_binning_keeps_the_most_telling_event_and_the_hottest_use():
    picture = HeatPicture(
        layers=(0, 1),
        experts=(5, 3),
        events=np.array([[2, 5, 0, 1, 0], [3, 0, 0, 0, 0]], np.uint8),
        pooled=np.array([[1, 0, 0, 0, 1], [0, 0, 1, 0, 0]], bool),
        use=np.array([[10, 200, 0, 0, 30], [0, 0, 0, 0, 0]], np.uint8),
        step=1,
        counted_steps=1,
        blocked_ms=0.0,
    )
    layout = heat_layout(5, 3)
    assert (layout.per_cell, layout.cells, layout.cell_width) == (2, 3, 1)
    cells = binned(picture, layout)
    assert cells.events.tolist() == [[5, 1, 0], [3, 0, 0]]
    assert cells.pooled.tolist() == [[True, False, True], [False, True, False]]
    assert cells.use.tolist() == [[200, 0, 30], [0, 0, 0]]
    assert cells.valid.tolist() == [[True, True, True], [True, True, False]]
    assert heat_layout(16, 40) == heat_layout(16, 32)  # two columns an expert where it fits
    assert heat_layout(16, 31).cell_width == 1


async def test_the_view_fits_from_80x24_to_200x60(wide_model, tmp_path):
    """What the terminal shows (the compositor's lines) at each size: the summary, every legend
    entry whole, the column titles, and the first rows with their counts."""
    app = make_app(wide_model, tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(app, pilot)
        await send(app, pilot, "hi")
        await reply_done(app, pilot)
        rows = await open_heat(app, pilot)
        for size in ((80, 24), (120, 40), (160, 48), (200, 60)):
            await pilot.resize_terminal(*size)
            await pilot.pause(0.3)  # a refresh of the view at the new width
            width = rows.size.width
            assert app.screen.size == size and 0 < width <= size[0]
            drawn = rows_text(app)
            assert len(drawn) == 24 and all(len(line) <= width for line in drawn)
            header = str(app.screen.query_one(HeatHeader).render())
            assert len(header) <= width and header.split()[-4:] == ["hit", "ahead", "warm", "cold"]
            # The view's lines (summary, legend) never push the rows off the screen.
            scroll = app.screen.query_one("#heat-scroll")
            assert scroll.size.height >= 5
            screen = shown(app).split("\n")
            assert any(line.startswith("step ") and "blocked" in line for line in screen)
            for glyph, what in [(GLYPHS[kind], what) for kind, what in LEGEND]:
                assert any(f"{glyph} {what}" in line for line in screen), (size, what)
            assert any("use lately (half-life 16 tokens): rare" in line for line in screen)
            assert any(line.startswith(header.rstrip()) for line in screen)
            visible = min(24, scroll.size.height)
            for line in drawn[:visible]:
                assert any(s.startswith(line.rstrip()) for s in screen), line


async def test_heat_view_snapshot(model, tmp_path):
    """The view at 80x24 with a fixed picture matches the stored SVG (EDGE0_UPDATE_SNAPSHOTS=1
    rewrites it; look at it before committing)."""
    snapshot = SNAPSHOT.with_name("tui_expert_heat_80x24.svg")
    rng = np.random.default_rng(0)
    events = rng.choice(
        np.arange(6, dtype=np.uint8), size=(6, 32), p=[0.7, 0.05, 0.1, 0.05, 0.05, 0.05]
    )
    picture = HeatPicture(
        layers=tuple(range(0, 12, 2)),
        experts=(32,) * 6,
        events=events,
        pooled=rng.random((6, 32)) < 0.4,
        use=rng.integers(0, 256, (6, 32), dtype=np.uint8) * (rng.random((6, 32)) < 0.5),
        step=42,
        counted_steps=40,
        blocked_ms=3.5,
    )
    app = make_app(model, tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(app, pilot)
        await open_heat(app, pilot)
        screen = app.screen
        screen.timer.pause()
        screen.query_one("ExpertHeatView").show(
            LiveMetrics(k=4, mode="on-demand", expert_heat=picture)
        )
        await pilot.pause()
        svg = app.export_screenshot(title="edge0 expert heat")
    check_snapshot(svg, snapshot, tmp_path, "the heat view")


async def test_resident_mode_says_there_is_nothing_to_show(model, tmp_path):
    app = Edge0App(
        model=str(model),
        engine_config=EngineConfig(mode="resident"),
        data_dir=tmp_path,
        cache_dir=tmp_path / "cache",
        settings=SHORT,
    )
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        await send(app, pilot, "hi")
        await reply_done(app, pilot)
        rows = await open_heat(app, pilot)
        assert rows.picture is None and app.session.metrics.expert_heat is None
        summary = str(app.screen.query_one("#heat-summary", Static).render())
        assert summary.startswith("Resident mode: every expert is in memory")
