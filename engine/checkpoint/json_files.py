"""JSON files: read strictly and within a bound, and written so that the reader reads them back.

A checkpoint's JSON (config, tokenizer, index) and the small files edge0 keeps for itself (each
K profile's measured quality, the app's settings, the last session) are all data from disk. They
are read by one reader: UTF-8, no NaN or Infinity, nesting too deep for the parser a ValueError
(not a RecursionError), and, for a kept file, a size bound checked on the open file before a byte
is read (a FIFO does not block it, a huge file is not read). The writer of a kept file checks its
text against the same bound: a file it writes is one the reader reads back, and a value too big
for the bound is refused, the file on disk left as it was.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path

from ..config import format_bytes
from ..errors import Edge0Error


def parse_json(raw: bytes | str, check_surrogates: bool = False) -> object:
    """Strict JSON: UTF-8, no NaN or Infinity; any defect is a ValueError saying what is wrong.

    With `check_surrogates`, strings holding an unpaired UTF-16 surrogate (`"\\ud800"`, which Python
    reads but C++ readers such as MLX's refuse) are refused too.
    """
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        value = json.loads(text, parse_constant=_refuse_constant)
        if check_surrogates and "\\u" in text:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("a string holds an unpaired UTF-16 surrogate") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None
    return value


def _refuse_constant(name: str) -> object:
    raise ValueError(f"{name} is not valid JSON")


def read_json_file(
    path: Path, invalid: str = "invalid JSON ({})", max_bytes: int | None = None
) -> object:
    """The strict JSON value (`parse_json`) of the file at `path`. An unreadable or invalid file
    is an Edge0Error naming it: "cannot read (why)", or `invalid` with what is wrong. With
    `max_bytes`, a path that is not a regular file, or a file of more bytes, is refused unread."""
    try:
        raw = path.read_bytes() if max_bytes is None else _read_at_most(path, max_bytes)
        return parse_json(raw)
    except OSError as e:
        raise Edge0Error(f"{path}: cannot read ({e.strerror or e})") from None
    except ValueError as e:
        raise Edge0Error(f"{path}: {invalid.format(e)}") from None


def _read_at_most(path: Path, max_bytes: int) -> bytes:
    # O_NONBLOCK: opening a FIFO does not wait for a writer, so it can be refused below.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise Edge0Error(f"{path}: not a regular file")
        if info.st_size > max_bytes:
            raise Edge0Error(f"{path}: {_more_than(info.st_size, max_bytes)}")
        raw = file.read(max_bytes + 1)  # a file that grew since fstat is cut here
    if len(raw) > max_bytes:
        raise Edge0Error(f"{path}: {_more_than(len(raw), max_bytes)}")
    return raw


def write_json_file(
    path: Path,
    value: object,
    max_bytes: int,
    what: str,
    mode: int = 0o644,
    indent: int | None = 1,
) -> None:
    """Write `value` to `path` whole or not at all (a temp file beside it, renamed into place),
    as `read_json_file(path, max_bytes=max_bytes)` reads it back. A text of more than `max_bytes`
    is refused unwritten. Any failure is an Edge0Error: "{path}: cannot save {what} (why)"."""
    try:
        data = encode_json(value, indent)
    except (ValueError, RecursionError) as e:
        raise Edge0Error(f"{path}: cannot save {what} (not JSON: {e})") from None
    if len(data) > max_bytes:
        raise Edge0Error(f"{path}: cannot save {what} ({_more_than(len(data), max_bytes)})")
    try:
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=".tmp")
        try:
            os.fchmod(fd, mode)
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            os.replace(temp, path)
        except BaseException:
            os.unlink(temp)
            raise
    except OSError as e:
        raise Edge0Error(f"{path}: cannot save {what} ({e.strerror or e})") from None


def encode_json(value: object, indent: int | None = None) -> bytes:
    """`value` as compact UTF-8 JSON (a non-ASCII character is its 1-4 bytes, not a 12-byte
    `\\u` pair). An unpaired surrogate, which UTF-8 cannot hold, is written as its `\\u` escape:
    surrogates only occur inside strings, where that escape reads back as the same character."""
    text = json.dumps(value, indent=indent, ensure_ascii=False, allow_nan=False)
    return text.encode("utf-8", "backslashreplace")


def _more_than(size: int, max_bytes: int) -> str:
    return f"{size} bytes, more than the {format_bytes(max_bytes)} such a file may hold"
