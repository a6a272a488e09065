"""Text that fits where it is shown (issue 35 item 2), on the real app through Pilot: dialogs wrap,
the side panel uses the width it has, its lines are not cut and units stay beside their numbers;
and the memory plan's line is in the memory panel (issue 31). At every size from 80x24, with the
panels at their fullest, every panel line is on the screen whole, or its compact form is; the
footer shows whole keys, F1 among them, and F1 lists every key (issue 51 item 5).

What the terminal would show is read from the screen's compositor (`shown`), as a user sees it.
"""

from __future__ import annotations

import shutil
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
from adapters import write_random_profile
from test_bad_inputs_app import shown
from test_tui_app import FIXED_PLAN, fixed_metrics, make_app, ready, reply_done, send, wait_until
from textual.widget import Widget
from textual.widgets import Input, Label, RadioButton

from edge0_tui.app import Edge0App
from edge0_tui.live_metrics import LiveMetrics
from edge0_tui.screens.chat import ChatScreen
from edge0_tui.screens.confirm import ConfirmScreen
from edge0_tui.screens.settings import SettingsScreen
from edge0_tui.system_memory import SystemMemory
from edge0_tui.widgets.fitting_footer import FittingFooter
from edge0_tui.widgets.memory_bar import MemoryBar
from edge0_tui.widgets.metrics_panel import MetricsPanel
from edge0_tui.widgets.routing_selector import RoutingSelector
from edge0_tui.widgets.wall_strip import WallStrip
from engine import MODES

SIZES = [(80, 24), (120, 40), (160, 48), (200, 60)]
IDS = [f"{w}x{h}" for w, h in SIZES]
# A machine with big figures (the longest legend lines) and a file cache.
BIG_MACHINE = SystemMemory(128 << 30, 101 << 30, "RAM", file_cache_bytes=1023 << 20)


@pytest.fixture(scope="module")
def model_with_heads(checkpoint_dir, tmp_path_factory) -> Path:
    """The tiny model with K=2 heads: every mode is offered, prerouter's label the longest."""
    path = tmp_path_factory.mktemp("fit") / "model"
    shutil.copytree(checkpoint_dir("qwen3_moe", "tiny"), path)
    write_random_profile(path, 2)
    return path


def assert_whole(label: Label) -> None:
    """The label's text has the rows it needs at its width: nothing cut off at the right."""
    text, width = str(label.content), label.content_size.width
    # Textual wraps at spaces only.
    wrapper = textwrap.TextWrapper(width, break_on_hyphens=False, break_long_words=False)
    needed = sum(len(wrapper.wrap(line) or [""]) for line in text.splitlines() or [""])
    assert label.content_size.height >= needed, (
        f"{label!r} shows {label.content_size.height} row(s) of {width} columns; "
        f"{text!r} needs {needed}"
    )


def one_line(app: Edge0App, widget: Widget | None = None) -> str:
    """The screen's text (within `widget`'s region if given) with line breaks turned into single
    spaces, so a wrapped sentence reads as one."""
    rows = shown(app).splitlines()
    if widget is not None:
        region = (
            widget.content_region
        )  # the strips hold one character a cell here: no wide characters
        rows = [row[region.x : region.right] for row in rows[region.y : region.bottom]]
    return " ".join(" ".join(rows).split())


@pytest.mark.parametrize("size", SIZES, ids=IDS)
async def test_the_resident_question_and_the_settings_labels_wrap(model_with_heads, tmp_path, size):
    app = make_app(model_with_heads, tmp_path)
    async with app.run_test(size=size) as pilot:
        await ready(app, pilot)
        app.chat_screen.choose_mode("resident")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the question")
        await pilot.pause()
        question = app.screen.question
        assert question.endswith("The chat stays.")
        (shown_question,) = [w for w in app.screen.query(Label) if str(w.content) == question]
        assert one_line(app, shown_question) == question  # all of it on the screen
        await pilot.press("escape")
        await pilot.press("f2")
        await wait_until(pilot, lambda: isinstance(app.screen, SettingsScreen), "the settings")
        await pilot.pause()
        settings = app.screen
        for label in settings.query(Label):
            assert_whole(label)
        assert len(settings.query("#save")) == 1 and len(settings.query("#cancel")) == 1


@pytest.mark.parametrize("size", SIZES[1:], ids=[f"{w}x{h}" for w, h in SIZES[1:]])
async def test_the_side_panel_uses_its_width_and_cuts_nothing(model_with_heads, tmp_path, size):
    app = make_app(model_with_heads, tmp_path)
    async with app.run_test(size=size) as pilot:
        await ready(app, pilot)
        await send(app, pilot, "Tell me of the king and his daughters")
        await reply_done(app, pilot)
        await pilot.pause(0.4)  # a panel refresh with the reply's figures
        screen = app.chat_screen
        side = screen.query_one("#side")
        if size[0] >= 150:  # a share of a wide terminal, not a fixed 44 columns
            assert side.size.width > 44 + (size[0] - 160) // 10, side.size
        text = shown(app)
        for mode in MODES:
            button = screen.query_one(f"#mode-{mode}")
            assert str(button.label) in text, f"{mode} is cut or missing"
            assert side.region.contains_region(button.region), f"{mode} sticks out of the panel"
        for label in shown_labels(screen.query_one(MetricsPanel)):
            assert_whole(label)
        assert str(screen.query_one("#prefill", Label).content).startswith("prefill, ")
        bar = screen.query_one(MemoryBar)
        legend_rows = str(bar.render()).count("\n") + 1
        assert bar.size.height == legend_rows  # no legend line wrapped (a unit on its own row)


async def test_the_memory_panel_shows_the_plan_as_generate_prints_it(model_with_heads, tmp_path):
    app = make_app(model_with_heads, tmp_path)
    async with app.run_test(size=(200, 60)) as pilot:
        assert str(app.chat_screen.query_one("#memory-plan", Label).content) == ""
        await ready(app, pilot)
        label = app.chat_screen.query_one("#memory-plan", Label)

        def planned() -> bool:
            # generate's line, one term a line: rejoined, the same text.
            terms = str(label.content).split("\n")
            shown_line = terms[0] + " " + ", ".join(t.strip() for t in terms[1:])
            return shown_line == app.session.engine.memory_plan.line()

        await wait_until(pilot, planned, "the memory plan's line")
        await pilot.pause()
        assert str(label.content).startswith("memory plan: ")
        assert_whole(label)
        assert one_line(app, label) == " ".join(str(label.content).split())
        rows = [row.strip() for row in shown(app).splitlines()]
        assert not any(row.startswith(("B ", "KiB", "MiB", "GiB", "ms")) for row in rows)
        before = str(label.content)
        app.chat_screen.choose_k(2)  # a K switch plans another expert cache
        await wait_until(pilot, lambda: app.session.engine.k == 2, "K=2")
        await wait_until(pilot, planned, "the plan at K=2")
        assert "(K=2)" in str(label.content) and str(label.content) != before
        # The dense panels' form (under 56 rows) follows K too.
        short = str(app.chat_screen.query_one("#memory-plan-short", Label).content)
        assert short.startswith("memory plan: ") and "\n  expert cache (K=2) " in short
        # An empty page-cache field says what it keeps: the budget running now.
        await pilot.press("f2")
        await wait_until(pilot, lambda: "page_cache" in str(app.screen.query("#page_cache")), "")
        box = app.screen.query_one("#page_cache", Input)
        assert box.value == "" and "off now" in box.placeholder


def grown_metrics() -> LiveMetrics:
    """The decode panel at its fullest: a 48-layer model in prefetch, where each layer's experts
    came from and the lookahead's recall of each, and a prompt's prefill."""
    routed = {
        n: {"resident": 5, "lookahead": 2, "missed": 1, "guessed_right": n % 7, "guessed_of": 8}
        for n in range(48)
    }
    base = fixed_metrics()
    steps = tuple(replace(s, mode="prefetch", routed_by_layer=routed) for s in base.recent_steps)
    prefill = replace(steps[0], phase="prefill", tokens=1234, mib_read=987.6, blocked_ms=1234.0)
    return replace(
        base, mode="prefetch", last_step=steps[-1], recent_steps=steps, last_prefill=prefill
    )


async def show_grown_panels(app: Edge0App, pilot) -> ChatScreen:
    """Every panel line there can be, with fixed figures: the grown decode panel, the machine's
    and the plan's lines, and the K buttons with measured perplexities (an unrecovered K's `*`)."""
    screen = app.chat_screen
    screen.panel_timer.pause()  # the fixed figures stay
    selector = screen.query_one(RoutingSelector)
    await selector.set_choices(
        [replace(p, recovered=False) for p in selector.profiles], selector.modes, 2, "prefetch"
    )
    selector.set_quality(
        {p.k: {"heads only": 1.234, "heads + LoRA": 1.234} for p in selector.profiles}
    )
    screen.show_panels(grown_metrics(), BIG_MACHINE, FIXED_PLAN)
    await pilot.pause()
    return screen


def shown_labels(root: Widget) -> list[Label]:
    return [label for label in root.query(Label) if label.display and label.parent.display]


@pytest.mark.parametrize("size", SIZES, ids=IDS)
async def test_every_panel_line_is_shown_whole_at_every_size(model_with_heads, tmp_path, size):
    app = make_app(model_with_heads, tmp_path)
    async with app.run_test(size=size) as pilot:
        await ready(app, pilot)
        screen = await show_grown_panels(app, pilot)
        if screen.compact:  # the wall in one line, whole; F6 shows the panels instead
            strip = screen.query_one(WallStrip)
            text = str(strip.render())
            assert text and len(text) <= strip.content_size.width and text in shown(app)
            await pilot.press("f6")
            await pilot.pause()
        side = screen.query_one("#side")
        await wait_until(pilot, lambda: side.size.height > 0, "the panels")
        assert side.max_scroll_y == 0, f"{side.virtual_size.height} rows of panels, {side.size}"
        for label in shown_labels(side):
            assert_whole(label)
            assert side.region.contains_region(label.region), label
        # Column by column (side by side under F6), each rejoined into one line.
        everything = " ".join(
            one_line(app, column) for column in (screen.query_one(MetricsPanel), side.children[1])
        )
        # The compact forms: the speed in a line below 56 rows, the recall's mean and lowest
        # layer, the plan's total and its expert cache.
        assert "lookahead recall 0.37, lowest layer 0.00" in everything
        assert "prefill, 1234 tokens: 987.6 MiB read" in everything
        assert "memory plan: 2.23 GiB of 32.00 GiB" in everything
        assert "expert cache (K=4) 512.00 MiB" in everything
        if size[1] >= 56:  # the plan term by term
            assert "KV cache (8,192 tokens) 256.00 MiB" in everything
        bar = screen.query_one(MemoryBar)
        for line in str(bar.render()).splitlines():
            assert len(line) <= bar.content_size.width and "…" not in line, line
        for phrase in ("of 128.00 GiB RAM", "used 101.00 GiB,", "file cache 1023.00 MiB"):
            assert phrase in everything, phrase
        for button in side.query(RadioButton):
            assert side.region.contains_region(button.region), f"{button.label} sticks out"
            label = str(button.label)
            assert label in shown(app), f"{label!r} is cut"
        assert "2* +23%" in everything and "%: measured perplexity over native" in everything


@pytest.mark.parametrize("size", SIZES, ids=IDS)
async def test_the_footer_shows_whole_keys_and_f1_lists_every_key(model_with_heads, tmp_path, size):
    app = make_app(model_with_heads, tmp_path)
    async with app.run_test(size=size) as pilot:
        await ready(app, pilot)
        await send(app, pilot, "hello")  # a reply: Ctrl+R (write it again) is offered
        await reply_done(app, pilot)
        footer = app.screen.query_one(FittingFooter)
        await pilot.pause(0.1)
        shown_keys = [k for k in footer.binding_keys() if k.display]
        palette = footer.query_one(".-command-palette")
        assert [k.key for k in shown_keys][:6] == ["f4", "f5", "f6", "f7", "f1", "ctrl+q"]
        row = shown(app).splitlines()[-1]
        for key in shown_keys:
            assert key.region.right <= palette.region.x, f"{key.description} is cut"
            assert key.description in row
        if size[0] >= 200:  # every key whole, none left to F1 alone
            assert len(shown_keys) == len(footer.binding_keys())
        await pilot.press("f1")
        await pilot.pause()
        table = app.screen.query_one("HelpPanel BindingsTable").render_bindings_table()
        listed = " ".join(str(cell) for cell in table.columns[1].cells)
        keys = " ".join(str(cell) for cell in table.columns[0].cells)
        for binding in [*ChatScreen.BINDINGS, *Edge0App.BINDINGS]:
            if binding.show:
                assert binding.description in listed, binding.description
        assert "esc" in keys and "Stop reply" in listed
