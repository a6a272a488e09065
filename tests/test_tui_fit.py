"""Text that fits where it is shown (issue 35 item 2), on the real app through Pilot: dialogs wrap,
the side panel uses the width it has, its lines are not cut and units stay beside their numbers;
and the memory plan's line is in the memory panel (issue 31).

What the terminal would show is read from the screen's compositor (`shown`), as a user sees it.
"""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest
from adapters import write_random_profile
from test_bad_inputs_app import shown
from test_tui_app import make_app, ready, reply_done, send, wait_until
from textual.widget import Widget
from textual.widgets import Input, Label

from edge0_tui.app import Edge0App
from edge0_tui.screens.confirm import ConfirmScreen
from edge0_tui.screens.settings import SettingsScreen
from edge0_tui.widgets.memory_bar import MemoryBar
from edge0_tui.widgets.metrics_panel import MetricsPanel
from engine import MODES

SIZES = [(80, 24), (120, 40), (160, 48), (200, 60)]


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


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
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
        for label in screen.query_one(MetricsPanel).query(Label):
            assert_whole(label)
        assert str(screen.query_one("#prefill", Label).content).startswith("prefill, ")
        bar = screen.query_one(MemoryBar)
        legend_rows = str(bar.render()).count("\n") + 1
        assert bar.size.height == legend_rows  # no legend line wrapped (a unit on its own row)


async def test_the_memory_panel_shows_the_plan_as_generate_prints_it(model_with_heads, tmp_path):
    app = make_app(model_with_heads, tmp_path)
    async with app.run_test(size=(160, 48)) as pilot:
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
        # An empty page-cache field says what it keeps: the budget running now.
        await pilot.press("f2")
        await wait_until(pilot, lambda: "page_cache" in str(app.screen.query("#page_cache")), "")
        box = app.screen.query_one("#page_cache", Input)
        assert box.value == "" and "off now" in box.placeholder
