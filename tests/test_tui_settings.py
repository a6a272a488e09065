"""The settings dialog (F2), issue 35 item 6: the first field has the focus, one Save/Cancel row
whatever the scroll, and an empty page-cache field says what it keeps."""

from __future__ import annotations

import pytest
from test_bad_inputs_app import shown
from test_one_name import _build
from test_tui_app import make_app, ready, wait_until
from textual.containers import VerticalScroll
from textual.widgets import Input

from edge0_tui.screens.settings import SettingsScreen


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
async def test_settings_open_on_the_first_field_with_one_row_of_buttons(
    checkpoint_dir, tmp_path, size
):
    app = make_app(checkpoint_dir("qwen3_moe", "tiny"), tmp_path)
    async with app.run_test(size=size) as pilot:
        await ready(app, pilot)
        await pilot.press("f2")
        await wait_until(pilot, lambda: isinstance(app.screen, SettingsScreen), "the settings")
        await pilot.pause(0.2)
        assert app.screen.focused is app.screen.query_one("#temperature", Input)
        assert "temperature (0 is greedy)" in shown(app)  # its label in view, not scrolled off
        await pilot.press("3")  # typing goes to the field
        assert app.screen.query_one("#temperature", Input).value.endswith("3")
        fields = app.screen.query_one("#settings-fields", VerticalScroll)
        for _ in range(2):
            assert shown(app).count("Save") == 1 and shown(app).count("Cancel") == 1
            fields.scroll_end(animate=False)
            await pilot.pause()
        assert fields.max_scroll_y == 0 or fields.scroll_y == fields.max_scroll_y


async def test_the_empty_page_cache_field_says_the_demo_runs_with_4m(tmp_path):
    app = _build(["demo"], tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.chat_screen.controller.ready, "the demo", timeout=30)
        await pilot.press("f2")
        await wait_until(pilot, lambda: isinstance(app.screen, SettingsScreen), "the settings")
        box = app.screen.query_one("#page_cache", Input)
        assert box.value == "" and box.placeholder == "empty: this model's default (4.00 MiB now)"
        await pilot.press("escape")
        app.chat_screen.controller.set_page_cache(8 << 20)  # as Save does with 8M typed in
        await pilot.press("f2")
        await wait_until(pilot, lambda: isinstance(app.screen, SettingsScreen), "the settings")
        assert "(8.00 MiB now)" in app.screen.query_one("#page_cache", Input).placeholder
