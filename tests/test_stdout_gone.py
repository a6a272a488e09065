"""Stdout that goes away or cannot take the output (`| head`, /dev/full, closed): a quiet,
traceback-free end, or one `edge0: error:` line. Each runs in a process of its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from cli_runner import REPO
from test_bad_inputs import assert_refused

# -- 6: stdout that goes away or cannot take the output ---------------------------------------------


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "edge0_tui.cli", *args]


def _generate_argv(model: Path, *extra: str) -> list[str]:
    return _cli("generate", str(model), "--prompt", "hello", "--max-tokens", "40", *extra)


@pytest.mark.parametrize("extra", [[], ["--json"]])
def test_reader_that_goes_away_ends_quietly(checkpoint_dir, extra):
    """`edge0 generate ... | head -c 0`: the reader is gone before the first write."""
    argv = _generate_argv(checkpoint_dir("qwen3_moe"), *extra)
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=300) == 141, stderr
    assert stderr == ""  # no message, no traceback, not even from the interpreter's exit flush


def test_head_of_a_long_reply(checkpoint_dir):
    model = checkpoint_dir("qwen3_moe")
    script = 'set -o pipefail; "$@" | head -c 10 >/dev/null'
    argv = _generate_argv(model, "--max-tokens", "3000")
    out = subprocess.run(
        ["bash", "-c", script, "_", *argv], capture_output=True, text=True, cwd=REPO
    )
    assert out.returncode in (0, 141), out.stderr  # 0 when the reply fit in the pipe at once
    assert "Traceback" not in out.stderr and "Exception" not in out.stderr


@pytest.mark.parametrize("command", ["generate", "info", "--help", "--version"])
def test_full_device_is_one_line(checkpoint_dir, command):
    """--help and --version too: argparse ignores a failed write, and exited 0 with no text."""
    model = checkpoint_dir("qwen3_moe")
    argv = {
        "generate": _generate_argv(model),
        "info": _cli("info", str(model)),
    }.get(command, _cli(command))
    with open("/dev/full", "w") as full:
        out = subprocess.run(argv, stdout=full, stderr=subprocess.PIPE, text=True, cwd=REPO)
    assert_refused(out, None, "cannot write to stdout (No space left on device)")


def test_closed_stdout_is_one_line(checkpoint_dir):
    argv = _generate_argv(checkpoint_dir("qwen3_moe"))
    out = subprocess.run(
        ["bash", "-c", 'exec "$@" >&-', "_", *argv], capture_output=True, text=True, cwd=REPO
    )
    assert_refused(out, None, "stdout is closed")
