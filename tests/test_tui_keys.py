"""The chat app's keys, driven through Pilot on a real tiny engine: text typed in one burst arrives
whole, one key switches K or the mode (applied at once when idle), and the small fixes of issue 17
(the start-up notice, the screenshot folder, reply endings and line breaks)."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from adapters import write_random_profile
from test_tui_app import (
    SIZE,
    make_app,
    ready,
    record_notifications,
    reply_done,
    send,
    status_text,
    wait_until,
)
from textual import events
from textual.fuzzy import Matcher
from textual.keys import _character_to_key
from textual.widgets import Label, Markdown, RadioButton
from textual.widgets._footer import FooterKey

from edge0_tui.app import Edge0App
from edge0_tui.chat_controller import STARTUP_NOTICE_S
from edge0_tui.chat_store import ChatMessage, ChatStore
from edge0_tui.widgets.conversation import AssistantTurn
from edge0_tui.widgets.prompt import PromptInput
from engine import format_bytes


@pytest.fixture
def model(checkpoint_dir) -> Path:
    return checkpoint_dir("qwen3_moe", "tiny")


LONG_MESSAGE = (
    "Tell me a long story about the king, the duke and the fool, who met at night "
    "on the heath; and say what each of them wanted, in verse if you can."
)


def burst(app: Edge0App, text: str, then: str | None = None) -> None:
    """Send the keys of `text` (and then the key `then`) as a terminal delivers a paste without
    bracketed paste or `tmux send-keys`: all at once, with no pause for the app to handle one key
    before the next arrives (Pilot.press waits for the app after each key)."""
    keys = [(_character_to_key(ch) if not ch.isalnum() else ch, ch) for ch in text]
    if then is not None:
        keys.append((then, None))
    for key, char in keys:
        event = events.Key(key, char)
        event.set_sender(app)
        app._driver.send_message(event)


async def test_a_message_typed_in_one_burst_arrives_whole(model, tmp_path):
    app = make_app(model, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        prompt = app.chat_screen.query_one(PromptInput)
        prompt.focus()
        await pilot.pause()
        burst(app, LONG_MESSAGE, then="enter")
        await wait_until(
            pilot, lambda: app.chat_screen.controller.messages, "the message to be sent"
        )
        assert app.chat_screen.controller.messages[0].content == LONG_MESSAGE
        await reply_done(app, pilot)
        assert prompt.text == ""


async def test_keys_typed_after_enter_belong_to_the_next_message(model, tmp_path):
    app = make_app(model, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        prompt = app.chat_screen.query_one(PromptInput)
        prompt.focus()
        await pilot.pause()
        burst(app, "first line", then="ctrl+j")  # a new line, in its place in the burst
        burst(app, "second line", then="enter")
        burst(app, "next message")
        await wait_until(pilot, lambda: prompt.text == "next message", "the keys after Enter")
        # The screen takes the sent text as a message of its own, maybe after the keys behind it.
        await wait_until(
            pilot, lambda: app.chat_screen.controller.messages, "the message to be sent"
        )
        assert app.chat_screen.controller.messages[0].content == "first line\nsecond line"
        await reply_done(app, pilot)


# -- one key for K and one for the mode --------------------------------------------------------


async def test_f4_cycles_k_while_typing_and_applies_at_once_when_idle(model, tmp_path):
    app = make_app(model, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        screen = app.chat_screen
        prompt = screen.query_one(PromptInput)
        prompt.focus()
        await pilot.press("h", "i", "f4")  # F4 while the prompt has the focus
        assert prompt.text == "hi"  # not typed
        await wait_until(pilot, lambda: "K 8  " in status_text(app), "K 4 -> 8 applied")
        assert app.session.engine.k == 8 and screen.reply is None  # idle: applied, no reply
        assert "→" not in status_text(app) and "next step" not in _switch_note(app)
        await pilot.press("f4")  # 8 wraps round to 2
        await wait_until(pilot, lambda: "K 2  " in status_text(app), "K 8 -> 2 applied")
        assert screen.query_one("#k-2", RadioButton).value


async def test_letter_keys_switch_when_the_prompt_does_not_have_the_focus(model, tmp_path):
    with_heads = tmp_path / "model"
    shutil.copytree(model, with_heads)
    write_random_profile(with_heads, 2)  # heads for K=2: prerouter and prefetch are offered
    app = make_app(with_heads, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        screen = app.chat_screen
        prompt = screen.query_one(PromptInput)
        prompt.focus()
        await pilot.press("k", "m", "8")  # typed: the prompt has the focus
        assert prompt.text == "km8" and app.session.engine.k == 4
        prompt.clear()
        screen.query_one("#conversation").focus()
        await pilot.press("8")
        await wait_until(pilot, lambda: app.session.engine.k == 8, "8 to pick K=8")
        await pilot.press("m")  # on-demand -> prerouter, which brings the K with heads
        await wait_until(
            pilot, lambda: "K 2  │  prerouter  " in status_text(app), "prerouter at K=2"
        )
        assert app.session.engine.mode == "prerouter"
        await pilot.press("k")  # only K=2 has heads: K stays
        await pilot.press("m")
        await wait_until(pilot, lambda: app.session.engine.mode == "prefetch", "prefetch")
        await pilot.press("m")
        await wait_until(pilot, lambda: app.session.engine.mode == "on-demand", "back round")


async def test_switch_keys_come_first_in_the_footer_and_keys_panel(model, tmp_path):
    app = make_app(model, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        app.chat_screen.query_one(PromptInput).focus()
        await pilot.pause()
        shown = [a.binding for a in app.screen.active_bindings.values() if a.binding.show]
        assert [b.key for b in shown[:2]] == ["f4", "f5"]
        assert [b.description for b in shown[:2]] == ["Next K", "Next mode"]
        footer_keys = [key.key for key in app.screen.query(FooterKey)]
        assert footer_keys[:2] == ["f4", "f5"]
        await pilot.press("f1")
        table = app.screen.query_one("HelpPanel BindingsTable").render_bindings_table()
        first_rows = [str(cell) for cell in list(table.columns[0].cells)[:2]]
        assert first_rows[0].startswith("f4") and first_rows[1].startswith("f5")


async def test_palette_finds_the_switches_by_k_mode_and_mode_names(model, tmp_path):
    app = make_app(model, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        titles = [c.title for c in app.get_system_commands(app.screen)]
        for query in ("K", "mode", "resident", "prerouter", "prefetch", "on-demand"):
            matcher = Matcher(query)
            assert any(matcher.match(t) > 0 for t in titles), query
        resident = next(c for c in app.get_system_commands(app.screen) if "resident" in c.title)
        assert resident.title == "Mode: resident"  # offered: the app reloads the model
        resident.callback()
        await pilot.pause()
        from edge0_tui.screens.confirm import ConfirmScreen

        assert isinstance(app.screen, ConfirmScreen)  # asks first
        await pilot.press("escape")


def _switch_note(app: Edge0App) -> str:
    return str(app.chat_screen.query_one("#switch-note").render())


# -- issue 17, item 9 --------------------------------------------------------------------------


async def test_start_up_notice_is_short(model, tmp_path):
    app = make_app(model, tmp_path)  # a K without adapters: the engine's quality notice
    app.session.engine_config = replace(app.session.engine_config, k=2)
    timeouts: list[float | None] = []
    notify = app.notify

    def record(message, *args, timeout=None, **kwargs):
        timeouts.append(timeout)
        return notify(message, *args, timeout=timeout, **kwargs)

    app.notify = record
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
    # Toasts sit over the K and mode selectors: the start-up ones go within seconds.
    assert timeouts and all(t is not None and t <= 10 for t in timeouts)
    assert STARTUP_NOTICE_S <= 10


async def test_screenshot_without_a_downloads_folder_goes_to_the_data_folder(
    model, tmp_path, monkeypatch
):
    monkeypatch.setattr("edge0_tui.app.user_downloads_path", lambda: tmp_path / "no-downloads")
    app = make_app(model, tmp_path / "data")
    notices = record_notifications(app)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        command = next(c for c in app.get_system_commands(app.screen) if c.title == "Screenshot")
        command.callback()
        await wait_until(
            pilot, lambda: list((tmp_path / "data").glob("*.svg")), "the screenshot file"
        )
        await wait_until(pilot, lambda: any("Saved" in m for m, _ in notices), "the notice")
    saved = next(m for m, _ in notices if "Saved" in m)
    assert str(tmp_path / "data") in saved
    assert not (tmp_path / "no-downloads").exists()


async def test_a_reply_ends_without_blank_lines_and_keeps_its_line_breaks(model, tmp_path):
    verse = "Shall I compare thee\nto a summer's day?\nThou art more lovely"
    store = ChatStore(tmp_path)
    chat_id = store.create_chat("a verse", "qwen3_moe-tiny")
    store.add_message(chat_id, ChatMessage("user", "a verse"))
    store.add_message(chat_id, ChatMessage("assistant", verse, "eos"))
    store.add_message(chat_id, ChatMessage("user", "more"))
    store.add_message(chat_id, ChatMessage("assistant", "Two lines\n\nof prose", "max_tokens"))
    store.close()
    app = make_app(model, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        await app.chat_screen.open_chat(chat_id)
        await pilot.pause()
        first, second = app.chat_screen.query(AssistantTurn)
        # Three lines of verse, each on its own line (joined, they would fit on one), and nothing
        # under them (a normal end).
        assert first.query_one(Markdown).outer_size.height == 3
        assert first.outer_size.height == 3  # no blank line under the text
        assert not first.query_one(".ending").display
        # Two paragraphs (a blank line between) and the line that says how it ended.
        assert second.query_one(Markdown).outer_size.height == 3
        assert second.query_one(".ending").display


async def test_ctrl_r_writes_the_last_reply_again_in_its_place(model, tmp_path):
    app = make_app(model, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        screen = app.chat_screen
        assert not screen.check_action("regenerate", ())  # nothing to write again yet
        prompt = screen.query_one(PromptInput)
        prompt.focus()
        prompt.text = "tell me"
        await pilot.press("enter")
        first = await reply_done(app, pilot)
        screen.controller.settings = replace(
            screen.controller.settings, temperature=1.0, seed=5
        )  # another reply
        await pilot.press("ctrl+r")
        await wait_until(
            pilot, lambda: screen.reply is not None or len(screen.controller.messages) == 2, ""
        )
        again = await reply_done(app, pilot)
        assert [m.role for m in screen.controller.messages] == ["user", "assistant"]
        assert len(screen.query(AssistantTurn)) == 1
        chat_id = screen.controller.chat_id
    store = ChatStore(tmp_path)
    saved = store.messages(chat_id)
    store.close()
    assert [m.role for m in saved] == ["user", "assistant"]
    assert saved[-1].content == again.content and again.content != first.content


async def test_saved_chats_can_be_searched_renamed_and_deleted(model, tmp_path):
    from textual.widgets import Input, OptionList

    from edge0_tui.screens.chat_list import ChatListScreen, RenameScreen

    store = ChatStore(tmp_path)
    ids = {}
    for title, words in [("kings", "the king sleeps"), ("fools", "a fool\x1b]0;x\x07 sings")]:
        ids[title] = store.create_chat(title, "m")
        store.add_message(ids[title], ChatMessage("user", words))
    store.close()
    app = make_app(model, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        await app.chat_screen.open_chat(ids["fools"])
        await pilot.press("ctrl+o")
        assert isinstance(app.screen, ChatListScreen)
        listing = app.screen
        assert listing.query_one(OptionList).option_count == 2
        await pilot.press("slash")
        await pilot.press(*"king")  # a word of a message, not of its title
        await pilot.pause()
        assert [c.title for c in listing.chats] == ["kings"]
        listing.query_one("#chat-search", Input).value = ""
        await pilot.pause()
        listing.query_one(OptionList).focus()
        listing.query_one(OptionList).highlighted = [c.id for c in listing.chats].index(
            ids["fools"]
        )
        await pilot.press("f2")
        assert isinstance(app.screen, RenameScreen)
        app.screen.query_one("#new-title", Input).value = "wise fools"
        await pilot.press("enter")
        await pilot.pause()
        assert app.screen is listing and "wise fools" in [c.title for c in listing.chats]
        await pilot.press("delete")  # asks first
        assert len(listing.chats) == 2
        assert "Press Delete again" in str(listing.query_one("#chats-note", Label).content)
        await pilot.press("delete")
        await pilot.pause()
        assert [c.title for c in listing.chats] == ["kings"]
        await pilot.press("escape")
        # The open chat was the one deleted: the screen starts a new chat.
        await wait_until(pilot, lambda: app.chat_screen.controller.chat is None, "a new chat")
    store = ChatStore(tmp_path)
    assert [c.title for c in store.chats()] == ["kings"]
    store.close()


async def test_resident_is_chosen_in_the_app_after_a_confirmation_and_left_again(model, tmp_path):
    from textual.widgets import Button

    from edge0_tui.screens.confirm import ConfirmScreen

    app = make_app(model, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        screen = app.chat_screen
        screen.choose_mode("resident")
        await pilot.pause()
        assert isinstance(app.screen, ConfirmScreen)  # it asks, naming the memory it needs
        expert_bytes = app.session.engine.loaded.index.expert_nbytes
        question = str(app.screen.query(Label)[1].content)
        assert "every expert" in question and format_bytes(expert_bytes) in question
        await pilot.press("escape")  # cancelled: nothing reloads
        await pilot.pause()
        assert app.session.engine.mode == "on-demand"
        assert screen.query_one("#mode-on-demand", RadioButton).value

        screen.choose_mode("resident")
        await pilot.pause()
        await pilot.click(app.screen.query_one("#confirm", Button))
        await wait_until(
            pilot,
            lambda: (
                screen.controller.ready
                and app.session.engine
                and app.session.engine.mode == "resident"
            ),
            "the model loaded resident",
        )
        await send(app, pilot, "hello")
        resident_reply = await reply_done(app, pilot)
        assert resident_reply.role == "assistant"
        await pilot.press("f5")  # from resident, the next mode drops the experts again
        await wait_until(
            pilot,
            lambda: (
                screen.controller.ready
                and app.session.engine
                and app.session.engine.mode == "on-demand"
            ),
            "back to on-demand",
        )
        assert len(screen.controller.messages) == 2  # the chat stayed


async def test_a_bracketed_paste_keeps_its_line_breaks_when_sent_as_cr(model, tmp_path):
    """xterm, VTE and tmux send a pasted newline as CR inside the bracketed paste; Windows text
    brings CRLF. Each is a line break in the box, in the message sent and in the saved chat."""
    app = make_app(model, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        prompt = app.chat_screen.query_one(PromptInput)
        prompt.focus()
        await pilot.pause()
        paste = events.Paste("Line one\rLine two\r\nLine three\r\rLine five")
        paste.set_sender(app)
        app._driver.send_message(paste)  # as the terminal's bracketed paste arrives
        expected = "Line one\nLine two\nLine three\n\nLine five"
        await wait_until(pilot, lambda: prompt.text == expected, "the paste in the box")
        assert prompt.document.line_count == 5
        await pilot.press("enter")
        await wait_until(
            pilot, lambda: app.chat_screen.controller.messages, "the message to be sent"
        )
        await reply_done(app, pilot)
        chat_id = app.chat_screen.controller.chat_id
        assert app.chat_screen.controller.messages[0].content == expected
    store = ChatStore(tmp_path)
    assert store.messages(chat_id)[0].content == expected
    store.close()


async def test_quit_is_in_the_footer_at_80_columns_and_keeps_the_unsent_text(model, tmp_path):
    from test_bad_inputs_app import shown

    app = make_app(model, tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(app, pilot)
        footer = shown(app).splitlines()[-1]
        assert "^q Quit" in footer, footer
        app.chat_screen.query_one(PromptInput).insert("not sent yet")
        await pilot.press("ctrl+q")  # from the focused message box
        await pilot.pause()
    assert not app.is_running
    from edge0_tui.last_session import LastSessionFile

    assert LastSessionFile(tmp_path).load().draft == "not sent yet"
