"""Adapters outside the checkpoint: `--adapters DIR|REPO_ID`, the automatic per-model folder, the
search order (explicit folders, the model folder, the automatic folder), what `edge0 info` says
about it, the app's K selector, and one-line errors for a bad `--adapters`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from adapters import write_random_profile

from edge0_tui.app import Edge0App
from edge0_tui.cli import main
from edge0_tui.model_source import resolve_adapters
from edge0_tui.widgets.routing_selector import RoutingSelector
from engine.config import EngineConfig
from engine.errors import Edge0Error
from engine.runtime.generation import Engine

PROFILE_FILES = ("prerouter_k{k}.safetensors", "lora_k{k}.safetensors")


def _no_progress(what, done, total) -> None:
    pass


def _profile_in(folder: Path, model_dir: Path, k: int, seed: int = 0) -> Path:
    """A random K profile made for `model_dir`'s base, moved into `folder`."""
    write_random_profile(model_dir, k, seed=seed)
    folder.mkdir(parents=True, exist_ok=True)
    for name in PROFILE_FILES:
        shutil.move(model_dir / name.format(k=k), folder / name.format(k=k))
    return folder


def _fingerprint(model_dir: Path) -> str:
    with Engine(model_dir, EngineConfig(mode="on-demand")) as engine:
        return engine.fingerprint


@pytest.fixture
def model(checkpoint_dir, tmp_path, monkeypatch) -> Path:
    model_dir = tmp_path / "model"
    shutil.copytree(checkpoint_dir("qwen3_moe"), model_dir)
    monkeypatch.setenv("EDGE0_DATA_DIR", str(tmp_path / "data"))
    return model_dir


def test_search_order_and_info_says_where_each_profile_comes_from(model, tmp_path, capsys):
    first = _profile_in(tmp_path / "first", model, 2, seed=1)
    second = _profile_in(tmp_path / "second", model, 4)
    _profile_in(second, model, 2, seed=2)  # K=2 again, later: shadowed by `first`
    write_random_profile(model, 2, seed=3)  # K=2 in the model folder too: shadowed
    auto = tmp_path / "data" / "adapters" / _fingerprint(model)
    _profile_in(auto, model, 8, seed=4)  # shadowed by the model folder's K=8
    _profile_in(auto, model, 16)  # only here
    write_random_profile(model, 8)  # the model folder's own K=8

    args = ["info", str(model), "--adapters", str(first), "--adapters", str(second)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"K=2: prerouter + lora (recovered, --adapters folder: {first / 'prerouter_k2'}" in out
    assert f"K=4: prerouter + lora (recovered, --adapters folder: {second}" in out
    assert f"K=8: prerouter + lora (recovered, model folder: {model}" in out
    assert f"K=16: prerouter + lora (recovered, auto folder: {auto}" in out
    for shadowed in (second / "prerouter_k2", model / "prerouter_k2", auto / "prerouter_k8"):
        assert "shadowed (an earlier folder has K=" in out and str(shadowed) in out
    searched = [line.split()[-1] for line in out.splitlines() if "adapters searched" in line]
    assert searched == [str(first), str(second), str(model), str(auto)]

    # The engine routes by what the search found: K=4's heads from `second`.
    config = EngineConfig(mode="prerouter", k=4, adapter_dirs=(second,), data_dir=tmp_path / "data")
    with Engine(model, config) as engine:
        assert engine.adapters[4].prerouter == second / "prerouter_k4.safetensors"
        assert engine.lora is not None
        assert {p.k for p in engine.profiles() if p.prerouter} == {2, 4, 8, 16}


def test_generate_with_adapters_runs_the_prerouter(model, tmp_path, capsys):
    folder = _profile_in(tmp_path / "mine", model, 4)
    args = ["generate", str(model), "--prompt", "x", "--max-tokens", "3", "--mode", "prerouter"]
    assert main(args + ["--adapters", str(folder), "--json"]) == 0
    assert '"k": 4' in capsys.readouterr().out
    assert main(args) == 2  # without it the model has no heads
    assert "prerouter mode needs" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["missing", "a file", "empty", "another base"])
def test_bad_adapters_folder_is_a_one_line_error(model, tmp_path, capsys, checkpoint_dir, case):
    folder = tmp_path / "bad"
    if case == "a file":
        folder.write_text("x")
    elif case == "empty":
        folder.mkdir()
    elif case == "another base":
        other = tmp_path / "other"
        shutil.copytree(checkpoint_dir("bailing_moe"), other)
        _profile_in(folder, other, 4)
    expected = {
        "missing": f"--adapters {folder}: no such folder",
        "a file": f"--adapters {folder}: not a folder",
        "empty": f"--adapters {folder}: no adapter files",
        "another base": f"{folder / 'lora_k4.safetensors'}: trained for another base model",
    }[case]
    for command in (["info", str(model)], ["generate", str(model), "--prompt", "x"]):
        assert main([*command, "--adapters", str(folder)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("edge0: error: ") and expected in err, err
        assert err.count("\n") == 1


def _fake_hub_cache(cache: Path, repo: str, files: dict[str, bytes]) -> None:
    """A Hugging Face cache holding one snapshot of `repo` (what a download leaves behind)."""
    commit = "0" * 40
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        (snapshot / name).write_bytes(data)


def test_repo_id_uses_the_adapter_files_of_the_cached_snapshot(model, tmp_path, monkeypatch):
    made = _profile_in(tmp_path / "made", model, 4)
    cache = tmp_path / "hub"
    files = {name: (made / name).read_bytes() for name in ("prerouter_k4.safetensors",)}
    _fake_hub_cache(cache, "someone/adapters", {**files, "README.md": b"hello"})
    _fake_hub_cache(cache, "someone/nothing", {"README.md": b"hello"})

    folder = resolve_adapters("someone/adapters", _no_progress, offline=True, cache_dir=cache)
    assert (folder / "prerouter_k4.safetensors").exists()
    config = EngineConfig(mode="prerouter", adapter_dirs=(folder,), data_dir=tmp_path / "data")
    with Engine(model, config) as engine:
        assert engine.k == 4 and engine.adapters[4].origin == "--adapters"

    with pytest.raises(Edge0Error, match="^--adapters someone/nothing: .* no adapter files"):
        resolve_adapters("someone/nothing", _no_progress, offline=True, cache_dir=cache)
    with pytest.raises(Edge0Error, match="^--adapters someone/absent: offline, and no complete"):
        resolve_adapters("someone/absent", _no_progress, offline=True, cache_dir=cache)
    # A local folder is never sent to the Hub, even when it looks like owner/name.
    local = tmp_path / "owner" / "name"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_adapters("owner/name", _no_progress) == Path("owner/name")


def test_cli_repo_id_offline_without_cache_is_a_one_line_error(model, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    command = [sys.executable, "-m", "edge0_tui.cli", "info", str(model)]
    out = subprocess.run(
        [*command, "--adapters", "someone/absent"], capture_output=True, text=True, env=env
    )
    assert out.returncode == 2
    assert out.stderr.startswith("edge0: error: --adapters someone/absent: ")
    assert "no complete copy is cached" in out.stderr and out.stderr.count("\n") == 1


async def test_chat_app_offers_the_profiles_of_adapters(model, tmp_path):
    folder = _profile_in(tmp_path / "mine", model, 4)
    app = Edge0App(
        model=str(model),
        engine_config=EngineConfig(
            expert_cache_bytes=200_000, adapter_dirs=(str(folder),), data_dir=tmp_path / "data"
        ),
        data_dir=tmp_path / "chats",
        cache_dir=tmp_path / "cache",
    )
    async with app.run_test(size=(120, 40)) as pilot:
        for _ in range(500):
            if app.chat_screen.controller.ready:
                break
            await pilot.pause(0.02)
        assert app.chat_screen.controller.ready
        profiles = app.chat_screen.query_one(RoutingSelector).profiles
        assert any(p.k == 4 and p.prerouter and p.lora for p in profiles)
        await pilot.press("ctrl+q")
