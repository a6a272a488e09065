"""Kept settings: what the user chose for a model (sampling, system prompt, K, mode, budgets) comes
back on the next start, and a hostile preferences file is a warning, never a traceback."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import replace

import pytest
from test_tui_app import SHORT, SIZE, ready, reply_done, send, status_text, wait_until

from edge0_tui import cli
from edge0_tui.app import Edge0App
from edge0_tui.commands import options
from edge0_tui.preferences import (
    FILE_NAME,
    MAX_SYSTEM_PROMPT_CHARS,
    KeptPreferences,
    ModelPreferences,
    PreferenceStore,
    model_key,
)
from edge0_tui.screens.settings import SettingsScreen
from engine import Edge0Error, EngineConfig, GenerationConfig


@pytest.fixture
def model(checkpoint_dir):
    return checkpoint_dir("qwen3_moe", "tiny")


def test_preferences_round_trip_privately(tmp_path):
    store = PreferenceStore(tmp_path / "config")
    chosen = ModelPreferences(
        GenerationConfig(temperature=0.3, top_p=0.8, max_tokens=99, seed=7),
        system_prompt="Answer in verse.",
        k=2,
        mode="prerouter",
        expert_cache_bytes=8 << 20,
        page_cache="off",
    )
    store.save("demo", chosen)
    store.save("/models/other", ModelPreferences(k=8))  # a second model keeps its own
    again = PreferenceStore(tmp_path / "config")
    assert again.load("demo", GenerationConfig()) == chosen
    assert again.load("/models/other", GenerationConfig()).k == 8
    assert again.load("never-seen", SHORT) == ModelPreferences(SHORT)
    assert again.warning is None
    assert stat.S_IMODE((tmp_path / "config").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "config" / FILE_NAME).stat().st_mode) == 0o600


def test_the_same_folder_named_two_ways_shares_its_preferences(model, monkeypatch):
    monkeypatch.chdir(model.parent)
    assert model_key(model.name) == model_key(str(model)) == str(model.resolve())
    assert model_key("demo") == "demo" and model_key("owner/repo") == "owner/repo"


@pytest.mark.parametrize(
    "content, warning",
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", 'no "models" object'),
        (b'{"models": {"demo": 5}}', "not an object"),
        (b'{"models": {"demo": {"temperature": "hot"}}}', "temperature"),
        (b'{"models": {"demo": {"top_p": 7}}}', "top_p"),
        (b'{"models": {"demo": {"k": -1}}}', "routing width"),
        (b'{"models": {"demo": {"mode": "warp"}}}', "mode"),
        (b'{"models": {"demo": {"expert_cache_bytes": 1e999}}}', "expert_cache_bytes"),
        (b'{"models": {"demo": {"page_cache": "\\u001b]0;pwned\\u0007"}}}', "page_cache"),
        (b"\xff\xfe garbage", "not valid JSON"),
        (b"[" * 100_000, "not valid JSON"),
    ],
)
def test_a_hostile_preferences_file_is_a_warning_and_the_defaults(tmp_path, content, warning):
    (tmp_path / FILE_NAME).write_bytes(content)
    store = PreferenceStore(tmp_path)
    loaded = store.load("demo", SHORT)
    assert loaded.generation == SHORT and loaded.k is None and loaded.mode is None
    assert store.warning is not None and warning in store.warning and "\x1b" not in store.warning
    store.save("demo", replace(loaded, k=4))  # the next save writes a good file
    assert PreferenceStore(tmp_path).load("demo", SHORT).k == 4


def test_a_huge_or_special_preferences_file_is_not_read(tmp_path):
    (tmp_path / FILE_NAME).write_bytes(b" " * (2 << 20))
    store = PreferenceStore(tmp_path)
    assert store.load("demo", SHORT) == ModelPreferences(SHORT) and "bytes" in store.warning
    (tmp_path / FILE_NAME).unlink()
    os.mkfifo(tmp_path / FILE_NAME)  # would block a plain open forever
    store = PreferenceStore(tmp_path)
    assert store.load("demo", SHORT) == ModelPreferences(SHORT)
    assert "not a regular file" in store.warning


# The longest system prompt allowed, in characters that JSON's \u escapes made 12 bytes each.
LONG_PROMPT = "\U0001f600" * MAX_SYSTEM_PROMPT_CHARS


def test_what_a_save_writes_the_next_start_reads_back(tmp_path):
    """Issue 47 item 9: six models with the longest prompt made a file over the reader's bound;
    the next start ignored every model's settings. A save that would not read back is refused,
    naming the file, and every model saved before it is still there."""
    store = PreferenceStore(tmp_path)
    saved = []
    with pytest.raises(Edge0Error) as refused:
        for i in range(40):
            store.save(f"m{i}", ModelPreferences(system_prompt=LONG_PROMPT, k=i + 1))
            saved.append(f"m{i}")
    assert str(refused.value).startswith(f"{tmp_path / FILE_NAME}: cannot save the settings (")
    assert "bytes, more than" in str(refused.value)
    assert len(saved) > 6  # the six, and more
    again = PreferenceStore(tmp_path)
    assert again.models() == saved
    for i, name in enumerate(saved):
        assert again.load(name, SHORT) == ModelPreferences(system_prompt=LONG_PROMPT, k=i + 1)
    assert again.warning is None


def test_a_save_keeps_a_file_it_could_not_read_aside(tmp_path):
    """Was: the next save wrote over a file it could not read, and one model was left of six."""
    path = tmp_path / FILE_NAME
    models = {f"m{i}": {"system_prompt": LONG_PROMPT} for i in range(6)}
    path.write_text(json.dumps({"version": 1, "models": models}, indent=2))  # as saves wrote it
    before = path.read_bytes()
    store = PreferenceStore(tmp_path)
    assert store.load("m0", SHORT) == ModelPreferences(SHORT)
    assert f"{FILE_NAME}.unreadable" in store.warning
    store.save("m0", ModelPreferences(k=2))
    assert (tmp_path / f"{FILE_NAME}.unreadable").read_bytes() == before
    assert PreferenceStore(tmp_path).load("m0", SHORT).k == 2
    # One more unreadable file is kept beside the first, and a save refused puts it back.
    path.write_text("{not json")
    with pytest.raises(Edge0Error):
        store.save("m0", ModelPreferences(system_prompt=LONG_PROMPT * 20))
    assert path.read_text() == "{not json"
    assert not (tmp_path / f"{FILE_NAME}.unreadable-2").exists()
    store.save("m0", ModelPreferences(k=3))
    assert (tmp_path / f"{FILE_NAME}.unreadable-2").read_text() == "{not json"
    assert (tmp_path / f"{FILE_NAME}.unreadable").read_bytes() == before


def _app(model, data_dir, kept: KeptPreferences) -> Edge0App:
    return Edge0App(
        model=str(model),
        engine_config=EngineConfig(expert_cache_bytes=200_000),
        data_dir=data_dir,
        cache_dir=data_dir / "cache",
        preferences=kept,
    )


def _kept(store: PreferenceStore, model) -> KeptPreferences:
    key = model_key(str(model))
    return KeptPreferences(store, key, store.load(key, SHORT))


async def test_choices_made_in_the_app_come_back_on_the_next_start(model, tmp_path):
    store = PreferenceStore(tmp_path / "config")
    app = _app(model, tmp_path, _kept(store, model))
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        await pilot.press("f4")  # K 4 -> 8
        await wait_until(pilot, lambda: "K 8  " in status_text(app), "K=8 applied")
        await pilot.press("f2")
        assert isinstance(app.screen, SettingsScreen)
        app.screen.query_one("#temperature").value = "0"
        app.screen.query_one("#seed").value = "11"
        app.screen.query_one("#system_prompt").value = "You are terse."
        app.screen.query_one("#page_cache").value = "1M"
        await pilot.click("#save")
        await pilot.pause()
        assert not isinstance(app.screen, SettingsScreen)
        # The page-cache budget applies at once, not at the next start.
        await wait_until(
            pilot, lambda: app.session.engine.store.page_cache is not None, "the budget"
        )
        assert app.session.engine.store.page_cache.budget_bytes == 1 << 20
        # The system prompt goes first in what the engine is sent.
        sent = []
        submit = app.session.submit
        app.session.submit = lambda request: (sent.append(request), submit(request))
        await send(app, pilot, "hello")
        await reply_done(app, pilot)
        assert sent[0].messages[0] == {"role": "system", "content": "You are terse."}
        assert sent[0].generation.seed == 11

    kept = json.loads((tmp_path / "config" / FILE_NAME).read_text())["models"]
    assert kept[model_key(str(model))]["k"] == 8

    app = _app(model, tmp_path, _kept(PreferenceStore(tmp_path / "config"), model))
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        await wait_until(pilot, lambda: app.session.engine.k == 8, "the kept K=8")
        screen = app.chat_screen
        assert screen.controller.settings.seed == 11 and screen.controller.settings.temperature == 0
        assert screen.controller.system_prompt == "You are terse."


def test_cli_chat_uses_kept_budgets_unless_given(checkpoint_dir, monkeypatch):
    launched = []
    monkeypatch.setattr(Edge0App, "run", lambda self: launched.append(self))
    model = str(checkpoint_dir())
    store = PreferenceStore(options.config_dir())
    store.save(model_key(model), ModelPreferences(expert_cache_bytes=3 << 20, page_cache=2 << 20))
    assert cli.main(["chat", model]) == 0
    config = launched[-1].session.engine_config
    assert config.expert_cache_bytes == 3 << 20 and config.page_cache_bytes == 2 << 20
    assert cli.main(["chat", model, "--expert-cache", "5M", "--page-cache", "off"]) == 0
    config = launched[-1].session.engine_config
    assert config.expert_cache_bytes == 5 << 20 and config.page_cache_bytes is None


def test_a_model_opened_is_remembered_without_keeping_any_choice(tmp_path):
    """`edge0 list` and the picker list a model once opened, with no setting changed; its entry
    pins nothing (the defaults still apply), an entry with choices keeps them, and a file that
    could not be read is not rewritten."""
    store = PreferenceStore(tmp_path / "config")
    defaults = GenerationConfig(temperature=0.3)
    store.remember("first")
    assert store.models() == ["first"]
    assert store.load("first", defaults) == ModelPreferences(generation=defaults)
    store.save("second", ModelPreferences(defaults, k=2))
    store.remember("second")
    assert store.models() == ["first", "second"]
    assert store.load("second", defaults).k == 2
    store.path.write_text("{not json")
    broken = PreferenceStore(tmp_path / "config")
    broken.remember("third")
    assert store.path.read_text() == "{not json"


async def test_the_app_lists_the_model_it_opened(model, tmp_path):
    """`edge0 chat /path/to/model`, no setting changed: the model is remembered once loaded,
    so `edge0 list` and the picker show it (issue 51 item 4)."""
    store = PreferenceStore(tmp_path / "config")
    app = _app(model, tmp_path, _kept(store, model))
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        await wait_until(pilot, lambda: model_key(str(model)) in store.models(), "remembered")
    assert store.load(model_key(str(model)), SHORT) == ModelPreferences(generation=SHORT)
