"""The model picker (issue 35, "Model list and picker"), on the real app through Pilot: Ctrl+L or
the palette lists the models `edge0 list` finds, and another model opens in place of the running
one without a restart. The chat stays and continues with the new model; its kept settings, the K
selector and the panels follow it. A bad choice is one line and the model before stays usable.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_bad_inputs_app import shown
from test_tui_app import (
    SHORT,
    SIZE,
    ready,
    record_notifications,
    reply_done,
    send,
    status_text,
    wait_until,
)
from test_tui_fit import assert_whole, one_line
from textual.widgets import Input, OptionList

from edge0_tui.app import Edge0App
from edge0_tui.preferences import KeptPreferences, ModelPreferences, PreferenceStore, model_key
from edge0_tui.screens.model_loading import ModelLoadingScreen
from edge0_tui.screens.model_picker import ModelPickerScreen
from edge0_tui.widgets.conversation import ChatNote, UserTurn
from edge0_tui.widgets.routing_selector import RoutingSelector
from engine import EngineConfig, GenerationConfig

FIT_SIZES = [(80, 24), (120, 40), (160, 48)]


@pytest.fixture(autouse=True)
def empty_hub_cache(tmp_path, monkeypatch):
    """The picker scans the Hugging Face cache: an empty one here, never the user's."""
    hub = tmp_path / "hub"
    hub.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(hub))
    return hub


@pytest.fixture(scope="module")
def models(checkpoint_dir, tmp_path_factory) -> tuple[Path, Path]:
    """Two tiny models of two families: the one the app starts on, and the one it opens."""
    root = tmp_path_factory.mktemp("picker")
    first, second = root / "first", root / "second"
    shutil.copytree(checkpoint_dir("qwen3_moe", "tiny"), first)
    shutil.copytree(checkpoint_dir("bailing_moe", "tiny"), second)
    return first, second


def kept_app(first: Path, second: Path, data_dir: Path, offline: bool = False) -> Edge0App:
    """The app on `first`, both models used before: `second` kept with K=2 and short greedy
    replies, so that its settings are seen to follow it."""
    store = PreferenceStore(data_dir / "config")
    store.save(model_key(str(first)), ModelPreferences(SHORT))
    store.save(
        model_key(str(second)),
        ModelPreferences(GenerationConfig(max_tokens=12, temperature=0.0), k=2),
    )
    key = model_key(str(first))
    return Edge0App(
        model=str(first),
        engine_config=EngineConfig(expert_cache_bytes=200_000),
        data_dir=data_dir,
        cache_dir=data_dir / "cache",
        preferences=KeptPreferences(store, key, store.load(key, SHORT)),
        offline=offline,
    )


async def open_picker(app: Edge0App, pilot) -> ModelPickerScreen:
    await pilot.press("ctrl+l")
    await wait_until(pilot, lambda: isinstance(app.screen, ModelPickerScreen), "the picker")
    picker = app.screen
    await wait_until(pilot, lambda: bool(picker.rows), "the model list")
    await pilot.pause()
    return picker


async def pick(app: Edge0App, pilot, name: str) -> None:
    picker = await open_picker(app, pilot)
    index = [row["name"] for row in picker.rows].index(name)
    options = picker.query_one("#models", OptionList)
    options.focus()
    options.highlighted = index
    await pilot.press("enter")


async def type_model(app: Edge0App, pilot, text: str) -> None:
    picker = await open_picker(app, pilot)
    box = picker.query_one("#path", Input)
    box.focus()
    box.value = text
    await pilot.press("enter")


async def test_another_model_opens_in_place_and_the_chat_goes_on(models, tmp_path):
    first, second = models
    app = kept_app(first, second, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        await send(app, pilot, "Tell me of the king")
        first_reply = await reply_done(app, pilot)
        first_engine = app.session.engine
        assert first_engine.info()["family"] == "qwen3_moe" and first_engine.k == 4

        picker = await open_picker(app, pilot)
        # The models `edge0 list` finds: both used ones, each with family, size, K, profiles.
        listed = {row["name"]: row for row in picker.rows}
        assert set(listed) == {model_key(str(first)), model_key(str(second))}
        assert listed[model_key(str(second))]["family"] == "bailing_moe"
        text = "".join(one_line(app).split())
        assert "(inuse)" in text and "bailing_moe·" in text and "K4·profiles-·used" in text
        await pilot.press("escape")
        assert not isinstance(app.screen, ModelPickerScreen)
        notices = record_notifications(app)
        await pick(app, pilot, model_key(str(first)))  # the one in use: nothing reloads
        await wait_until(pilot, lambda: notices, "a word about it")
        assert "is the model in use" in notices[-1][0] and app.session.engine is first_engine
        assert app.chat_screen.controller.ready

        sent = []
        submit = app.session.submit
        app.session.submit = lambda request: (sent.append(request), submit(request))
        await pick(app, pilot, model_key(str(second)))
        # While it loads: the loading screen, and the prompt refuses to send.
        assert isinstance(app.screen, ModelLoadingScreen) or app.chat_screen.controller.ready
        await wait_until(
            pilot,
            lambda: app.chat_screen.controller.ready and app.session.engine is not first_engine,
            "the second model",
        )
        await wait_until(pilot, lambda: app.session.engine.k == 2, "its kept K=2")
        await pilot.pause(0.3)  # a panel refresh
        engine = app.session.engine
        assert engine.info()["family"] == "bailing_moe" and engine.model_dir == second
        assert app.preferences.model == model_key(str(second))  # its settings now
        assert app.chat_screen.controller.settings.max_tokens == 12
        selector = app.chat_screen.query_one(RoutingSelector)
        assert selector.query_one("#k-2").value  # the K selector shows its K
        assert "K 2" in status_text(app) and "second" in status_text(app)
        notes = [str(n.content) for n in app.chat_screen.query(ChatNote)]
        assert notes == [f"model: {first} -> {model_key(str(second))}"]
        # The old chat is still there, and the next reply comes from the new model.
        assert [t.content for t in app.chat_screen.query(UserTurn)] == ["Tell me of the king"]
        await send(app, pilot, "And his daughters?")
        reply = await reply_done(app, pilot)
        assert reply.role == "assistant" and reply.content
        history = [m["content"] for m in sent[-1].messages]
        assert history == ["Tell me of the king", first_reply.content, "And his daughters?"]
        assert sent[-1].generation.max_tokens == 12
        assert [m.content for m in app.chat_screen.controller.messages][:2] == history[:2]
        assert app.session.metrics.k == 2 and app.session.metrics.last_step is not None


async def test_a_reply_being_written_is_stopped_and_kept(models, tmp_path):
    first, second = models
    app = kept_app(first, second, tmp_path)
    app.chat_screen.controller.settings = GenerationConfig(max_tokens=5000, temperature=0.0)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        await send(app, pilot, "Speak at length")
        await wait_until(pilot, lambda: app.session.metrics.context_tokens > 20, "a long reply")
        picker = await open_picker(app, pilot)
        assert "the reply being written is stopped" in one_line(app, picker.query_one("#dialog"))
        options = picker.query_one("#models", OptionList)
        options.focus()
        options.highlighted = [r["name"] for r in picker.rows].index(model_key(str(second)))
        await pilot.press("enter")
        await wait_until(
            pilot,
            lambda: app.chat_screen.controller.ready and app.session.engine.k == 2,
            "the second model",
        )
        stopped = [m for m in app.chat_screen.controller.messages if m.role == "assistant"]
        assert len(stopped) == 1 and stopped[0].stopped_by == "cancelled" and stopped[0].content
        assert app.chat_screen.controller.state == "ready"


def bad_models(root: Path, good: Path) -> dict[str, tuple[str, str]]:
    """What to type -> (a part of the one-line error, when it is found: "check" before anything
    is closed, "load" once the model before was closed)."""
    not_moe = root / "plain"
    not_moe.mkdir()
    (not_moe / "config.json").write_text(json.dumps({"model_type": "llama"}))
    broken = root / "broken-config"
    shutil.copytree(good, broken)
    config = json.loads((broken / "config.json").read_text())
    config["num_hidden_layers"] = "four"
    (broken / "config.json").write_text(json.dumps(config))
    bad_tokenizer = root / "bad-tokenizer"
    shutil.copytree(good, bad_tokenizer)
    (bad_tokenizer / "tokenizer.json").write_text("{}")
    return {
        str(root / "missing" / "model"): ("no such local directory", "check"),
        "~no-such-user-edge0/model": ("no such local directory", "check"),  # pathlib raised
        str(not_moe): ("config.json", "check"),
        str(broken): ("num_hidden_layers", "check"),
        "owner/not-cached": ("offline, and no complete copy is cached", "check"),
        str(bad_tokenizer): ("cannot load the tokenizer", "load"),
    }


async def test_a_bad_choice_is_one_line_and_the_model_before_stays(models, tmp_path):
    first, second = models
    app = kept_app(first, second, tmp_path, offline=True)
    notices = record_notifications(app)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        await send(app, pilot, "hello")
        await reply_done(app, pilot)
        for typed, (error, when) in bad_models(tmp_path, second).items():
            engine = app.session.engine
            before = len(notices)
            await type_model(app, pilot, typed)
            await wait_until(pilot, lambda n=before: len(notices) > n, f"the error for {typed}")
            message, severity = notices[before]
            assert severity == "error" and error in message, (typed, message)
            assert "\n" not in message and "Traceback" not in message
            await wait_until(
                pilot, lambda: app.chat_screen.controller.ready, "the model before, ready"
            )
            assert not isinstance(app.screen, ModelLoadingScreen)
            if when == "check":  # refused before anything was closed: the same engine
                assert app.session.engine is engine
            else:  # closed, then loaded back as it ran
                assert app.session.engine is not engine
            assert app.session.engine.model_dir == first
            assert app.preferences.model == model_key(str(first))
            assert app.chat_screen.controller.settings == SHORT
            assert not app.chat_screen.query(ChatNote)
            await send(app, pilot, f"still there after {Path(typed).name}?")
            reply = await reply_done(app, pilot)
            assert reply.role == "assistant" and reply.content


@pytest.mark.parametrize("size", FIT_SIZES, ids=[f"{w}x{h}" for w, h in FIT_SIZES])
async def test_the_picker_and_the_note_fit(models, tmp_path, size):
    first, second = models
    app = kept_app(first, second, tmp_path)
    async with app.run_test(size=size) as pilot:
        await ready(app, pilot)
        (command,) = [c for c in app.get_system_commands(app.screen) if c.title == "Open model..."]
        command.callback()  # the palette's way in
        await wait_until(pilot, lambda: isinstance(app.screen, ModelPickerScreen), "the picker")
        await pilot.press("escape")
        picker = await open_picker(app, pilot)
        dialog = picker.query_one("#dialog")
        assert picker.region.contains_region(dialog.region)
        for label in picker.query("Label"):
            if label.display:  # (the list's note is hidden when it has nothing to say)
                assert_whole(label)
        listed = "".join(one_line(app, picker.query_one("#models", OptionList)).split())
        for row in picker.rows:
            assert "".join(row["name"].split()) in listed, f"{row['name']} is cut or missing"
        assert "Enteropens" in "".join(shown(app).split())
        await pilot.press("escape")
        await pick(app, pilot, model_key(str(second)))
        await wait_until(
            pilot,
            lambda: app.chat_screen.controller.ready and app.session.engine.k == 2,
            "the second model",
        )
        await pilot.pause()
        (note,) = app.chat_screen.query(ChatNote)
        assert_whole(note)
        assert one_line(app, note).replace(" ", "") == str(note.content).replace(" ", "")
        await pilot.press("f1")  # the keys panel lists the picker's key
        table = app.screen.query_one("HelpPanel BindingsTable").render_bindings_table()
        keys = [str(cell) for cell in table.columns[0].cells]
        descriptions = [str(cell) for cell in table.columns[1].cells]
        assert any(k.startswith("^l") or "ctrl+l" in k for k in keys), keys
        assert "Model" in descriptions


async def test_typing_with_the_list_focused_goes_to_the_path_field(models, tmp_path):
    """The picker opens on its list (nothing typed yet); a typed path goes to the field, and
    Enter opens what was typed, not the highlighted model."""
    first, second = models
    app = kept_app(first, second, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        picker = await open_picker(app, pilot)
        assert picker.query_one("#models", OptionList).has_focus
        chosen = []
        picker.dismiss = chosen.append  # what the picker hands back, without opening it
        await pilot.press(*"/tmp/x")
        box = picker.query_one("#path", Input)
        assert box.has_focus and box.value == "/tmp/x"
        await pilot.press("enter")
        assert chosen == ["/tmp/x"]
