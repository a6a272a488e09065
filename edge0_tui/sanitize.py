"""Text made safe for the terminal: the one function every shown or stored text goes through.

A saved chat, a model's reply, a model's name or an error message can hold bytes a terminal obeys
rather than shows: an OSC sequence that sets the window title (`ESC ] 0 ; ... BEL`) or writes the
clipboard (OSC 52), CSI sequences that move the cursor or recolour the screen, a NUL, a DEL, C1
controls (0x80-0x9f, the one-byte forms of ESC sequences), bidi overrides that make text read
backwards. `sanitize` removes those and keeps everything else as written: Unicode, emoji, newlines,
tabs and Markdown.

A whole sequence is removed, not only its ESC, so `ESC ] 0 ; title BEL` leaves nothing behind. A
sequence cut off at the end of the text is removed up to that end, so `sanitize(prefix)` is a prefix
of `sanitize(text)`: a reply cleaned as it streams in never shows text that later disappears.
"""

from __future__ import annotations

import re

_SEQUENCES = re.compile(
    # CSI (ESC [ or its C1 form): parameter bytes, intermediate bytes, the final byte.
    r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]?"
    # OSC, DCS, SOS, PM, APC (and their C1 forms): a string up to BEL or ST (ESC \ or 0x9c). The
    # string also ends before an ESC or a newline, so a stray opener cannot swallow a whole reply.
    r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d-\x9f])[^\x07\x1b\x9c\n]*(?:\x07|\x1b\\|\x9c)?"
    # Any other escape: ESC, intermediate bytes, a final byte.
    r"|\x1b[ -/]*[0-~]?"
)
# Left after the sequences: C0 controls but newline and tab (CR goes too: it rewinds the line),
# DEL, C1 controls, and the bidi embeddings, overrides and isolates (U+202A-202E, U+2066-2069).
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def sanitize(text: str) -> str:
    """`text` without terminal control sequences and control characters (newlines, tabs kept)."""
    return _CONTROLS.sub("", _SEQUENCES.sub("", text))


# What `escape_controls` shows escaped: C0 controls, DEL, C1 controls, the bidi embeddings,
# overrides and isolates; newline and tab where the caller keeps them.
_ESCAPED = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_ESCAPED_ALL = re.compile(r"[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape_controls(text: str, keep_newlines: bool = True) -> str:
    """`text` with every control character shown visibly escaped instead of obeyed: ESC as `\\x1b`,
    CR as `\\x0d`, DEL as `\\x7f`, a C1 control as `\\x9b`, a bidi override as `\\u202e`. Newlines
    and tabs are kept unless `keep_newlines` is False (a one-line message). Where `sanitize` drops
    what a terminal would obey (the app's view), this shows it: for the CLI's plain output and its
    error lines, which say what a file holds. Character by character, so the escape of a prefix is a
    prefix of the escape of the whole (a reply escaped as it streams in)."""
    return (_ESCAPED if keep_newlines else _ESCAPED_ALL).sub(_escape, text)


def error_line(error: BaseException | None) -> str:
    """An exception as one line: its type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
