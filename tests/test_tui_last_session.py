"""Nothing typed is lost on quit, and a restart reopens the last chat (issue 35 item 7), on the real
app through Pilot: the unsent text comes back in the prompt of the chat it was typed in."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_tui_app import SIZE, make_app, ready, reply_done, send, status_text, wait_until

from edge0_tui.chat_store import ChatMessage, ChatStore
from edge0_tui.last_session import FILE_NAME, MAX_FILE_BYTES, LastSession, LastSessionFile
from edge0_tui.widgets.conversation import UserTurn
from edge0_tui.widgets.prompt import PromptInput
from engine import Edge0Error


@pytest.fixture
def model(checkpoint_dir) -> Path:
    return checkpoint_dir("qwen3_moe", "tiny")


def turns(app) -> list[str]:
    return [t.content for t in app.chat_screen.query(UserTurn)]


async def test_the_chat_and_its_unsent_text_come_back_after_quit(model, tmp_path):
    first = make_app(model, tmp_path)
    async with first.run_test(size=SIZE) as pilot:
        await ready(first, pilot)
        await send(first, pilot, "the first question")
        await reply_done(first, pilot)
        chat_id = first.chat_screen.controller.chat_id
        prompt = first.chat_screen.query_one(PromptInput)
        prompt.insert("half a second question,\nover two lines")  # typed, never sent
        await pilot.press("ctrl+q")
    assert (tmp_path / FILE_NAME).stat().st_mode & 0o077 == 0  # private, like the chats

    second = make_app(model, tmp_path)
    async with second.run_test(size=SIZE) as pilot:
        prompt = second.chat_screen.query_one(PromptInput)
        await wait_until(pilot, lambda: turns(second) == ["the first question"], "the last chat")
        assert second.chat_screen.controller.chat_id == chat_id
        assert prompt.text == "half a second question,\nover two lines"
        await ready(second, pilot)
        await wait_until(pilot, lambda: "context – " not in status_text(second), "its context")
        await pilot.press("enter")  # the kept text is sent in that chat
        await reply_done(second, pilot)
    store = ChatStore(tmp_path)
    assert [m.content for m in store.messages(chat_id) if m.role == "user"] == [
        "the first question",
        "half a second question,\nover two lines",
    ]
    store.close()


async def test_text_typed_in_a_new_chat_comes_back_in_a_new_chat(model, tmp_path):
    store = ChatStore(tmp_path)
    older = store.create_chat("older", "m")
    store.add_message(older, ChatMessage("user", "an older chat"))
    store.close()
    first = make_app(model, tmp_path)
    async with first.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: turns(first) == ["an older chat"], "the latest chat")
        await ready(first, pilot)  # the loading dialog takes the keys until then
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: first.chat_screen.controller.chat is None, "the new chat")
        first.chat_screen.query_one(PromptInput).insert("a new thought \x1b]0;title\x07")
        await pilot.press("ctrl+q")
    second = make_app(model, tmp_path)
    async with second.run_test(size=SIZE) as pilot:
        prompt = second.chat_screen.query_one(PromptInput)
        await wait_until(pilot, lambda: prompt.text == "a new thought ", "the unsent text")
        assert second.chat_screen.controller.chat_id is None and turns(second) == []


@pytest.mark.parametrize("kept", ["gone", "not json", "huge", "fifo", "wrong shape"])
async def test_a_missing_or_bad_session_file_opens_the_latest_chat(model, tmp_path, kept):
    store = ChatStore(tmp_path)
    for title in ("older", "latest"):
        chat = store.create_chat(title, "m")
        store.add_message(chat, ChatMessage("user", title))
    store.close()
    path = tmp_path / FILE_NAME
    if kept == "not json":
        path.write_text("{chat_id: 1")
    elif kept == "huge":
        path.write_text('{"chat_id": 1, "draft": "' + "x" * (2 << 20) + '"}')
    elif kept == "fifo":
        os.mkfifo(path)  # would block a plain read forever
    elif kept == "wrong shape":
        path.write_text('{"chat_id": "1; DROP TABLE chats", "draft": 5}')
    assert LastSessionFile(tmp_path).load() is None
    app = make_app(model, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: turns(app) == ["latest"], "the latest chat")
        assert app.chat_screen.query_one(PromptInput).text == ""


def test_what_is_kept_at_quit_is_read_back_or_refused(tmp_path):
    """Issue 47 item 9, the same class: a long draft was written (in 12-byte `\\u` escapes) past
    the reader's bound, and the next start lost the chat and the draft. It is kept as the
    reader reads it; one too big to read back is refused, naming the file, the old one kept."""
    kept = LastSessionFile(tmp_path)
    long_draft = "\U0001f600" * (MAX_FILE_BYTES // 6)  # 4 bytes each in UTF-8
    kept.save(LastSession(3, long_draft))
    assert kept.load() == LastSession(3, long_draft)
    with pytest.raises(Edge0Error, match=f"^{tmp_path / FILE_NAME}: cannot save the unsent text"):
        kept.save(LastSession(4, long_draft * 2))
    assert kept.load() == LastSession(3, long_draft)
    (tmp_path / FILE_NAME).write_text("[" * 100_000)  # was a RecursionError at the start
    assert kept.load() is None
