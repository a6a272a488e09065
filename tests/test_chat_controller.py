"""The chat screen's controller without Textual: a real chat database in a temp folder, and the
engine session as a small fake (for the refusals a real engine seldom gives) or the real one on a
synthetic checkpoint, its engine thread a plain thread."""

from __future__ import annotations

import ast
import sqlite3
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from edge0_tui import chat_controller, chat_store
from edge0_tui.chat_controller import (
    STARTUP_NOTICE_S,
    WAIT_FOR_THE_REPLY,
    ChatController,
    Notice,
    Outcome,
    mode_unavailable,
    next_choice,
)
from edge0_tui.chat_store import ChatHandle, ChatMessage, ChatStore
from edge0_tui.engine_session import EngineSession, ReplyRequest
from edge0_tui.live_metrics import LiveMetrics
from edge0_tui.messages import ContextCounted, EngineReady, ReplyFailed, ReplyFinished
from edge0_tui.preferences import ModelPreferences
from engine import Edge0Error, EngineConfig, GenerationConfig, KProfile

SHORT = GenerationConfig(max_tokens=12, temperature=0.0)
PROFILES = [KProfile(2, False), KProfile(4, True), KProfile(8, False)]
HEADS = [KProfile(2, True, prerouter=True), KProfile(4, True), KProfile(8, False, prerouter=True)]


class FakeSession:
    """The EngineSession calls the controller makes, recorded; refusals on demand."""

    def __init__(self, k: int = 4, mode: str = "on-demand", profiles=PROFILES) -> None:
        self.model = "some/model"
        self.metrics = LiveMetrics(k=k, mode=mode)
        self.engine = None
        self.profiles = {p.k: p for p in profiles}
        self.calls: list[tuple] = []
        self.refuse: str | None = None  # the Edge0Error the next request raises

    def _maybe_refuse(self) -> None:
        if self.refuse is not None:
            raise Edge0Error(self.refuse)

    def submit(self, request: ReplyRequest) -> None:
        self.calls.append(("submit", request))

    def stop_reply(self) -> None:
        self.calls.append(("stop_reply",))

    def request_k(self, k: int) -> KProfile:
        self._maybe_refuse()
        self.calls.append(("request_k", k))
        return self.profiles[k]

    def request_mode(self, mode: str) -> KProfile:
        self._maybe_refuse()
        self.calls.append(("request_mode", mode))
        return self.profiles[2] if mode == "prerouter" else self.profiles[self.metrics.k]

    def request_page_cache(self, budget: int | None) -> None:
        self._maybe_refuse()
        self.calls.append(("request_page_cache", budget))

    def reload(self, mode: str) -> None:
        self.calls.append(("reload", mode))

    def reload_refusal(self) -> str | None:
        return getattr(self, "refuse_reload", None)

    def count_context(self, chat_id: int, messages: list[dict]) -> None:
        self.calls.append(("count_context", chat_id, messages))


def ready_event(
    profiles=PROFILES, modes=("on-demand", "prefetch"), k: int = 4, notices=()
) -> EngineReady:
    info = {"k": k, "mode": modes[0], "wired_limit_bytes": 123}
    return EngineReady("loaded/model", info, list(profiles), list(modes), list(notices))


def controller(
    tmp_path: Path, session: FakeSession | None = None, ready: bool = True, event=None
) -> ChatController:
    control = ChatController(session or FakeSession(), ChatStore(tmp_path), SHORT)
    if ready:
        event = event or ready_event()
        control.offer(event)
        control.engine_ready(event)
    return control


def lock(data_dir: Path) -> sqlite3.Connection:
    """Another program in a write transaction on the chats database."""
    other = sqlite3.connect(data_dir / "chats.sqlite3", isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    return other


# -- the conversation -----------------------------------------------------------------------------


def test_the_first_message_writes_the_chat_and_the_reply_joins_it(tmp_path):
    session = FakeSession()
    control = controller(tmp_path, session)
    assert control.chat_id is None and control.title == "new chat"
    kept, notice = control.save(ChatMessage("user", "Tell me\x1b[31m a story"))
    assert notice is None and kept.content == "Tell me a story"  # cleaned of the escape
    assert control.chat_id is not None and control.title == "Tell me a story"

    control.ask_reply()
    (request,) = [c[1] for c in session.calls if c[0] == "submit"]
    assert request == ReplyRequest([{"role": "user", "content": "Tell me a story"}], SHORT)
    assert control.state == "writing…"

    session.metrics = replace(session.metrics, context_tokens=31)
    text, notice = control.reply_ended("Once upon a time", "max_tokens")
    assert (text, notice) == ("Once upon a time", None)
    assert control.state == "ready" and control.context_tokens == 31
    assert control.store.messages(control.chat_id) == [
        ChatMessage("user", "Tell me a story"),
        ChatMessage("assistant", "Once upon a time", "max_tokens"),
    ]
    assert control.last_is_reply
    assert control.reply_to_copy() == (
        "Once upon a time",
        Notice("copied the last reply to the clipboard"),
    )


def test_an_empty_reply_is_not_saved_and_leaves_the_context_unknown(tmp_path):
    control = controller(tmp_path)
    control.save(ChatMessage("user", "hello"))
    assert control.reply_ended("", "error") == ("", None)
    assert control.context_tokens is None
    assert [m.role for m in control.store.messages(control.chat_id)] == ["user"]
    assert control.reply_to_copy() == (None, Notice("no reply to copy yet", "warning"))
    assert not control.last_is_reply


def test_a_locked_database_keeps_the_messages_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(chat_store, "BUSY_TIMEOUT_S", 0.05)
    control = controller(tmp_path)
    other = lock(tmp_path)
    _, notice = control.save(ChatMessage("user", "first"))
    assert notice.severity == "warning" and notice.timeout == 10
    assert "saving is pending" in notice.text and "database is locked" in notice.text
    assert "1 message(s) are kept in memory" in notice.text
    assert control.chat_id is None and control.messages == [ChatMessage("user", "first")]
    other.execute("COMMIT")
    other.close()

    _, notice = control.reply_ended("an answer", "eos")
    assert notice == Notice("saved the 1 message(s) that were waiting")
    assert [m.content for m in control.store.messages(control.chat_id)] == ["first", "an answer"]


def test_a_message_the_database_can_never_take_is_said_as_an_error(tmp_path, monkeypatch):
    control = controller(tmp_path)

    def broken(chat, message):
        raise sqlite3.IntegrityError("CHECK constraint failed")

    monkeypatch.setattr(control.store, "save", broken)
    kept, notice = control.save(ChatMessage("user", "hi"))
    assert kept == ChatMessage("user", "hi") and control.messages == [kept]
    assert notice == Notice("could not save the message: CHECK constraint failed", "error")


def test_a_saved_chat_opens_with_its_title_and_its_context_counted_once_ready(tmp_path):
    store = ChatStore(tmp_path)
    handle = ChatHandle("ignored", "some/model")
    for message in (ChatMessage("user", "What is a MoE?"), ChatMessage("assistant", "Experts.")):
        store.save(handle, message)
    session = FakeSession()
    control = ChatController(session, store, SHORT)
    control.system_prompt = "Be brief."

    assert control.open(handle.id) is None
    assert control.chat_id == handle.id and control.title == "What is a MoE?"
    assert control.context_tokens is None and control.last_is_reply
    control.count_context()
    assert not [c for c in session.calls if c[0] == "count_context"]  # not before the model

    control.offer(ready_event())
    control.engine_ready(ready_event())
    control.count_context()
    (call,) = [c for c in session.calls if c[0] == "count_context"]
    assert call[1] == handle.id and call[2][0] == {"role": "system", "content": "Be brief."}
    assert [m["content"] for m in call[2][1:]] == ["What is a MoE?", "Experts."]

    control.context_counted(handle.id + 1, 99, writing=False)  # another chat's count
    control.context_counted(handle.id, 77, writing=True)  # the reply's own count follows
    assert control.context_tokens is None
    control.context_counted(handle.id, 77, writing=False)
    assert control.context_tokens == 77
    control.count_context()  # known now: not asked again
    assert len([c for c in session.calls if c[0] == "count_context"]) == 1


def test_a_chat_that_cannot_be_read_leaves_the_chat_shown(tmp_path, monkeypatch):
    control = controller(tmp_path)
    control.save(ChatMessage("user", "still here"))
    shown = control.chat_id

    def locked(chat_id):
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(control.store, "messages", locked)
    assert control.open(shown + 1) == Notice("cannot read the chat: database is locked", "error")
    assert control.chat_id == shown and [m.content for m in control.messages] == ["still here"]


def test_a_deleted_chat_is_told_apart_from_a_database_that_cannot_be_read(tmp_path, monkeypatch):
    control = controller(tmp_path)
    assert not control.shown_chat_deleted()  # a new chat: nothing was written
    control.save(ChatMessage("user", "hello"))
    assert control.is_saved(control.chat_id) and not control.shown_chat_deleted()
    control.store.delete_chat(control.chat_id)
    assert not control.is_saved(control.chat_id) and control.shown_chat_deleted()

    def unreadable(matching=""):
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(control.store, "chats", unreadable)
    assert not control.shown_chat_deleted()  # cannot tell: the chat stays on screen
    assert not control.is_saved(control.chat_id)

    control.new_chat()
    assert (control.chat, control.messages, control.context_tokens) == (None, [], 0)


def test_regenerate_forgets_the_last_reply_unless_the_database_keeps_it(tmp_path, monkeypatch):
    control = controller(tmp_path)
    control.save(ChatMessage("user", "q"))
    control.reply_ended("a first answer", "eos")

    def locked(chat):
        raise sqlite3.OperationalError("database is locked")

    with monkeypatch.context() as m:
        m.setattr(control.store, "drop_last_reply", locked)
        notice = control.drop_last_reply()
    assert notice == Notice("cannot replace the reply now: database is locked", "error")
    assert len(control.messages) == 2

    assert control.drop_last_reply() is None
    assert [m.role for m in control.messages] == ["user"]
    assert [m.role for m in control.store.messages(control.chat_id)] == ["user"]


def test_sending_is_refused_before_the_model_and_while_a_reply_is_written(tmp_path):
    control = controller(tmp_path, ready=False)
    assert control.send_refusal(writing=False) == Notice("cannot send: loading model…", "warning")
    control.offer(ready_event())
    control.engine_ready(ready_event())
    assert control.send_refusal(writing=False) is None
    refusal = control.send_refusal(writing=True)
    assert refusal.text == "a reply is being written: wait, or press Escape to stop it"
    assert control.busy(writing=True).severity == "warning" and control.busy(False) is None


def test_the_keys_on_offer_follow_the_engine_and_the_chat(tmp_path):
    control = controller(tmp_path, ready=False)
    assert control.allows("next_k", (), writing=False) is False  # before the model
    assert control.allows("pick_k", (4,), writing=False) is False
    control.offer(ready_event())
    control.engine_ready(ready_event())
    assert control.allows("pick_k", (4,), writing=False)
    assert not control.allows("pick_k", (16,), writing=False)  # not a K of this model
    assert control.allows("stop_reply", (), writing=True)
    assert not control.allows("stop_reply", (), writing=False)
    assert not control.allows("regenerate", (), writing=False)  # no reply yet
    control.save(ChatMessage("user", "q"))
    control.reply_ended("a", "eos")
    assert control.allows("regenerate", (), writing=False)
    assert not control.allows("regenerate", (), writing=True)
    assert control.allows("new_chat", (), writing=True) is None  # dimmed
    assert control.allows("open_chat", (), writing=False) is True


def test_the_system_prompt_and_settings_go_with_every_reply(tmp_path):
    session = FakeSession()
    control = controller(tmp_path, session)
    before = control.settings_shown(None)
    assert before.generation == SHORT and before.system_prompt == ""
    chosen = replace(before, generation=replace(SHORT, temperature=0.5), system_prompt="Terse.")
    outcome = control.keep_settings(chosen, before)
    assert (
        outcome.kept["generation"].temperature == 0.5 and outcome.kept["system_prompt"] == "Terse."
    )
    assert outcome.notices == (
        Notice("temperature 0.5, top-p 1.0, max tokens 12", title="settings saved"),
    )
    assert not [c for c in session.calls if c[0] == "request_page_cache"]  # budget unchanged

    control.save(ChatMessage("user", "hi"))
    control.ask_reply()
    request = session.calls[-1][1]
    assert request.generation.temperature == 0.5
    assert request.messages[0] == {"role": "system", "content": "Terse."}


def test_a_page_cache_budget_changed_in_the_settings_is_asked_of_the_engine(tmp_path):
    session = FakeSession()
    control = controller(tmp_path, session)
    before = control.settings_shown(ModelPreferences(page_cache="off"))
    outcome = control.keep_settings(replace(before, page_cache=8 << 20), before)
    assert ("request_page_cache", 8 << 20) in session.calls and len(outcome.notices) == 1
    assert outcome.kept["page_cache"] == 8 << 20

    session.refuse = "the page-cache budget must hold one expert"
    outcome = control.keep_settings(replace(before, page_cache=4 << 20), before)
    refusal, saved = outcome.notices  # the refusal first, then the saved line
    assert refusal == Notice(session.refuse, "error", title="page-cache budget")
    assert saved.title == "settings saved"
    assert control.set_page_cache("off") == refusal


# -- the engine's state ---------------------------------------------------------------------------


def test_a_loaded_model_offers_its_choices_and_its_notices(tmp_path):
    control = controller(tmp_path, ready=False)
    assert control.state == "loading model…" and not control.ready
    event = ready_event(notices=["the demo is a random-weight stand-in"])
    control.offer(event)
    assert control.profiles == PROFILES and control.modes == ["on-demand", "prefetch", "resident"]
    assert control.wired_limit_bytes == 123 and control.engine_info["k"] == 4
    assert not control.ready  # not before the selector shows the choices
    outcome = control.engine_ready(event)
    assert control.ready and control.state == "ready" and control.model_name == "loaded/model"
    assert outcome.loading is False
    assert outcome.notices == (
        Notice("the demo is a random-weight stand-in", "warning", timeout=STARTUP_NOTICE_S),
    )


def test_a_resident_engine_offers_the_streaming_modes_it_reloads_into(tmp_path):
    control = controller(tmp_path, ready=False)
    control.offer(ready_event(HEADS, modes=("resident",)))
    assert control.modes == ["resident", "on-demand", "prerouter", "prefetch"]
    control.offer(ready_event(PROFILES, modes=("resident",)))
    assert control.modes == ["resident", "on-demand", "prefetch"]


def test_another_model_loading_forgets_the_switches_asked_of_the_one_before(tmp_path):
    session = FakeSession()
    control = controller(tmp_path, session)
    control.choose_k(8)
    assert control.pending_k == 8
    outcome = control.loading("opening other/model…")
    assert outcome == Outcome(loading=True, changed=True)
    assert not control.ready and control.state == "opening other/model…"
    assert control.pending_k is None

    kept = ModelPreferences(generation=replace(SHORT, max_tokens=3), system_prompt="Hi.")
    control.context_tokens = 10
    control.use(kept)
    assert control.settings.max_tokens == 3 and control.system_prompt == "Hi."
    assert control.context_tokens is None  # counted again, through the new model's template


def test_a_refused_model_leaves_the_one_before_ready_unless_it_reloads(tmp_path):
    control = controller(tmp_path)
    control.loading("opening x…")
    outcome = control.refused("x: not a checkpoint", reloading=True)
    assert not control.ready and outcome.loading is None  # the model before is loading again
    assert outcome.notices[0].title == "cannot open the model"
    outcome = control.refused("x: not a checkpoint", reloading=False)
    assert control.ready and control.state == "ready" and outcome.loading is False


def test_a_failed_load_and_a_stopped_engine_say_why(tmp_path):
    control = controller(tmp_path, ready=False)
    outcome = control.load_failed("config.json: missing")
    assert control.state == "no model" and outcome.loading is False
    assert outcome.notices == (
        Notice("config.json: missing", "error", title="cannot load the model", timeout=30),
    )
    control = controller(tmp_path)
    outcome = control.engine_stopped(RuntimeError("boom"))
    assert not control.ready and control.state == "engine stopped"
    assert outcome.notices == (
        Notice("the engine stopped on a bug: RuntimeError('boom')", "error"),
    )
    # The reply it interrupted ends without making the state "ready" again.
    control.reply_ended("partial", "error")
    assert control.state == "engine stopped"


def test_an_engine_thread_that_dies_says_why_before_and_after_the_model_loaded(tmp_path):
    """Not an Edge0Error: before the model loaded, the load failed (the reason in one line);
    after, the engine stopped on a bug."""
    control = controller(tmp_path, ready=False)
    outcome = control.engine_thread_died(OSError("config.json:\n  unreadable"))
    assert control.state == "no model" and outcome.loading is False
    assert outcome.notices == (
        Notice("OSError: config.json:", "error", title="cannot load the model", timeout=30),
    )
    control = controller(tmp_path)
    outcome = control.engine_thread_died(RuntimeError("boom"))
    assert not control.ready and control.state == "engine stopped"
    assert outcome.notices == (
        Notice("the engine stopped on a bug: RuntimeError('boom')", "error"),
    )


def test_the_switch_keys_come_first_and_every_other_key_follows_in_its_order():
    """The chat screen's footer and keys panel order (its `active_bindings`), without a Pilot."""
    from types import SimpleNamespace

    from edge0_tui.key_order import switch_keys_first

    def active(binding_id):
        return SimpleNamespace(binding=SimpleNamespace(id=binding_id))

    bindings = {
        "enter": active("prompt.send"),
        "q": active("app.quit"),
        "f5": active("chat.next_mode"),
        "ctrl+n": active("chat.new"),
        "f4": active("chat.next_k"),
    }
    ordered = switch_keys_first(bindings)
    assert list(ordered) == ["f4", "f5", "q", "enter", "ctrl+n"]
    assert all(ordered[key] is bindings[key] for key in bindings)


# -- routing width and mode -----------------------------------------------------------------------


def test_a_k_switch_is_pending_until_the_engine_applies_it(tmp_path):
    session = FakeSession(k=4)
    control = controller(tmp_path, session)
    outcome = control.choose_k(2)
    assert ("request_k", 2) in session.calls
    assert outcome.k == 2 and outcome.kept == {"k": 2} and outcome.changed
    (warning,) = outcome.notices  # K=2 does not recover quality here
    assert warning.severity == "warning"
    assert warning.text.startswith("quality not recovered at K=2: no trained adapter for it")
    assert control.pending_k == 2
    assert control.next_k() == 4  # the next after the one asked for, not after the one running

    assert not control.settle(LiveMetrics(k=4, mode="on-demand")) and control.pending_k == 2
    assert not control.settle(LiveMetrics(k=2, mode="on-demand")) and control.pending_k is None

    assert control.choose_k(4).notices == ()  # recovered: nothing to say
    assert control.pending_k is None  # the K that already runs


def test_a_refused_k_puts_the_selector_back_on_what_stands(tmp_path):
    session = FakeSession(k=4)
    control = controller(tmp_path, session)
    control.choose_k(8)
    session.refuse = "K=2 needs prerouter heads in prerouter mode"
    outcome = control.choose_k(2)
    assert outcome == Outcome(k=8, notices=(Notice(session.refuse, "error"),))
    assert control.pending_k == 8  # the one asked for before still stands


def test_a_mode_switch_keeps_its_k_and_may_bring_its_own(tmp_path):
    session = FakeSession(k=4, profiles=HEADS)
    control = controller(tmp_path, session, event=ready_event(HEADS, ("on-demand", "prerouter")))
    assert control.k_choices() == [2, 4, 8]
    assert not control.reloads_for("prerouter")
    outcome = control.choose_mode("prerouter")
    assert outcome.mode == "prerouter" and outcome.kept == {"mode": "prerouter", "k": 2}
    assert control.pending_mode == "prerouter"
    assert control.k_choices() == [2, 8]  # the K with heads, in the mode that will run
    assert control.settle(LiveMetrics(k=2, mode="prerouter"))  # the selector shows its K
    assert control.pending_mode is None

    session.refuse = "mode 'prefetch' is not available here"
    outcome = control.choose_mode("prefetch")
    assert outcome.mode == "on-demand" and outcome.notices[0].severity == "error"


def test_next_mode_cycles_the_streaming_modes_and_says_when_there_is_one(tmp_path):
    session = FakeSession()
    control = controller(tmp_path, session, event=ready_event(modes=("on-demand", "prefetch")))
    assert control.next_mode() == ("prefetch", None)
    control.pending_mode = "prefetch"
    assert control.next_mode() == ("on-demand", None)  # after the one asked for, wrapping round

    control = controller(tmp_path, session, event=ready_event(modes=("on-demand",)))
    mode, why_not = control.next_mode()
    assert mode is None
    assert why_not == Notice(
        f"on-demand is the only mode offered here: {mode_unavailable('prerouter')}"
    )
    session.metrics = LiveMetrics(k=4, mode="resident")
    assert control.next_mode() == ("on-demand", None)  # out of resident, never into it
    assert next_choice([2, 4], 16) == 2


def test_resident_and_back_reload_the_model_unless_a_reply_is_written(tmp_path):
    session = FakeSession()
    control = controller(tmp_path, session)
    assert control.reloads_for("resident") and not control.reloads_for("prefetch")
    assert control.expert_bytes() == 0  # no engine here

    outcome = control.reload("resident", writing=True)
    assert outcome == Outcome(mode="on-demand", notices=(WAIT_FOR_THE_REPLY,))
    assert control.reload("resident", writing=False, agreed=False) == Outcome(mode="on-demand")
    assert not [c for c in session.calls if c[0] == "reload"] and control.ready

    outcome = control.reload("resident", writing=False)
    assert session.calls[-1] == ("reload", "resident")
    assert outcome == Outcome(kept={"mode": "resident"}, changed=True)
    assert not control.ready and control.state == "loading the model resident…"


def test_a_switch_the_engine_could_not_apply_is_forgotten(tmp_path):
    session = FakeSession(k=4)
    control = controller(tmp_path, session)
    control.choose_k(8)
    control.choose_mode("prefetch")
    outcome = control.switch_failed("cannot read the heads file")
    assert control.pending_k is None and control.pending_mode is None
    assert outcome.k == 4 and outcome.mode == "on-demand" and outcome.changed
    assert outcome.notices == (
        Notice("cannot read the heads file", "error", title="cannot switch"),
    )


def test_the_context_shown_while_writing_is_the_engines_count(tmp_path):
    control = controller(tmp_path)
    control.context_tokens = 40
    assert control.shown_context(LiveMetrics(context_tokens=0), writing=False) == 40
    assert control.shown_context(LiveMetrics(context_tokens=0), writing=True) is None
    assert control.shown_context(LiveMetrics(context_tokens=9), writing=True) == 9


def test_every_message_the_engine_posts_has_a_handler_on_the_chat_screen():
    """The screen takes the engine's messages by handler name (on_<message>): a message renamed,
    or a handler misnamed, would be dropped without a word."""
    from textual.message import Message

    from edge0_tui import messages
    from edge0_tui.screens.chat import ChatScreen

    posted = [
        m
        for m in vars(messages).values()
        if isinstance(m, type) and issubclass(m, Message) and m.__module__ == messages.__name__
    ]
    assert len(posted) >= 10
    assert [
        m.__name__ for m in posted if not callable(getattr(ChatScreen, m.handler_name, None))
    ] == []


def test_the_controller_module_does_not_import_textual():
    tree = ast.parse(Path(chat_controller.__file__).read_text())
    imported = [
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    ]
    assert imported and not [m for m in imported if m and m.split(".")[0] == "textual"]


# -- with the real engine session -----------------------------------------------------------------


class EngineThread:
    """EngineSession.serve on a plain thread; what it posts is kept in order."""

    def __init__(self, session: EngineSession) -> None:
        self.session = session
        self.posted: list = []
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=session.serve, args=(self.posted.append, self.stop.is_set), daemon=True
        )
        self.thread.start()

    def wait_for(self, kind: type, after: int = 0, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [m for m in self.posted[after:] if isinstance(m, kind)]
            if found:
                return found[0]
            if not self.thread.is_alive():
                break
            time.sleep(0.01)
        raise AssertionError(f"no {kind!r} (posted: {self.posted!r})")

    def close(self) -> None:
        self.session.shutdown()
        self.stop.set()
        self.thread.join(timeout=30)


@pytest.fixture
def engine_thread(checkpoint_dir, tmp_path):
    session = EngineSession(
        str(checkpoint_dir("qwen3_moe", "tiny")),
        EngineConfig(expert_cache_bytes=200_000),
        tmp_path / "cache",
    )
    running = EngineThread(session)
    yield running
    running.close()
    assert not running.thread.is_alive()


def test_the_controller_chats_and_switches_k_through_a_real_engine(engine_thread, tmp_path):
    session = engine_thread.session
    ready = engine_thread.wait_for(EngineReady)
    control = ChatController(session, ChatStore(tmp_path / "data"), SHORT)
    control.offer(ready)
    assert control.engine_ready(ready).loading is False and control.ready

    # A K the model offers, switched at once while the engine is idle.
    other = next(k for k in control.k_choices() if k != session.metrics.k)
    outcome = control.choose_k(other)
    assert outcome.kept == {"k": other} and outcome.k == other
    deadline = time.monotonic() + 30
    while session.metrics.k != other and time.monotonic() < deadline:
        time.sleep(0.01)
    assert session.metrics.k == other
    control.settle(session.metrics)
    assert control.pending_k is None

    # A K and a mode it does not offer: refused by the engine, what stands is shown again.
    refused = control.choose_k(3)
    assert refused.k == other and refused.notices[0].severity == "error" and not refused.kept
    refused = control.choose_mode("prerouter")
    assert refused.mode == ready.info["mode"] and "not available" in refused.notices[0].text

    # A message and its reply, written to the database as they become final.
    control.save(ChatMessage("user", "Tell me about experts."))
    seen = len(engine_thread.posted)
    control.ask_reply()
    done = engine_thread.wait_for((ReplyFinished, ReplyFailed), after=seen)
    assert isinstance(done, ReplyFinished), done
    text, _ = control.reply_ended(done.text, done.stopped_by)
    assert control.context_tokens == session.metrics.context_tokens > 0
    saved = control.store.messages(control.chat_id)
    assert [m.role for m in saved] == ["user", "assistant"] and saved[1].content == text

    # The chat reopened by another controller: its context is counted by the engine.
    again = ChatController(session, control.store, SHORT)
    again.offer(ready)
    again.engine_ready(ready)
    assert again.open(control.chat_id) is None and again.context_tokens is None
    seen = len(engine_thread.posted)
    again.count_context()
    counted = engine_thread.wait_for(ContextCounted, after=seen)
    assert counted.chat_id == control.chat_id and counted.tokens > 0
    again.context_counted(counted.chat_id, counted.tokens, writing=False)
    assert again.context_tokens == counted.tokens


def test_idle_panels_are_drawn_once_a_second_and_at_once_when_something_moves():
    """The panels' timer runs at the live rate; idle (no reply written, nothing new from the
    engine) they are drawn once a second, so an idle app does not keep a core busy (issue 51
    item 7); anything new is drawn at once."""
    from edge0_tui.chat_controller import IDLE_PANELS_S

    control = ChatController.__new__(ChatController)  # only the panels' state is used here
    control._panels_metrics, control._panels_at = None, float("-inf")
    control.pending_k = control.pending_mode = None
    idle = LiveMetrics()
    assert control.panels_due(idle, writing=False, now=100.0)
    assert not control.panels_due(idle, writing=False, now=100.2)  # nothing new: not yet
    assert control.panels_due(idle, writing=False, now=100.0 + IDLE_PANELS_S)
    assert control.panels_due(LiveMetrics(k=8), writing=False, now=101.1)  # new figures
    assert control.panels_due(idle, writing=True, now=101.2)  # a reply: every tick
    control.pending_k = 8
    assert control.panels_due(idle, writing=False, now=101.3)  # a switch to show pending


def test_a_reload_refused_as_ranks_says_why_and_loads_nothing(tmp_path):
    """Running as ranks the model stays loaded on every rank: resident mode is refused in one
    notice before any question or reload, and the mode running stays."""
    session = FakeSession()
    session.refuse_reload = "running as ranks (--hosts): restart without --hosts"
    control = controller(tmp_path, session)
    outcome = control.reload("resident", writing=False)
    assert ("reload", "resident") not in session.calls
    assert outcome.mode == "on-demand" and "restart without --hosts" in outcome.notices[0].text
    assert control.ready
