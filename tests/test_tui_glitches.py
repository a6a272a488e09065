"""The small glitches of issue 35 item 9, on the real app through Pilot: a toast reaches the
screen's edge, the status line never shows zeros it has not measured, F4/F5 come back after a mode
reload, the list takes Down right after a rename, and a search shows where it matched."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_bad_inputs_app import shown
from test_tui_app import LONG, SIZE, make_app, ready, reply_done, status_text, wait_until
from textual.widgets import Input, Label, OptionList, ProgressBar, RadioButton
from textual.widgets._footer import FooterKey
from textual.widgets._toast import Toast

from edge0_tui.chat_store import ChatMessage, ChatStore
from edge0_tui.live_metrics import LiveMetrics
from edge0_tui.screens.chat_list import ChatListScreen, RenameScreen, match_snippet
from edge0_tui.screens.confirm import ConfirmScreen
from edge0_tui.screens.model_loading import ModelLoadingScreen
from edge0_tui.widgets.routing_selector import RoutingSelector
from edge0_tui.widgets.status_line import Status


@pytest.fixture
def model(checkpoint_dir) -> Path:
    return checkpoint_dir("qwen3_moe", "tiny")


async def test_a_toast_reaches_the_right_edge(model, tmp_path):
    app = make_app(model, tmp_path)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await ready(app, pilot)
        app.notify("a notice over the side panel")
        await wait_until(pilot, lambda: app.screen.query(Toast), "the toast")
        await pilot.pause(0.3)
        toast = app.screen.query(Toast).last()
        assert toast.region.right == SIZE[0], toast.region  # no panel column beside it
        rows = shown(app).splitlines()[toast.region.y : toast.region.bottom]
        assert all(not row.endswith("│") for row in rows)


def test_the_status_line_leaves_out_what_is_not_measured_yet():
    line = Status(model="m", state="writing…", k=4, mode="on-demand", context_tokens=None).line()
    assert "0 B" not in line and "peak" not in line and "context – tokens" in line
    line = Status(model="m", state="ready", peak_rss_bytes=3 << 20).line()
    assert "peak RSS 3.00 MiB" in line and "MLX" not in line


async def test_a_regenerate_right_after_the_load_shows_no_zeros(model, tmp_path):
    store = ChatStore(tmp_path)
    chat_id = store.create_chat("q", "m")
    store.add_message(chat_id, ChatMessage("user", "a question"))
    store.add_message(chat_id, ChatMessage("assistant", "an answer", "eos"))
    store.close()
    app = make_app(model, tmp_path, LONG)  # long enough to look while it is written
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        await wait_until(
            pilot, lambda: app.chat_screen.controller.chat_id == chat_id, "the reopened chat"
        )
        screen = app.chat_screen
        screen.panel_timer.pause()
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: screen.reply is not None, "the regenerate")
        # What the panels read before the engine's first step of this reply: nothing measured.
        screen.show_panels(LiveMetrics(k=4, mode="on-demand"), screen_memory())
        line = status_text(app)
        assert "context 0 tokens" not in line and "0 B" not in line, line
        screen.panel_timer.resume()
        await pilot.press("escape")
        await reply_done(app, pilot)


def screen_memory():
    from edge0_tui.system_memory import read_system_memory

    return read_system_memory()


async def test_f4_and_f5_come_back_in_the_footer_after_a_mode_reload(model, tmp_path):
    app = make_app(model, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)

        def footer() -> list[str]:
            return [key.key for key in app.screen.query(FooterKey)]

        assert footer()[:2] == ["f4", "f5"]
        app.chat_screen.choose_mode("resident")
        await wait_until(
            pilot,
            lambda: isinstance(app.screen, ConfirmScreen) and app.screen.query("#confirm"),
            "the question",
        )
        await pilot.click("#confirm")
        await wait_until(pilot, lambda: app.session.metrics.mode == "resident", "resident")
        await ready(app, pilot)
        await wait_until(pilot, lambda: footer()[:2] == ["f4", "f5"], "F4/F5 in the footer")
        await pilot.press("f5")  # back to streaming: another reload
        await wait_until(pilot, lambda: app.session.metrics.mode == "on-demand", "on-demand")
        await ready(app, pilot)
        await wait_until(pilot, lambda: footer()[:2] == ["f4", "f5"], "F4/F5 again")


async def test_down_moves_right_after_a_rename_and_a_search_shows_its_match(model, tmp_path):
    store = ChatStore(tmp_path)
    for title, words in [
        ("first", "nothing here"),
        ("second", "a long line of text before the King of France arrives at the door, late"),
        ("third", "kings and queens"),
    ]:
        chat = store.create_chat(title, "m")
        store.add_message(chat, ChatMessage("user", words))
    store.close()
    app = make_app(model, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        await pilot.press("ctrl+o")
        listing = app.screen
        assert isinstance(listing, ChatListScreen)
        options = listing.query_one(OptionList)
        await pilot.press("f2")
        assert isinstance(app.screen, RenameScreen)
        app.screen.query_one("#new-title", Input).value = "renamed"
        await pilot.press("enter")
        await pilot.pause()
        assert app.screen is listing and listing.chats[options.highlighted].title == "renamed"
        before = options.highlighted
        await pilot.press("down")
        assert options.highlighted == before + 1  # no Tab needed
        await pilot.press("slash", *"king")
        await pilot.pause()
        assert [c.title for c in listing.chats] == ["renamed", "second"]  # "third", renamed
        text = shown(app)
        assert "the King of France" in text  # where it matched, in the list itself
        prompt = options.get_option_at_index(1).prompt
        (highlighted,) = [
            prompt.plain[s.start : s.end] for s in prompt.spans if s.style == "reverse"
        ]
        assert highlighted == "King"


def test_a_match_snippet_is_one_line_around_the_match():
    snippet = match_snippet("zero one\ntwo  KING\x1b[2J three " + "x" * 80, "king", context=10)
    assert "\n" not in snippet.plain and "\x1b" not in snippet.plain
    assert snippet.plain.startswith("…") and snippet.plain.endswith("…")
    assert "two KING three" in snippet.plain


async def test_progress_before_the_loading_screen_is_drawn_is_shown_once_it_is(model, tmp_path):
    """A fresh clone's `make test` crashed the app (issue 47 item 13): the engine's first progress
    reached the loading screen before it had composed its widgets (`NoMatches: '#what'`)."""
    app = make_app(model, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        loading = ModelLoadingScreen()
        loading.report("reading \x1b[31mthe model", 3, 8)  # not composed yet: kept
        await app.push_screen(loading)
        await pilot.pause()
        assert str(loading.query_one("#what", Label).content) == "reading the model"
        bar = loading.query_one("#progress", ProgressBar)
        assert (bar.progress, bar.total) == (3, 8)
        loading.report("written", 8, 8)  # drawn: shown at once
        assert str(loading.query_one("#what", Label).content) == "written"


async def test_a_choice_without_its_button_is_left_to_the_choices_to_come(model, tmp_path):
    """The K selector is told a K (or mode) it has no button for, as another model loads: not a
    crash; the choices that model offers show what stands."""
    app = make_app(model, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        selector = app.chat_screen.query_one(RoutingSelector)
        selector.select(k=16, mode="nonesuch")
        selector.set_quality({16: {"heads only": 1.5}})
        await selector.set_choices(selector.profiles, selector.modes, 4, "on-demand")
        assert selector.query_one("#k-4", RadioButton).value
