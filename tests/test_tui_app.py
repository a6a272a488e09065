"""The chat app driven through Textual's Pilot, on a real tiny engine (hundreds of tok/s on CPU).

Every test runs the real app: the engine loads in its thread worker, replies stream through
messages, and the panels are read back from the widgets. Waits poll a condition with a deadline
(`wait_until`) rather than sleeping a fixed time.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from adapters import write_random_profile
from textual.pilot import Pilot
from textual.widgets import Digits, Label, Markdown, OptionList, RadioButton

from edge0_tui.app import Edge0App
from edge0_tui.chat_store import ChatMessage, ChatStore
from edge0_tui.live_metrics import LiveMetrics
from edge0_tui.messages import ReplyText
from edge0_tui.screens.settings import SettingsScreen
from edge0_tui.system_memory import SystemMemory
from edge0_tui.widgets.conversation import AssistantTurn, UserTurn
from edge0_tui.widgets.memory_bar import MemoryBar
from edge0_tui.widgets.prompt import PromptInput
from edge0_tui.widgets.routing_selector import RoutingSelector
from edge0_tui.widgets.status_line import StatusLine
from engine import Reply
from engine.config import EngineConfig, GenerationConfig, format_bytes
from engine.runtime.memory_plan import MemoryPlan
from engine.runtime.metrics import StepMetrics

SIZE = (120, 40)
# Small enough that every decode step loads experts, so loads and blocked time are never zero.
EXPERT_CACHE_BYTES = 200_000
SHORT = GenerationConfig(max_tokens=24, temperature=0.0)
# Long enough (tens of seconds) that a test acts while the reply is still being written.
LONG = GenerationConfig(max_tokens=5000, temperature=0.0)
SNAPSHOT = Path(__file__).parent / "snapshots" / "tui_main_screen.svg"


def make_app(model_dir: Path, data_dir: Path, settings: GenerationConfig = SHORT) -> Edge0App:
    return Edge0App(
        model=str(model_dir),
        engine_config=EngineConfig(expert_cache_bytes=EXPERT_CACHE_BYTES),
        data_dir=data_dir,
        cache_dir=data_dir / "cache",
        settings=settings,
    )


async def wait_until(pilot: Pilot, condition, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            screen = pilot.app.chat_screen
            raise AssertionError(
                f"timed out after {timeout:.0f} s waiting for {what} (status: "
                f"{status_text(pilot.app)!r}, writing: {screen.reply is not None})"
            )
        await pilot.pause(0.02)


async def ready(app: Edge0App, pilot: Pilot) -> None:
    await wait_until(pilot, lambda: app.chat_screen.controller.ready, "the model to load")
    await pilot.pause()


async def send(app: Edge0App, pilot: Pilot, text: str) -> None:
    prompt = app.chat_screen.query_one(PromptInput)
    prompt.focus()
    prompt.text = text
    await pilot.press("enter")
    # The prompt is cleared once the reply has started (a short one may already have ended).
    await wait_until(pilot, lambda: prompt.text == "", "the message to be sent")


async def reply_done(app: Edge0App, pilot: Pilot) -> ChatMessage:
    await wait_until(pilot, lambda: app.chat_screen.reply is None, "the reply to end")
    await pilot.pause()
    return app.chat_screen.controller.messages[-1]


async def reply_streaming(app: Edge0App, pilot: Pilot) -> None:
    def streamed() -> bool:
        reply = app.chat_screen.reply
        return reply is not None and bool(reply.query_one(Markdown).source)

    await wait_until(pilot, streamed, "reply text to stream in")


def record_notifications(app: Edge0App) -> list[tuple[str, str]]:
    """(message, severity) of every notification, still shown as usual. Widgets' notify calls
    the app's, so this catches them all."""
    notices: list[tuple[str, str]] = []
    notify = app.notify

    def record(message, *args, severity="information", **kwargs):
        notices.append((str(message), severity))
        return notify(message, *args, severity=severity, **kwargs)

    app.notify = record
    return notices


def status_text(app: Edge0App) -> str:
    return app.chat_screen.query_one(StatusLine).status.line()


@pytest.fixture
def model(checkpoint_dir) -> Path:
    return checkpoint_dir("qwen3_moe", "tiny")


async def test_reply_streams_and_panels_show_speed_and_memory(model, tmp_path):
    batches: list[str] = []

    def record(message) -> None:
        if isinstance(message, ReplyText):
            batches.append(message.text)

    app = make_app(model, tmp_path, replace(SHORT, max_tokens=64))
    async with app.run_test(size=SIZE, message_hook=record) as pilot:
        await ready(app, pilot)
        await pilot.press("h", "i", "ctrl+j", "y", "o")  # typed as a user would; ctrl+j: newline
        assert app.chat_screen.query_one(PromptInput).text == "hi\nyo"
        await pilot.press("enter")
        assert app.chat_screen.query_one(PromptInput).text == ""  # accepted, so cleared
        reply = await reply_done(app, pilot)

        assert reply.role == "assistant" and reply.stopped_by == "max_tokens"
        assert len(batches) >= 2, "the reply arrived in one piece, not streamed"
        assert reply.content.startswith("".join(batches)[:10])
        turn = app.chat_screen.query(AssistantTurn).last()
        assert turn.query_one(Markdown).source == reply.content
        assert [t.content for t in app.chat_screen.query(UserTurn)] == ["hi\nyo"]

        # The panels show the figures at the timer's next tick after the reply.
        def context_shown() -> int:
            found = re.search(r"context (\d+) tokens", status_text(app))
            return int(found.group(1)) if found else 0

        await wait_until(pilot, lambda: context_shown() > 64, "the reply's context on the status")
        assert "K 4" in status_text(app) and "on-demand" in status_text(app)
        assert float(app.chat_screen.query_one("#tok-per-s", Digits).value) > 0
        metrics = app.session.metrics
        assert metrics.loads_per_step > 0 and metrics.blocked_ms > 0
        segments = {
            s.name: s.nbytes for s in app.chat_screen.query_one(MemoryBar).breakdown.segments
        }
        assert segments["MLX, not reclaimable"] > 0 and segments["rest of edge0"] > 0
        # The prompt's reads, apart from decode's: the whole prefill, every chunk of it.
        prefill = metrics.last_prefill
        assert prefill is not None and prefill.phase == "prefill"
        assert prefill.tokens == app.session.engine.last_prefill.tokens > 1
        assert prefill.mib_read > 0
        shown = str(app.chat_screen.query_one("#prefill", Label).content)
        assert shown.startswith(f"prefill, {prefill.tokens} tokens: ") and "cold" in shown

        await pilot.press("f3")  # copy the last reply
        assert app.clipboard == reply.content


async def test_status_line_shows_the_process_peak_rss_beside_mlx(model, tmp_path, monkeypatch):
    """The status line's RSS peak is the kernel's high-water mark: it holds memory the engine
    took and gave back inside the prefill, between two of its per-step RSS samples."""
    from engine.runtime.decode import Decoder
    from engine.runtime.metrics import process_rss_bytes

    transient = 300 << 20
    build = Decoder.build

    def build_holding_a_transient(self, tokens, phase, *args, **kwargs):
        if phase == "prefill" and not self.steps:  # a reply's first forward
            block = np.ones(transient // 8)  # written: every page resident
            del block
        return build(self, tokens, phase, *args, **kwargs)

    monkeypatch.setattr(Decoder, "build", build_holding_a_transient)
    app = make_app(model, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        await send(app, pilot, "hi")
        await reply_done(app, pilot)
        metrics = app.session.metrics
        await wait_until(
            pilot,
            lambda: f", RSS {format_bytes(app.session.metrics.peak_rss_bytes)}" in status_text(app),
            "the RSS peak on the status line",
        )
        line = status_text(app)
        assert f"peak MLX {format_bytes(metrics.peak_memory_bytes)}, RSS " in line, line
        # The steps' RSS samples, taken after the transient was freed, are far below it.
        assert metrics.peak_rss_bytes >= process_rss_bytes() + transient // 2
        assert max(s.rss_bytes for s in metrics.recent_steps) < metrics.peak_rss_bytes - (
            transient // 2
        )


async def test_escape_stops_within_a_step_and_next_message_works(model, tmp_path):
    app = make_app(model, tmp_path, LONG)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        # Note how many tokens the engine had when the stop was asked for.
        at_stop: list[int] = []
        stop_reply = app.session.stop_reply

        def spy() -> None:
            at_stop.append(app.session.metrics.context_tokens)
            stop_reply()

        app.session.stop_reply = spy
        await send(app, pilot, "tell me everything")
        await reply_streaming(app, pilot)
        await pilot.press("escape")
        reply = await reply_done(app, pilot)

        assert reply.stopped_by == "cancelled" and reply.content  # the partial reply is kept
        # The engine checks should_stop after every token: at most the step in flight finishes.
        assert app.session.metrics.context_tokens - at_stop[0] <= 2
        ending = app.chat_screen.query(AssistantTurn).last().query_one(".ending")
        assert "stopped by you" in str(ending.render())

        app.chat_screen.controller.settings = SHORT
        await send(app, pilot, "and now briefly")
        second = await reply_done(app, pilot)
        assert second.stopped_by == "max_tokens"
        assert [m.role for m in app.chat_screen.controller.messages] == ["user", "assistant"] * 2


async def test_k_switch_mid_reply_applies_and_next_reply_uses_it(model, tmp_path):
    app = make_app(model, tmp_path, LONG)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        assert "K 4" in status_text(app)
        await send(app, pilot, "a long answer please")
        await reply_streaming(app, pilot)

        # Choose K=2 in the side panel mid-reply. Pressing the radio button directly: it takes
        # the path a click takes (RadioSet.Changed, then KChosen), but pilot.click would first
        # wait for every widget's queue to drain, which takes seconds while text streams in.
        app.chat_screen.query_one("#k-2", RadioButton).value = True
        await wait_until(
            pilot, lambda: "K 2  " in status_text(app), "the status line to show K 2 in use"
        )
        assert app.chat_screen.reply is not None  # still the same reply
        assert app.session.engine.k == 2
        assert app.session.metrics.last_step.k == 2  # decode steps now run at K=2
        await pilot.press("escape")
        await reply_done(app, pilot)

        # Idle: the engine applies the switch at once, not at the next reply.
        app.chat_screen.controller.settings = SHORT
        await pilot.click("#k-8")
        await wait_until(pilot, lambda: "K 8  " in status_text(app), "K 8 in the status line")
        assert app.session.engine.k == 8 and app.chat_screen.reply is None
        assert not app.chat_screen.query_one("#k-choice").has_class("-pending")
        await send(app, pilot, "again")
        await reply_done(app, pilot)
        assert app.session.engine.k == 8
        assert all(
            step.k == 8 for step in app.session.metrics.recent_steps[-SHORT.max_tokens + 1 :]
        )
        assert not app.chat_screen.query_one("#k-choice").has_class("-pending")
        assert app.chat_screen.query_one("#k-8", RadioButton).value
        assert not app.chat_screen.query_one("#k-2", RadioButton).value


async def test_mode_switch_mid_reply_brings_the_prerouter_and_its_k(model, tmp_path):
    with_heads = tmp_path / "model"
    shutil.copytree(model, with_heads)
    write_random_profile(with_heads, 2)  # prerouter heads and LoRA for K=2
    app = make_app(with_heads, tmp_path, LONG)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        assert app.chat_screen.query_one(RoutingSelector).modes == [
            "on-demand",
            "prerouter",
            "prefetch",
            "resident",  # offered too: the app reloads the model for it
        ]
        await send(app, pilot, "switch while I talk")
        await reply_streaming(app, pilot)

        app.chat_screen.query_one("#mode-prerouter", RadioButton).value = True  # as a click
        await wait_until(
            pilot, lambda: "K 2  │  prerouter  " in status_text(app), "prerouter mode at K=2"
        )
        assert app.session.engine.mode == "prerouter" and app.chat_screen.reply is not None
        assert app.session.metrics.last_step.mode == "prerouter"
        assert app.chat_screen.query_one("#k-2", RadioButton).value  # the K it brought
        await pilot.press("escape")
        await reply_done(app, pilot)


async def test_saved_chat_reopens_after_restart(model, tmp_path):
    first = make_app(model, tmp_path)
    async with first.run_test(size=SIZE) as pilot:
        await ready(first, pilot)
        await send(first, pilot, "remember this question")
        saved_reply = (await reply_done(first, pilot)).content
        await pilot.press("ctrl+n")  # a new chat: the screen empties, the saved one stays saved
        assert first.chat_screen.controller.chat_id is None and not first.chat_screen.query(
            UserTurn
        )
        await pilot.press("ctrl+q")

    second = make_app(model, tmp_path)
    async with second.run_test(size=SIZE) as pilot:
        await ready(second, pilot)
        assert not second.chat_screen.query(UserTurn)  # starts on a new chat
        await pilot.press("ctrl+o")
        options = second.screen.query_one(OptionList)
        assert options.option_count == 1
        options.highlighted = 0
        await pilot.press("enter")
        await wait_until(pilot, lambda: second.chat_screen.query(UserTurn), "the chat to reopen")
        assert [t.content for t in second.chat_screen.query(UserTurn)] == ["remember this question"]
        reopened = second.chat_screen.query(AssistantTurn).last().query_one(Markdown)
        assert reopened.source == saved_reply
        # A reopened chat shows its context size: its messages through the chat template.
        expected = len(
            second.session.engine.encode_chat(
                [m.as_prompt() for m in second.chat_screen.controller.messages]
            )
        )
        await wait_until(
            pilot, lambda: f"context {expected} tokens" in status_text(second), "its context"
        )

        await send(second, pilot, "and continue")
        await reply_done(second, pilot)
        chat_id = second.chat_screen.controller.chat_id
    store = ChatStore(tmp_path)
    assert [c.message_count for c in store.chats()] == [4]
    assert [m.content for m in store.messages(chat_id)][:3] == [
        "remember this question",
        saved_reply,
        "and continue",
    ]
    store.close()


async def test_read_error_is_a_notification_and_next_message_works(model, tmp_path):
    app = make_app(model, tmp_path, LONG)
    notices = record_notifications(app)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        reader = app.session.engine.store.reader
        disk_failing = False
        pread_into = reader._pread_into

        def failing_pread(*args) -> int:
            if disk_failing:
                raise OSError(5, "Input/output error", "model.safetensors")
            return pread_into(*args)

        reader._pread_into = failing_pread
        await send(app, pilot, "read from a failing disk")
        await reply_streaming(app, pilot)
        disk_failing = True  # every expert load from now on fails
        reply = await reply_done(app, pilot)
        disk_failing = False

        errors = [text for text, severity in notices if severity == "error"]
        assert len(errors) == 1
        assert "read error" in errors[0] and "Input/output error" in errors[0]
        assert "Traceback" not in errors[0] and "\n" not in errors[0]
        assert reply.stopped_by == "error" and reply.content  # what was written stays
        assert "stopped by an error" in str(
            app.chat_screen.query(AssistantTurn).last().query_one(".ending").render()
        )

        app.chat_screen.controller.settings = SHORT
        await send(app, pilot, "try again")
        assert (await reply_done(app, pilot)).stopped_by == "max_tokens"


async def test_missing_model_is_a_notification_not_a_crash(tmp_path):
    app = make_app(tmp_path / "no-such-model", tmp_path)
    notices = record_notifications(app)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(
            pilot, lambda: app.chat_screen.controller.state == "no model", "the load to fail"
        )
        assert [s for _, s in notices] == ["error"]
        assert "no-such-model" in notices[0][0] and "\n" not in notices[0][0]
        app.chat_screen.query_one(PromptInput).text = "hello?"
        await pilot.press("enter")
        await pilot.pause()
        assert app.chat_screen.reply is None and not app.chat_screen.controller.messages
        assert app.chat_screen.query_one(PromptInput).text == "hello?"  # kept for later
        assert notices[-1][1] == "warning"


async def test_an_engine_bug_is_one_line_and_the_app_stays(model, tmp_path):
    app = make_app(model, tmp_path, LONG)
    notices = record_notifications(app)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        stream = app.session.engine.stream

        def stream_then_break(prompt, gen, should_stop):
            def tokens():
                for token in stream(prompt, gen, should_stop):
                    yield token
                    if token.step.phase == "decode":
                        raise RuntimeError("a bug")

            return Reply(tokens())

        app.session.engine.stream = stream_then_break
        await send(app, pilot, "hello")
        await wait_until(
            pilot, lambda: app.chat_screen.controller.state == "engine stopped", "the bug"
        )
        assert notices[-1] == ("the engine stopped on a bug: RuntimeError('a bug')", "error")
        assert app.chat_screen.reply is None  # the interrupted reply was ended
        assert app.session.closed.is_set()  # and the engine closed on its thread
        app.chat_screen.query_one(PromptInput).text = "anyone there?"
        await pilot.press("enter")
        assert notices[-1] == ("cannot send: engine stopped", "warning")
        assert app.chat_screen.query_one(PromptInput).text == "anyone there?"


async def test_ctrl_q_mid_reply_quits_and_closes_the_engine(model, tmp_path):
    app = make_app(model, tmp_path, LONG)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        await send(app, pilot, "a reply that will not finish")
        await reply_streaming(app, pilot)
        quit_at = time.monotonic()
        await pilot.press("ctrl+q")
    closed = await asyncio.to_thread(app.session.closed.wait, 5.0)
    assert closed, "the engine thread did not close the engine"
    assert time.monotonic() - quit_at < 5.0
    assert app.session.engine is None


async def test_settings_screen_sets_max_tokens_for_the_next_reply(model, tmp_path):
    app = make_app(model, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        await pilot.press("f2")
        assert isinstance(app.screen, SettingsScreen)
        app.screen.query_one("#max_tokens").value = "0"  # out of range: refused
        await pilot.click("#save")
        assert isinstance(app.screen, SettingsScreen)
        app.screen.query_one("#temperature").value = "0"
        app.screen.query_one("#max_tokens").value = "7"
        await pilot.press("enter")  # the refused field has the focus; Enter saves too
        await pilot.pause()
        assert not isinstance(app.screen, SettingsScreen)
        assert app.chat_screen.controller.settings.max_tokens == 7
        await send(app, pilot, "short")
        await reply_done(app, pilot)
        generated = app.session.metrics.context_tokens - len(
            app.session.engine.encode_chat([{"role": "user", "content": "short"}])
        )
        assert generated == 7


async def test_command_palette_offers_every_action(model, tmp_path):
    app = make_app(model, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        titles = [c.title for c in app.get_system_commands(app.screen)]
        for title in (
            "New chat",
            "Open a saved chat",
            "Settings",
            "Copy the last reply",
            "Routing width K=2",
            "Routing width K=4",
            "Routing width K=8",
            "Mode: on-demand",
            "Mode: prerouter (not available)",  # no heads: listed, saying why
            "Next K",
            "Next mode",
            "Keys",
            "Quit",
        ):
            assert title in titles
        assert "Stop the reply" not in titles  # only while a reply is written
        # The BLAS in use and the prefill kernels, from the engine's info (issue 16).
        assert any(t.startswith("BLAS: ") for t in titles), titles
        await pilot.press("f1")
        assert app.screen.query("HelpPanel")  # the keys
        await pilot.press("f1")
        assert not app.screen.query("HelpPanel")
        command = next(c for c in app.get_system_commands(app.screen) if c.title.endswith("K=2"))
        command.callback()
        await wait_until(pilot, lambda: "K 2  " in status_text(app), "K 2 applied while idle")
        assert app.chat_screen.query_one("#k-2", RadioButton).value  # the selector follows


def fixed_metrics() -> LiveMetrics:
    """Metrics as if from a few decode steps: fixed numbers, so the screen renders the same."""

    def step(i: int) -> StepMetrics:
        return StepMetrics(
            phase="decode",
            tokens=1,
            wall_ms=20.0 + i % 5,
            blocked_ms=6.0 + (i * 7) % 5,
            loads=10 + i % 3,
            hits=6,
            mib_read=3.5,
            mib_per_load=0.3,
            cold_fraction=0.25,
            ms_per_load=0.6,
            whole_layer_reads=0,
            whole_layer_mib=0.0,
            transient_peak_mib=0.0,
            expert_pool_mib=8.0,
            mlx_active_bytes=3 << 30,
            mlx_cache_bytes=1 << 30,
            mlx_peak_bytes=5 << 30,
            rss_bytes=4 << 30,
            page_cache_expert_bytes=6 << 30,
            mode="on-demand",
            k=4,
        )

    steps = tuple(step(i) for i in range(40))
    return LiveMetrics(
        k=4,
        mode="on-demand",
        context_tokens=321,
        peak_memory_bytes=5 << 30,
        last_step=steps[-1],
        recent_steps=steps,
        recent_token_ms=tuple(s.wall_ms + 2 for s in steps),
    )


# A plan with fixed figures: the engine's own reads this machine's memory.
FIXED_PLAN = MemoryPlan(
    runtime_bytes=300 << 20,
    resident_bytes=1 << 30,
    expert_cache_bytes=512 << 20,
    prefill_bytes=64 << 20,
    kv_cache_bytes=256 << 20,
    working_bytes=128 << 20,
    whole_layer_prefill=False,
    context_tokens=8192,
    k=4,
    limit_bytes=32 << 30,
    limit_source="RAM",
)


@pytest.mark.parametrize(
    "size, snapshot, panels",
    [
        (SIZE, SNAPSHOT, False),
        ((80, 24), SNAPSHOT.with_name("tui_compact_80x24.svg"), False),
        ((80, 24), SNAPSHOT.with_name("tui_compact_80x24_panels.svg"), True),
        ((160, 48), SNAPSHOT.with_name("tui_wide_160x48.svg"), False),
    ],
    ids=["120x40", "80x24", "80x24-panels", "160x48"],
)
async def test_main_screen_snapshot(model, tmp_path, size, snapshot, panels):
    """The main screen, with a saved conversation and fixed metrics, matches the stored SVG: at
    the default size, at 80x24 (the compact layout: the wall in one line; F6: the panels) and at
    160x48.

    Set EDGE0_UPDATE_SNAPSHOTS=1 to rewrite the golden files after an intended change (and look at
    them before committing). A mismatch leaves the new rendering next to the test's tmp_path.
    """
    store = ChatStore(tmp_path)
    chat_id = store.create_chat("What is the memory wall?", "qwen3_moe-tiny")
    store.add_message(chat_id, ChatMessage("user", "What is the memory wall?"))
    answer = (
        "When a model's weights do not fit in RAM, **every step waits on the disk**.\n\n"
        "```python\nengine.request_k(2)  # fewer experts per token\n```"
    )
    store.add_message(chat_id, ChatMessage("assistant", answer, "eos"))
    store.close()

    app = make_app(model, tmp_path)
    async with app.run_test(size=size) as pilot:
        await ready(app, pilot)
        screen = app.chat_screen
        screen.panel_timer.pause()  # freeze: nothing time-dependent is drawn after this
        await screen.open_chat(chat_id)
        await wait_until(
            pilot, lambda: screen.controller.context_tokens, "the reopened chat's context"
        )
        prompt = screen.query_one(PromptInput)
        prompt.cursor_blink = False
        if panels:
            await pilot.press("f6")
        screen.show_panels(fixed_metrics(), SystemMemory(32 << 30, 12 << 30, "RAM"), FIXED_PLAN)

        def prompt_focused() -> bool:
            # The cursor is drawn only with focus, and a focus request made while the prompt
            # is still disabled (the engine busy) is dropped: on a busy box that happened. With
            # the compact layout's panels shown (F6), focus is where F6 puts it.
            if not panels and not prompt.has_focus:
                prompt.focus()
            return (panels or prompt.has_focus) and "ready" in status_text(app)

        await wait_until(pilot, prompt_focused, "the prompt's focus")
        # TextArea caches rendered lines by a key that, with blinking off, leaves out focus: a
        # line drawn before the focus arrived (a busy box) would keep its missing cursor.
        prompt.notify_style_update()
        prompt.refresh()
        await pilot.pause()
        assert screen.compact == (size[0] < 100 or size[1] < 36)
        # K, mode and the state stay in the status line at every size.
        line = str(screen.query_one(StatusLine).render())
        assert "K 4" in line and "on-demand" in line and "ready" in line, line
        svg = app.export_screenshot(title="edge0")

    check_snapshot(svg, snapshot, tmp_path, "the main screen")


def check_snapshot(svg: str, snapshot, tmp_path, what: str) -> None:
    """`svg` equals the stored `snapshot` (EDGE0_UPDATE_SNAPSHOTS=1 rewrites it; look at it
    before committing); a mismatch leaves the new rendering in `tmp_path`."""
    if os.environ.get("EDGE0_UPDATE_SNAPSHOTS") == "1":
        snapshot.parent.mkdir(exist_ok=True)
        snapshot.write_text(svg)
    expected = snapshot.read_text() if snapshot.exists() else ""
    if svg != expected:
        (tmp_path / snapshot.name).write_text(svg)
        raise AssertionError(
            f"{what} changed; new rendering at {tmp_path / snapshot.name}. "
            "If intended, rerun with EDGE0_UPDATE_SNAPSHOTS=1."
        )


async def test_choosing_prefetch_says_when_it_reads_nothing_ahead(model, tmp_path):
    """The tiny model's experts are under prefetch's size for a read ahead: choosing prefetch
    says so, where the user then sees nothing read ahead (issue 51 item 2)."""
    app = make_app(model, tmp_path)
    notices = record_notifications(app)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        assert app.session.engine.info()["prefetch_reads_ahead"] is False
        app.chat_screen.choose_mode("prefetch")
        await wait_until(pilot, lambda: app.session.engine.mode == "prefetch", "prefetch")
        assert any("prefetch reads nothing ahead on this model" in text for text, _ in notices)
