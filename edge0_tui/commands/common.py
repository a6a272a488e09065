"""What several commands do besides their options: read a text file, print the engine's warnings."""

from __future__ import annotations

import sys
from pathlib import Path

from engine import Edge0Error


def read_text(path: Path, what: str = "text") -> str:
    """A UTF-8 file a command was given (--text, --prompt-file); unreadable is an Edge0Error."""
    if path.exists() and not path.is_file():  # a FIFO would block forever, a device never end
        raise Edge0Error(f"{path}: cannot read {what} (not a regular file)")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise Edge0Error(f"{path}: cannot read {what} ({e})") from None


def print_warnings(warnings: list[str]) -> None:
    for warning in warnings:
        print(f"edge0: warning: {warning}", file=sys.stderr)
