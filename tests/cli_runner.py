"""`edge0 ARGS` in this process, seen as a subprocess would see it: exit status, stdout and stderr.

Starting a process per case costs a second or more (importing MLX, mlx-lm, transformers); running
`edge0_tui.cli.main` here costs the command alone. What a separate process would print is kept:

- stdout and stderr are captured at the Python level and at the file descriptors 1 and 2, so text
  written by C or Rust code (MLX, tokenizers) or by a child process (bench arms) is seen too;
- Python warnings are filtered as in a plain `python -m edge0_tui.cli` and printed to stderr
  (pytest's own filters only record them);
- logging prints as in a fresh process: handlers made earlier on another stream write to this
  stderr, and a record no handler takes goes to stderr through logging's last resort (pytest's
  handlers on the root logger are set aside);
- an uncaught exception is a traceback on stderr and status 1, a `SystemExit` its code;
- a command that does not end within `timeout` seconds fails the test, as subprocess.run's
  timeout did (it is left blocked in a daemon thread).

What only a real process can show (the exit flush, SIGPIPE's status 141, a closed or full
descriptor 1, argv bytes, `edge0_tui.cli.entry`) is tested with `run_process`;
tests/test_cli_runner.py checks that this runner sees what a process would.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys
import tempfile
import threading
import traceback
import warnings
from pathlib import Path

from edge0_tui.cli import main

REPO = Path(__file__).resolve().parents[1]


def run_process(*args: str | bytes, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m edge0_tui.cli ARGS` in a process of its own (`entry`, as the `edge0` command)."""
    command = [sys.executable, "-m", "edge0_tui.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=timeout)


def _python_default_warnings() -> None:
    """The warning filters of `python -m edge0_tui.cli` without -W or -X dev (the CLI module is
    `__main__` there), each warning printed to sys.stderr as Python does."""
    warnings.resetwarnings()
    warnings.filterwarnings(
        "default", category=DeprecationWarning, module=r"__main__|edge0_tui\.cli"
    )
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.filterwarnings("ignore", category=category, append=True)

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    warnings.showwarning = show


def _loggers() -> list[logging.Logger]:
    known = logging.Logger.manager.loggerDict.values()
    return [logging.getLogger(), *(x for x in known if isinstance(x, logging.Logger))]


@contextlib.contextmanager
def _logging_to(stream):
    """Logging as in a fresh process, writing to `stream`."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers = [h for h in handlers if type(h) is logging.StreamHandler]  # not pytest's
    root.setLevel(logging.WARNING)
    moved = [
        (h, h.setStream(stream))
        for logger in _loggers()
        for h in logger.handlers
        if type(h) is logging.StreamHandler and h.stream is not stream
    ]
    try:
        yield
    finally:
        for handler, previous in moved:
            handler.setStream(previous)
        root.handlers, root.level = handlers, level


@contextlib.contextmanager
def _descriptor_to_file(fd: int):
    """Descriptor `fd` pointed at a temporary file for the block; yields the file."""
    with tempfile.TemporaryFile() as file:
        saved = os.dup(fd)
        os.dup2(file.fileno(), fd)
        try:
            yield file
        finally:
            os.dup2(saved, fd)
            os.close(saved)


def _read(file) -> str:
    file.seek(0)
    return file.read().decode(errors="replace")


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`edge0 ARGS` through `edge0_tui.cli.main` in this process (cwd: the repository, as
    `run_process`); returns what `run_process` would. With EDGE0_TEST_CLI=process in the
    environment every call is `run_process` instead (slower; to compare the two)."""
    if os.environ.get("EDGE0_TEST_CLI") == "process":
        return run_process(*args, timeout=timeout)
    result: dict = {}

    def command() -> None:
        with warnings.catch_warnings():
            _python_default_warnings()
            try:
                status = main(list(args))
            except SystemExit as e:
                status = e.code
            except Exception:
                traceback.print_exc()
                status = 1
        if status is None:
            status = 0
        elif not isinstance(status, int):  # sys.exit("text") prints the text, exits 1
            print(status, file=sys.stderr)
            status = 1
        result["status"] = status

    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        with (
            _descriptor_to_file(1) as fd_out,
            _descriptor_to_file(2) as fd_err,
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
            _logging_to(err),
        ):
            worker = threading.Thread(target=command, name="edge0 main", daemon=True)
            worker.start()
            worker.join(timeout)
            stdout, stderr = out.getvalue() + _read(fd_out), err.getvalue() + _read(fd_err)
    finally:
        os.chdir(cwd)
    if worker.is_alive():
        raise subprocess.TimeoutExpired(["edge0", *args], timeout, stdout, stderr)
    return subprocess.CompletedProcess(["edge0", *args], result["status"], stdout, stderr)
