"""Hostile and broken inputs, the app's side: terminal escapes in saved chats and replies, a locked
chat database, world-readable chats, model names that are neither a local path nor a Hub repo,
out-of-range settings, and replies whose numbers needed repair.

The app tests drive the real app on a tiny real engine, as tests/test_tui_app.py does.
"""

from __future__ import annotations

import os
import re
import sqlite3
import stat
from pathlib import Path

import pytest
from nan_once import NaNOnce
from test_tui_app import (
    SHORT,
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
from textual.app import App
from textual.widgets import Markdown, OptionList, Static

from edge0_tui import chat_store, model_source
from edge0_tui.app import Edge0App
from edge0_tui.chat_store import ChatMessage, ChatStore
from edge0_tui.model_source import download_from_hub, resolve_model
from edge0_tui.preferences import ModelPreferences
from edge0_tui.sanitize import sanitize
from edge0_tui.screens.chat_list import ChatListScreen
from edge0_tui.screens.settings import SettingsScreen
from edge0_tui.widgets.conversation import AssistantTurn, UserTurn
from edge0_tui.widgets.prompt import PromptInput
from engine import Edge0Error, GenerationConfig

# What must never reach the terminal from text: C0 controls but newline and tab, DEL, C1 controls,
# bidi embeddings/overrides/isolates.
UNSAFE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
TITLE = "\x1b]0;pwned\x07"
CLIPBOARD = "\x1b]52;c;cHduZWQ=\x07"


@pytest.fixture
def model(checkpoint_dir) -> Path:
    return checkpoint_dir("qwen3_moe", "tiny")


def _no_progress(what: str, done: float, total: float | None) -> None:
    pass


def assert_safe(text: str, where: str) -> None:
    bad = sorted({hex(ord(c)) for c in UNSAFE.findall(text)})
    assert not bad, f"{where} holds {bad}: {text!r}"


def shown(app: App) -> str:
    """Every character the current screen puts on the terminal (Textual adds its own styling
    escapes later, in the driver; none are in these strips)."""
    strips = app.screen._compositor.render_strips()
    return "\n".join("".join(segment.text for segment in strip) for strip in strips)


def widget_texts(app: App) -> list[tuple[str, str]]:
    """What each text widget of every screen holds, scrolled into view or not."""
    texts = []
    for screen in app.screen_stack:
        for widget in screen.walk_children():
            if isinstance(widget, Markdown):
                texts.append((repr(widget), widget.source))
            elif isinstance(widget, Static):
                texts.append((repr(widget), str(widget.content)))
            elif isinstance(widget, OptionList):
                for i in range(widget.option_count):
                    texts.append((repr(widget), str(widget.get_option_at_index(i).prompt)))
        texts.append(("sub_title", screen.sub_title or ""))
    return texts


def assert_screen_safe(app: App) -> None:
    assert_safe(shown(app), f"the screen {app.screen!r}")
    for where, text in widget_texts(app):
        assert_safe(text, where)


# -- the sanitising function ---------------------------------------------------------------------


def test_sanitize_removes_control_sequences_and_keeps_the_text():
    assert sanitize(f"a{TITLE}b{CLIPBOARD}c") == "abc"
    assert sanitize("\x1b[2J\x1b[31mred\x1b[0m") == "red"  # CSI: clear screen, colours
    assert sanitize("\x1bP1$r\x1b\\dcs\x1b_apc\x1b\\") == "dcs"  # DCS, APC with ST
    assert sanitize("\x9b31mc1\x9d0;t\x9c") == "c1"  # the one-byte C1 forms
    assert sanitize("nul\x00 del\x7f bell\x07 cr\r") == "nul del bell cr"
    assert sanitize("\u202eevil\u202c \u2066iso\u2069") == "evil iso"
    kept = "héllo 🎉 世界\n\tcode: `x = [1, 2]`\n# Title\n- **bold** [link](http://x)\n"
    assert sanitize(kept) == kept
    assert sanitize("a\r\nb") == "a\nb"
    # An opener with no end stops at the line's end: it cannot swallow the rest of a reply.
    assert sanitize("x\x1b]0;no end\nnext line") == "x\nnext line"


def test_sanitize_of_a_streamed_prefix_is_a_prefix_of_the_whole():
    # A reply is cleaned as it streams in: what is shown early must not change later.
    whole = f"hi {TITLE} there \x1b[31mred\x1b[0m\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\ end\r\n"
    for cut in range(len(whole) + 1):
        assert sanitize(whole).startswith(sanitize(whole[:cut])), cut


# -- escapes from saved chats, replies and model names -------------------------------------------


def _write_raw_chat(data_dir: Path) -> None:
    """A chat as an older edge0 (or someone else's file) left it: raw control sequences."""
    ChatStore(data_dir).close()  # the schema
    db = sqlite3.connect(data_dir / "chats.sqlite3", isolation_level=None)
    db.execute(
        "INSERT INTO chats (id, title, model, created_at, updated_at) VALUES (1, ?, ?, 0, 0)",
        (f"title{TITLE}{CLIPBOARD}", "model\x1b[31m"),
    )
    for role, content in (
        ("user", f"question{TITLE} 🎉\n\twith a tab"),
        ("assistant", f"answer\x00{CLIPBOARD} **bold**\x9b2J\u202eright"),
    ):
        db.execute(
            "INSERT INTO messages (chat_id, role, content, created_at) VALUES (1, ?, ?, 0)",
            (role, content),
        )
    db.close()


async def test_saved_chat_and_streamed_reply_never_reach_the_terminal_raw(model, tmp_path):
    _write_raw_chat(tmp_path)
    app = make_app(model, tmp_path)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await ready(app, pilot)
        # Every reply the engine writes carries a title change, a clipboard write and a NUL.
        engine = app.session.engine
        decode = engine.reply_text
        engine.reply_text = lambda tokens: f"ok{TITLE} {CLIPBOARD}x\x00y " + decode(tokens)

        await pilot.press("ctrl+o")
        await wait_until(pilot, lambda: isinstance(app.screen, ChatListScreen), "the chat list")
        assert "title" in shown(app)
        assert_screen_safe(app)
        app.screen.query_one(OptionList).highlighted = 0
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.chat_screen.query(UserTurn), "the chat to open")
        await pilot.pause()
        assert_screen_safe(app)
        assert str(app.chat_screen.query(UserTurn).first().content) == ("question 🎉\n\twith a tab")
        assert "**bold**right" in app.chat_screen.query(AssistantTurn).first().text

        await send(app, pilot, f"mine{CLIPBOARD}\x1b[2J ✓")
        reply = await reply_done(app, pilot)
        assert_screen_safe(app)
        assert reply.content.startswith("ok xy ")

    store = ChatStore(tmp_path)
    (chat,) = store.chats()
    store.close()
    db = sqlite3.connect(tmp_path / "chats.sqlite3")
    stored = [r[0] for r in db.execute("SELECT content FROM messages ORDER BY id")]
    db.close()
    assert chat.title == "title" and chat.model == "model"
    assert stored[2:] == ["mine ✓", reply.content]  # written cleaned
    for text in stored[2:]:
        assert_safe(text, "the database")


async def test_a_hostile_model_path_is_reported_cleanly(tmp_path):
    # A path with terminal escapes and Textual markup in it ("[/x]" stopped the app on
    # MarkupError when shown in a notification).
    app = make_app(tmp_path / f"no[/x]{TITLE}model", tmp_path)
    notices = record_notifications(app)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await wait_until(
            pilot, lambda: app.chat_screen.controller.state == "no model", "the load to fail"
        )
        await pilot.pause(0.2)
        assert app.is_running
        assert "no[/x]" in shown(app)  # shown as written, not as markup
        assert_screen_safe(app)
        assert [s for _, s in notices] == ["error"]


class _PromptHost(App[None]):
    def compose(self):
        yield PromptInput(id="prompt")


async def test_pasted_control_sequences_are_not_inserted():
    app = _PromptHost()
    async with app.run_test(size=SIZE) as pilot:
        prompt = app.query_one(PromptInput)
        prompt.focus()
        await pilot.pause()
        app.post_message(
            events.Paste(f"pasted{TITLE}\x1b[2J text 🎉\n\tnext")
        )  # as a terminal does
        await pilot.pause()
        assert prompt.text == "pasted text 🎉\n\tnext"


# -- a locked chat database ----------------------------------------------------------------------


def _lock(data_dir: Path) -> sqlite3.Connection:
    """Another program in a write transaction on the chats database."""
    other = sqlite3.connect(data_dir / "chats.sqlite3", isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    return other


def _unlock(other: sqlite3.Connection) -> None:
    other.execute("COMMIT")
    other.close()


async def test_locked_database_keeps_every_turn_and_saves_them_in_order(
    model, tmp_path, monkeypatch
):
    # The UI waits this long per try (raising=False: the test also runs against older code).
    monkeypatch.setattr(chat_store, "BUSY_TIMEOUT_S", 0.2, raising=False)
    app = make_app(model, tmp_path, SHORT)
    notices = record_notifications(app)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        other = _lock(tmp_path)
        await send(app, pilot, "first")
        first = await reply_done(app, pilot)
        pending = [m for m, s in notices if s == "warning" and "saving is pending" in m]
        assert pending and "database is locked" in pending[-1], notices
        assert not any(s == "error" or "Traceback" in m for m, s in notices)
        assert app.store.unsaved == 2  # the chat's first message and its reply, held in memory
        await wait_until(pilot, lambda: "2 unsaved" in status_text(app), "the status to say so")

        _unlock(other)
        await send(app, pilot, "second")  # the next save writes what waited, then this one
        second = await reply_done(app, pilot)
        assert app.store.unsaved == 0
        assert any("saved the 2 message(s) that were waiting" in m for m, _ in notices)

        other = _lock(tmp_path)
        await send(app, pilot, "third")
        third = await reply_done(app, pilot)
        await pilot.press("ctrl+q")  # still locked: the app says so and stays
        assert app.is_running and app.store.unsaved == 2
        assert notices[-1][1] == "error" and "not saved" in notices[-1][0]
        _unlock(other)
        await pilot.press("ctrl+q")  # the last try on the way out succeeds
    assert app.store.unsaved == 0

    store = ChatStore(tmp_path)
    (chat,) = store.chats()
    assert [(m.role, m.content) for m in store.messages(chat.id)] == [
        ("user", "first"),
        ("assistant", first.content),
        ("user", "second"),
        ("assistant", second.content),
        ("user", "third"),
        ("assistant", third.content),
    ]
    store.close()


def test_store_save_waits_in_memory_and_close_writes_it(tmp_path, monkeypatch):
    monkeypatch.setattr(chat_store, "BUSY_TIMEOUT_S", 0.1)
    store = ChatStore(tmp_path)
    chat = chat_store.ChatHandle("t", "m")
    other = _lock(tmp_path)
    assert not store.save(chat, ChatMessage("user", "kept"))
    assert chat.id is None and store.unsaved == 1 and "locked" in store.last_error
    _unlock(other)
    assert store.close() == 0  # nothing lost
    store = ChatStore(tmp_path)
    assert [m.content for m in store.messages(store.chats()[0].id)] == ["kept"]
    store.close()


# -- private chats -------------------------------------------------------------------------------


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _database_files(data_dir: Path) -> list[Path]:
    db = data_dir / "chats.sqlite3"
    return [db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")]


@pytest.fixture
def open_umask():
    """The common umask (022), under which files are created world-readable by default."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_new_chat_database_is_private(tmp_path, open_umask):
    data_dir = tmp_path / "data"
    store = ChatStore(data_dir)
    store.add_message(store.create_chat("t", "m"), ChatMessage("user", "private"))
    assert _mode(data_dir) == 0o700
    files = [p for p in _database_files(data_dir) if p.exists()]
    assert len(files) == 3  # the database, its -wal and -shm, while it is open
    assert {p.name: _mode(p) for p in files} == {p.name: 0o600 for p in files}
    store.close()


def test_loose_modes_left_behind_are_tightened_on_open(tmp_path, open_umask):
    data_dir = tmp_path / "data"
    ChatStore(data_dir).close()
    # An older edge0's files, held open by another reader so the -wal/-shm files exist.
    reader = sqlite3.connect(data_dir / "chats.sqlite3")
    reader.execute("SELECT COUNT(*) FROM chats").fetchone()
    data_dir.chmod(0o755)
    for path in _database_files(data_dir):
        path.chmod(0o644)
    store = ChatStore(data_dir)
    assert _mode(data_dir) == 0o700
    assert {p.name: _mode(p) for p in _database_files(data_dir)} == {
        p.name: 0o600 for p in _database_files(data_dir)
    }
    store.close()
    reader.close()


# -- model names: local paths first, Hub ids checked ---------------------------------------------


@pytest.fixture
def no_hub(monkeypatch) -> list[str]:
    """Repo ids `resolve_model` would have downloaded (none is)."""
    asked: list[str] = []

    def download(repo_id, on_progress, offline=False):
        asked.append(repo_id)
        raise Edge0Error(f"{repo_id}: (test) no Hub here")

    monkeypatch.setattr(model_source, "download_from_hub", download)
    return asked


@pytest.mark.parametrize("spec", ["./x", "../missing/model", "~/no-such-edge0-model", "/no/such"])
def test_a_missing_path_is_said_missing_and_never_sent_to_the_hub(spec, no_hub, tmp_path):
    with pytest.raises(Edge0Error, match=r"no such local directory \(.* does not exist\)") as e:
        resolve_model(spec, tmp_path, _no_progress)
    assert str(e.value).startswith(spec) and no_hub == []


def test_a_path_whose_first_part_exists_is_a_path(no_hub, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    with pytest.raises(Edge0Error, match="models/typo: no such local directory"):
        resolve_model("models/typo", tmp_path, _no_progress)
    assert no_hub == []


@pytest.mark.parametrize("spec", ["a/b/c", "a b/c", "-a/b", "a/b.", "a--b/c", "plainname", "a/"])
def test_text_that_is_no_path_and_no_hub_id_is_a_clear_error(spec, no_hub, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Edge0Error, match="not a Hugging Face model id") as e:
        resolve_model(spec, tmp_path, _no_progress)
    assert repr(spec) in str(e.value) and no_hub == []


def test_owner_name_not_found_locally_says_so_before_the_hub(no_hub, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    progress: list[str] = []
    with pytest.raises(Edge0Error, match="^no local directory a/b; a/b: "):
        resolve_model("a/b", tmp_path, lambda what, done, total: progress.append(what))
    assert progress == ["no local directory a/b; trying the Hugging Face Hub"]
    assert no_hub == ["a/b"]


def test_owner_name_offline_without_a_cached_copy_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        model_source,
        "download_from_hub",
        lambda repo, on_progress, offline: download_from_hub(
            repo, on_progress, cache_dir=tmp_path / "hf", offline=offline
        ),
    )
    with pytest.raises(Edge0Error) as e:
        resolve_model("nobody/nothing", tmp_path, _no_progress, offline=True)
    assert str(e.value) == (
        "no local directory nobody/nothing; nobody/nothing: offline, and no complete copy is cached"
    )


def test_an_invalid_repo_id_given_to_the_download_is_an_edge0_error(tmp_path):
    with pytest.raises(Edge0Error, match="'./x': not a Hugging Face model id"):
        download_from_hub("./x", _no_progress, cache_dir=tmp_path, offline=True)


async def test_the_app_says_why_a_missing_path_cannot_load(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    app = Edge0App(model="./x", data_dir=tmp_path, cache_dir=tmp_path / "cache")
    notices = record_notifications(app)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(
            pilot, lambda: app.chat_screen.controller.state == "no model", "the load to fail"
        )
        ((message, severity),) = notices
        assert severity == "error" and message.startswith("./x: no such local directory (/")
        assert message.endswith("/x does not exist)")
        assert "engine stopped" not in status_text(app)


async def test_the_app_shows_the_real_reason_when_loading_breaks(model, tmp_path, monkeypatch):
    def broken_engine(path, config):
        raise ValueError("config.json: expected a number\n  (line 3)")

    monkeypatch.setattr("edge0_tui.engine_session.Engine", broken_engine)
    app = make_app(model, tmp_path)
    notices = record_notifications(app)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(
            pilot, lambda: app.chat_screen.controller.state == "no model", "the load to fail"
        )
        assert notices == [("ValueError: config.json: expected a number", "error")]
        assert "engine stopped" not in status_text(app)


# -- settings out of range -----------------------------------------------------------------------


class _SettingsHost(App[None]):
    CSS_PATH = str(Path(chat_store.__file__).parent / "app.tcss")

    def __init__(self) -> None:
        super().__init__()
        self.saved: list[ModelPreferences | None] = []

    def on_mount(self) -> None:
        self.push_screen(
            SettingsScreen(ModelPreferences(GenerationConfig(max_tokens=64))), self.saved.append
        )


@pytest.mark.parametrize(
    "field, text",
    [
        ("temperature", "nan"),
        ("temperature", "inf"),
        ("temperature", "-inf"),
        ("temperature", "1e999"),
        ("temperature", "-0.5"),
        ("top_p", "0"),
        ("top_p", "-1"),
        ("top_p", "1.5"),
        ("top_p", "nan"),
        ("max_tokens", "0"),
        ("max_tokens", "-3"),
        ("max_tokens", "2.5"),
        ("max_tokens", ""),
    ],
)
async def test_settings_refuse_bad_sampling_values_in_the_dialog(field, text):
    app = _SettingsHost()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        app.screen.query_one(f"#{field}").value = text
        await pilot.click("#save")
        await pilot.pause()
        assert isinstance(app.screen, SettingsScreen) and app.saved == []
        error = str(app.screen.query_one("#error").content)
        name = {"top_p": "top-p", "max_tokens": "max tokens"}.get(field, field)
        assert error.startswith(name) and repr(text) in error
        assert app.screen.focused is app.screen.query_one(f"#{field}")  # the refused field
        app.screen.focused.value = "0.5" if field != "max_tokens" else "8"
        await pilot.press("enter")  # Enter in a field saves too
        await pilot.pause()
        assert len(app.saved) == 1 and app.saved[0] is not None


# -- replies whose numbers needed repair ---------------------------------------------------------


async def test_a_reply_whose_numbers_were_repaired_says_so(model, tmp_path):
    app = make_app(model, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        layer = app.session.engine.model.layers[1]
        layer.self_attn = NaNOnce(layer.self_attn, poison_call=3)  # a decode step
        await send(app, pilot, "hello")
        await reply_done(app, pilot)
        ending = str(app.chat_screen.query(AssistantTurn).last().query_one(".ending").content)
        assert re.search(r"numerical repair: \d+ non-finite values fixed", ending), ending

        layer.self_attn = layer.self_attn.inner
        await send(app, pilot, "again")  # a clean reply says nothing of the kind
        await reply_done(app, pilot)
        ending = str(app.chat_screen.query(AssistantTurn).last().query_one(".ending").content)
        assert "repair" not in ending
