"""Text that edge0 did not write (a model's reply, a file's name, a tokenizer's token, a chat
template's message) never reaches the terminal raw: every control character the CLI prints is shown
escaped (`\\x1b`), on stdout and stderr; `--json` keeps the exact text, JSON-escaped."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from adapters import copy_model
from cli_runner import run_cli

from edge0_tui.sanitize import escape_controls

# A title change, a bell and a screen clear: what a hostile model or file would send.
HOSTILE = "\x1b]0;PWNED\x07\x1b[2J"
SHOWN = "\\x1b]0;PWNED\\x07\\x1b[2J"
# Anything a terminal obeys rather than shows (newline and tab aside).
CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def assert_shown_escaped(text: str) -> None:
    assert not CONTROLS.search(text), repr(text)
    assert SHOWN in text, text


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def hostile_decoder(model: Path) -> None:
    """Every reply the tokenizer decodes becomes HOSTILE (a Replace step after byte-level)."""

    def edit(t: dict) -> None:
        replace = {"type": "Replace", "pattern": {"Regex": "[\\s\\S]+"}, "content": HOSTILE}
        t["decoder"] = {"type": "Sequence", "decoders": [t["decoder"], replace]}

    _edit_json(model / "tokenizer.json", edit)


def test_escape_controls():
    assert (
        escape_controls("a\x1b[2Jb\r\x7f\x9b\u202ec\n\t") == "a\\x1b[2Jb\\x0d\\x7f\\x9b\\u202ec\n\t"
    )
    assert escape_controls("a\nb\tc", keep_newlines=False) == "a\\x0ab\\x09c"
    text = "caf\u00e9 \U0001f600 " + HOSTILE
    for n in range(len(text)):  # a prefix escapes to a prefix: a streamed reply never shows less
        assert escape_controls(text).startswith(escape_controls(text[:n]))


def test_generate_reply_is_escaped_and_json_exact(checkpoint_dir, tmp_path):
    model = copy_model(checkpoint_dir("qwen3_moe"), tmp_path)
    hostile_decoder(model)
    args = ["generate", str(model), "--prompt", "hi", "--max-tokens", "3"]
    out = run_cli(*args)
    assert out.returncode == 0, out.stderr
    assert_shown_escaped(out.stdout)
    assert not CONTROLS.search(out.stderr), out.stderr
    out = run_cli(*args, "--json")
    assert out.returncode == 0, out.stderr
    assert not CONTROLS.search(out.stdout)  # JSON-escaped on the stream ...
    assert HOSTILE in json.loads(out.stdout)["text"]  # ... and exact once parsed


def stray_shard(model: Path) -> None:
    shutil.copy(model / "model.safetensors", model / f"model-{HOSTILE}.safetensors")


def index_names_hostile_shard(model: Path) -> None:
    _edit_json(
        model / "model.safetensors.index.json",
        lambda i: i["weight_map"].update({"lm_head.weight": f"model-{HOSTILE}.safetensors"}),
    )


def hostile_merge(model: Path) -> None:
    _edit_json(model / "tokenizer.json", lambda t: t["model"]["merges"].insert(0, [HOSTILE, "t"]))


def hostile_template(model: Path) -> None:
    template = "{{ raise_exception('" + HOSTILE + "') }}"
    _edit_json(model / "tokenizer_config.json", lambda t: t.update(chat_template=template))


@pytest.mark.parametrize(
    ("breaks", "command", "status"),
    [
        (stray_shard, "info", 0),  # a warning (and info's own lines)
        (index_names_hostile_shard, "generate", 2),
        (hostile_merge, "generate", 2),  # "Token ... out of vocabulary"
        (hostile_template, "generate", 2),
    ],
    ids=["stray shard name", "index shard name", "tokenizer merge", "chat template message"],
)
def test_file_text_in_messages_is_escaped(checkpoint_dir, tmp_path, breaks, command, status):
    model = copy_model(checkpoint_dir("qwen3_moe"), tmp_path)
    breaks(model)
    args = [command, str(model)] + (["--prompt", "hi", "--max-tokens", "1"] * (command != "info"))
    out = run_cli(*args)
    assert out.returncode == status, out.stderr
    assert "Traceback" not in out.stderr
    assert_shown_escaped(out.stdout + out.stderr)
    if status:
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_adapter_folder_name_is_escaped(checkpoint_dir, tmp_path):
    folder = tmp_path / f"adapters{HOSTILE}\nedge0: ok"
    out = run_cli("info", str(checkpoint_dir("qwen3_moe")), "--adapters", str(folder))
    assert out.returncode == 2, out.stderr
    assert_shown_escaped(out.stderr)
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr  # a newline cannot forge a line


def test_adapter_file_name_is_escaped(checkpoint_dir, tmp_path):
    """`info` lists the profile's files: a file name is text from the folder too."""
    from adapters import write_random_profile

    model = copy_model(checkpoint_dir("qwen3_moe"), tmp_path)
    write_random_profile(model, 2)
    (model / "prerouter_k2.safetensors").rename(model / f"prerouter_k2{HOSTILE}.safetensors")
    out = run_cli("info", str(model))
    assert out.returncode == 0, out.stderr
    assert_shown_escaped(out.stdout)
    assert not CONTROLS.search(out.stderr), out.stderr
