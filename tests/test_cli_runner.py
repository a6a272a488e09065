"""The in-process runner of the CLI tests (`cli_runner.run_cli`) sees what a separate process
would: output at the descriptors, warnings, logging, tracebacks, exit statuses, a hang."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import warnings

import cli_runner
import pytest
from cli_runner import run_cli, run_process


def _as_main(monkeypatch, function) -> None:
    monkeypatch.setattr(cli_runner, "main", function)


def test_output_from_python_c_code_and_children_is_seen(monkeypatch):
    def main(argv):
        print("python out")
        print("python err", file=sys.stderr)
        os.write(1, b"fd out\n")  # as C or Rust code writes
        os.write(2, b"fd err\n")
        subprocess.run([sys.executable, "-c", "import sys; sys.stderr.write('child err\\n')"])
        return 0

    _as_main(monkeypatch, main)
    out = run_cli("x")
    assert out.returncode == 0
    assert out.stdout.splitlines() == ["python out", "fd out"]
    assert sorted(out.stderr.splitlines()) == ["child err", "fd err", "python err"]


def test_warnings_and_logging_are_printed_as_in_a_fresh_process(monkeypatch):
    from transformers.utils import logging as hf_logging

    def main(argv):
        warnings.warn("a user warning", UserWarning, stacklevel=1)
        warnings.warn("a library's deprecation", DeprecationWarning, stacklevel=1)  # hidden
        logging.getLogger("some.library").warning("a logged warning")  # logging's last resort
        logging.getLogger("some.library").info("an info record")  # below WARNING: hidden
        hf_logging.get_logger("transformers.x").warning("a transformers warning")  # own handler
        return 0

    _as_main(monkeypatch, main)
    err = run_cli("x").stderr
    for seen in ("a user warning", "a logged warning", "a transformers warning"):
        assert seen in err, err
    assert "deprecation" not in err and "info record" not in err, err


@pytest.mark.parametrize(
    "outcome, status, text",
    [
        (lambda: 2, 2, ""),
        (lambda: None, 0, ""),
        (lambda: sys.exit(3), 3, ""),
        (lambda: sys.exit("bye"), 1, "bye\n"),
        (lambda: 1 / 0, 1, "ZeroDivisionError"),
    ],
    ids=["returned", "none", "exit", "exit text", "exception"],
)
def test_exit_status_as_a_process_has_it(monkeypatch, outcome, status, text):
    _as_main(monkeypatch, lambda argv: outcome())
    out = run_cli("x")
    assert out.returncode == status and text in out.stderr
    assert ("Traceback" in out.stderr) == (text == "ZeroDivisionError")


def test_a_command_that_hangs_fails_the_test(monkeypatch):
    release = threading.Event()
    _as_main(monkeypatch, lambda argv: release.wait())
    streams, cwd = (sys.stdout, sys.stderr), os.getcwd()
    with pytest.raises(subprocess.TimeoutExpired):
        run_cli("x", timeout=0.2)
    release.set()
    assert (sys.stdout, sys.stderr) == streams and os.getcwd() == cwd  # given back


def test_the_real_command_agrees_with_a_process(tmp_path):
    """A refused command both ways: the same status, stdout and stderr."""
    args = ["generate", str(tmp_path / "no-model"), "--prompt", "x"]
    inside, process = run_cli(*args), run_process(*args)
    assert inside.returncode == 2 and inside.stderr.startswith("edge0: error: ")
    assert (inside.returncode, inside.stdout, inside.stderr) == (
        process.returncode,
        process.stdout,
        process.stderr,
    )
