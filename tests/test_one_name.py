"""One name for a model everywhere (issue 35 item 4): `info`, `generate` (and every command that
takes MODEL) resolve `demo`, a folder and a Hub id as `chat` and `serve` do, with chat's words
when they cannot; `chat --k`; settings kept by the model's identity, so `chat assets/demo` finds
those saved under "demo"."""

from __future__ import annotations

import json

import pytest
from cli_runner import run_cli
from test_tui_app import wait_until

from edge0_tui import cli
from edge0_tui.commands import chat
from edge0_tui.model_source import BUNDLED_DEMO
from edge0_tui.preferences import ModelPreferences, PreferenceStore, model_key
from engine import GenerationConfig


def test_info_and_generate_open_the_demo_by_name():
    out = run_cli("info", "demo", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["model"] == "demo"  # the bundled folder's name
    out = run_cli("generate", "demo", "--prompt", "Good morrow", "--max-tokens", "3", "--json")
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["tokens"]) == 3


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An empty Hugging Face cache, offline: nothing is sent anywhere."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))


@pytest.mark.parametrize("command", [["info"], ["generate", "--prompt", "x"]])
def test_a_hub_id_not_cached_offline_gives_chats_message(offline_hub, capsys, command):
    assert cli.main(["chat", "nobody/no-such-model"]) == 2
    chat_error = capsys.readouterr().err
    assert "offline, and no complete copy is cached" in chat_error
    name, *rest = command
    assert cli.main([name, "nobody/no-such-model", *rest]) == 2
    assert capsys.readouterr().err == chat_error  # the same line, word for word


def test_the_demo_folder_by_its_path_is_the_demo():
    assert model_key("demo") == model_key(str(BUNDLED_DEMO)) == "demo"
    assert model_key(str(BUNDLED_DEMO.relative_to(BUNDLED_DEMO.parents[1]))) in (
        "demo",
        "assets/demo",  # only when run from elsewhere than the repository
    )


def test_a_hub_snapshot_folder_is_its_repo_id(tmp_path):
    snapshot = tmp_path / "models--owner--some-model" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    assert model_key(str(snapshot)) == model_key("owner/some-model") == "owner/some-model"
    other = tmp_path / "mine"
    other.mkdir()
    assert model_key(str(other)) == str(other.resolve())


def _build(argv: list[str], tmp_path):
    args = cli.build_parser().parse_args(["chat", *argv, "--data-dir", str(tmp_path)])
    return chat.build_app(args)


async def test_chat_by_the_demo_path_finds_the_settings_kept_under_demo(tmp_path, monkeypatch):
    monkeypatch.chdir(BUNDLED_DEMO.parents[1])  # the repository: `assets/demo` is a path here
    store = PreferenceStore(cli.options.config_dir())
    kept = ModelPreferences(generation=GenerationConfig(temperature=0.3, max_tokens=77), k=2)
    store.save("demo", kept)
    app = _build(["assets/demo"], tmp_path)
    assert app.preferences.model == "demo"
    assert app.chat_screen.controller.settings.temperature == 0.3
    # The demo's own defaults come with it: the small budgets that show the wall.
    assert app.session.engine_config.expert_cache_bytes == 4 << 20
    assert app.session.engine_config.page_cache_bytes == 4 << 20
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.session.metrics.k == 2, "the kept K=2", timeout=30)


async def test_chat_k_starts_at_that_k_over_the_kept_one(tmp_path):
    PreferenceStore(cli.options.config_dir()).save("demo", ModelPreferences(k=2))
    app = _build(["demo", "--k", "8"], tmp_path)
    assert app.session.engine_config.k == 8
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.chat_screen.controller.ready, "the model", timeout=30)
        await pilot.pause(0.3)
        assert app.session.engine.k == 8 and app.session.metrics.k == 8
