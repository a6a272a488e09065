"""What several commands do besides their options: read a text file, print the engine's warnings
and notes and other lines on stderr, each with its control characters shown escaped (a warning
quotes a file's name or a tokenizer's text; stdout is escaped by `CheckedStdout`)."""

from __future__ import annotations

import sys
from pathlib import Path

from edge0_tui.sanitize import escape_controls
from engine import Edge0Error


def read_text(path: Path, what: str = "text", max_chars: int | None = None) -> str:
    """A UTF-8 file a command was given (--text, --prompt-file); unreadable is an Edge0Error.
    With `max_chars`, only the first that many characters are read (what the command uses): a
    sparse file of a gigabyte took twice that in memory when read whole for the few megabytes
    a phase encodes."""
    if path.exists() and not path.is_file():  # a FIFO would block forever, a device never end
        raise Edge0Error(f"{path}: cannot read {what} (not a regular file)")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(-1 if max_chars is None else max_chars)
    except (OSError, UnicodeDecodeError) as e:
        raise Edge0Error(f"{path}: cannot read {what} ({e})") from None


def print_stderr(line: str) -> None:
    """One line (or several, a log's) on stderr, control characters shown escaped."""
    print(escape_controls(line), file=sys.stderr, flush=True)


def print_warnings(warnings: list[str], kind: str = "warning") -> None:
    """`edge0: warning: ...` (or `note`) lines, each one line whatever it quotes."""
    for warning in warnings:
        print(f"edge0: {kind}: {escape_controls(warning, keep_newlines=False)}", file=sys.stderr)


def edge0_version() -> str:
    """The installed package's version (a source tree that is not installed has none)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("edge0")
    except PackageNotFoundError:
        return "(not installed)"
