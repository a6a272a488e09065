"""Hostile state, round 3 (issue 33): kept settings that passed the checks and broke every start,
and a chat database that is a symlink or says schema version 1 without its tables. Each is one
warning or one error naming the file, and no user data is changed or lost."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
from pathlib import Path

import pytest

from edge0_tui.chat_store import ChatStore
from edge0_tui.preferences import (
    FILE_NAME,
    ModelPreferences,
    PreferenceStore,
    fit_to_model,
)
from engine import Edge0Error, GenerationConfig

# -- 10: settings -------------------------------------------------------------------------------------


def _store(tmp_path: Path, **entry) -> PreferenceStore:
    (tmp_path / FILE_NAME).write_text(json.dumps({"version": 1, "models": {"m": entry}}))
    return PreferenceStore(tmp_path)


def test_a_lone_surrogate_in_the_system_prompt_is_a_warning(tmp_path):
    """Was: kept, then every message failed to encode."""
    store = PreferenceStore(tmp_path)
    (tmp_path / FILE_NAME).write_text('{"models": {"m": {"system_prompt": "hi \\udcff"}}}')
    prefs = store.load("m", GenerationConfig())
    assert prefs.system_prompt == ""
    assert store.warning.startswith(f"{tmp_path / FILE_NAME}: system_prompt: not valid Unicode")


def test_max_tokens_beyond_the_context_falls_back_once_loaded(tmp_path):
    """Was: max_tokens 1e9 kept, and every message refused (prompt plus max_tokens over the
    context)."""
    store = _store(tmp_path, max_tokens=10**9)
    prefs = store.load("m", GenerationConfig())
    assert prefs.generation.max_tokens == 10**9  # in range for GenerationConfig
    fitted, warning = fit_to_model(prefs, 4096, GenerationConfig(max_tokens=512), store.path)
    assert fitted.generation.max_tokens == 512
    assert warning == (
        f"{store.path}: max_tokens=1000000000 does not fit this model's context of 4096 "
        "tokens; using 512"
    )
    same, none = fit_to_model(ModelPreferences(), 4096, GenerationConfig(), store.path)
    assert none is None and same == ModelPreferences()


def test_a_kept_expert_cache_that_cannot_load_falls_back(checkpoint_dir, tmp_path):
    """Was: expert_cache_bytes 1 kept, and the model never loaded again."""
    from edge0_tui.engine_session import EngineSession
    from engine import EngineConfig

    model = str(checkpoint_dir("qwen3_moe"))
    session = EngineSession(model, EngineConfig(expert_cache_bytes=1), tmp_path / "cache")
    session.fallback = (EngineConfig(expert_cache_auto=True), f"{tmp_path}/models.json: x=1")
    engine = session._open()
    try:
        name, notices = session._opened
        assert notices[0].startswith(f"{tmp_path}/models.json: x=1: ")
        assert "cannot hold" in notices[0] and notices[0].endswith("; using the default")
        assert session.fallback is None and session.engine_config.expert_cache_auto
    finally:
        engine.close()


def test_cli_chat_sets_the_fallback_only_for_a_kept_expert_cache(checkpoint_dir, monkeypatch):
    from edge0_tui import cli
    from edge0_tui.app import Edge0App
    from edge0_tui.commands import options
    from edge0_tui.preferences import model_key

    launched = []
    monkeypatch.setattr(Edge0App, "run", lambda self: launched.append(self))
    model = str(checkpoint_dir())
    PreferenceStore(options.config_dir()).save(
        model_key(model), ModelPreferences(expert_cache_bytes=1)
    )
    assert cli.main(["chat", model]) == 0
    config, why = launched[-1].session.fallback
    assert config.expert_cache_auto and why.endswith("models.json: expert_cache_bytes=1")
    assert cli.main(["chat", model, "--expert-cache", "5M"]) == 0
    assert launched[-1].session.fallback is None


# -- 11: a database that says version 1 without its schema ----------------------------------------


def _version_1(path: Path, script: str = "") -> None:
    db = sqlite3.connect(path)
    db.executescript(f"{script} PRAGMA user_version = 1;")
    db.close()


@pytest.mark.parametrize(
    "script, problem",
    [
        ("", "says schema version 1 but has no 'chats' table"),
        (
            "CREATE TABLE chats (id INTEGER PRIMARY KEY, title TEXT); CREATE TABLE messages (x);",
            "the 'chats' table has no 'created_at' column",
        ),
    ],
)
def test_version_1_without_its_tables_is_refused_and_kept(tmp_path, script, problem):
    """Was: accepted; every message then 'pending: the database is busy (no such table)'."""
    path = tmp_path / "chats.sqlite3"
    _version_1(path, script)
    before = path.read_bytes()
    with pytest.raises(Edge0Error, match=f"^{path}: {problem}.*left as it is"):
        ChatStore(tmp_path)
    assert path.read_bytes() == before


# -- 14: a symlinked database ---------------------------------------------------------------------


def test_a_symlinked_database_is_not_followed(tmp_path):
    """Was: the target's mode changed to 0600, then 'not a database'."""
    target = tmp_path / "mine.txt"
    target.write_text("not a database")
    target.chmod(0o644)
    (tmp_path / "data").mkdir()
    link = tmp_path / "data" / "chats.sqlite3"
    link.symlink_to(target)
    with pytest.raises(Edge0Error, match=f"^{link}: a symbolic link; .*not followed"):
        ChatStore(tmp_path / "data")
    assert stat.S_IMODE(target.stat().st_mode) == 0o644 and target.read_text() == "not a database"


@pytest.mark.parametrize("suffix", ["", "-wal"])
def test_a_dangling_link_creates_nothing(tmp_path, suffix):
    """Was: the link's target created (as the database)."""
    (tmp_path / "data").mkdir()
    link = tmp_path / "data" / f"chats.sqlite3{suffix}"
    link.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(Edge0Error, match="a symbolic link"):
        ChatStore(tmp_path / "data")
    assert not os.path.lexists(tmp_path / "elsewhere")


def test_a_good_database_still_opens(tmp_path):
    ChatStore(tmp_path)  # creates it
    store = ChatStore(tmp_path)  # and reads it back, schema checked
    assert store.path.exists()
