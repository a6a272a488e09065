"""stdout while an `edge0` command runs: a write that fails is a one-line error, not a traceback,
and no control character reaches the terminal."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TextIO

from edge0_tui.sanitize import escape_controls
from engine import Edge0Error

STDOUT_CLOSED = "stdout is closed (use >/dev/null to discard output)"


class StdoutError(Edge0Error):
    """stdout cannot take the command's output (a full device, a descriptor closed under us)."""


class CheckedStdout:
    """sys.stdout while a command runs: a write or flush that fails is a one-line `StdoutError`
    instead of an OSError traceback. BrokenPipeError passes through as it is: the reader went away
    (`| head`), which is not an error.

    Every text written is escaped (`escape_controls`): a model's reply, a file name or a tokenizer's
    text can hold ESC sequences that set the window title or clear the screen, and edge0 itself
    writes none to stdout. Whether or not stdout is a terminal: a pipe often ends at one (`| less
    -R`, `| tee`). JSON output (`--json`) is unchanged by this, since `json.dumps` escapes every
    control character itself; it is where the exact text is."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(escape_controls(text))
        except BrokenPipeError:
            raise
        except OSError as e:
            raise StdoutError(f"cannot write to stdout ({e.strerror or e})") from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as e:
            raise StdoutError(f"cannot write to stdout ({e.strerror or e})") from None

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def run_checked(run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a command with stdout checked, and flush it before returning: output still buffered
    would otherwise fail in the interpreter's exit flush, after every handler here is gone."""
    stdout, sys.stdout = sys.stdout, CheckedStdout(sys.stdout)
    try:
        status = run(args)
        sys.stdout.flush()
        return status
    finally:
        sys.stdout = stdout


def discard_stdout() -> None:
    """Point stdout's descriptor at /dev/null once stdout has failed: the output still in its
    buffer then goes nowhere instead of failing again (with a message) when Python exits."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a real file (tests capture stdout in memory): nothing to flush at exit
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
