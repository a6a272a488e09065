"""A reply's text split as it streams: reasoning, content, and tool calls at the end.

Thinking models write their reasoning between the chat template's think tags (`<think>` and
`</think>`); a template whose generation prompt already opened the tag starts the reply inside
it. What follows the closing tag is the content. A tool call opens with its dialect's marker
(tool_calls.py): from there on the text is held back and parsed once the reply has ended; text
before it is content. Text that could still become a tag (`</thi` at the end) is held back
until the next piece says, and so are newlines in reasoning until what follows them shows whether
they are the closing tag's (`\n</think>`: dropped, as the newlines after `<think>` are). A
dialect's parse that finds no call gives the text back as content.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

from .tool_calls import Dialect, ToolCall

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class TemplateFacts:
    """What the model's chat template says about its replies."""

    thinks: bool  # it has think tags: reasoning is split out
    dialect: Dialect | None  # its tool-call dialect, if any
    # It reads the `tools` it is given: a template that never names them drops a request's
    # tools without a word, so the reply says so (`TOOLS_IGNORED`).
    takes_tools: bool = True


def _held(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` may begin one of `markers`."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


class ReplyParts:
    """Feed the reply's new text; get ("reasoning" | "content", text) pieces; `finish` gives the
    last pieces and the tool calls."""

    def __init__(self, facts: TemplateFacts, thinking: bool, tools: bool) -> None:
        self.thinks = facts.thinks
        self.dialect = facts.dialect if tools else None
        self.reasoning = thinking and facts.thinks  # the prompt opened the think tag
        self.started = False  # content has begun: a think tag now is text
        self.thought = False  # reasoning has begun (its leading newlines are the tag's)
        self.pending = ""  # text not yet given out
        # While `pending` is all blank that the split holds back (newlines in reasoning, blank
        # before a think tag), more of the same waits here unsplit: splitting it again at every
        # piece would scan all of it every time. `blank_of`: the characters it is made of.
        self.blank_of: str | None = None
        self.blank: list[str] = []
        # From the first call's marker on, the pieces as they came: joined once, at the end
        # (adding each to one string would copy the held text at every piece).
        self.calls_pieces: list[str] | None = None

    def feed(self, text: str) -> list[tuple[str, str]]:
        if self.calls_pieces is not None:
            self.calls_pieces.append(text)
            return []
        if self.blank_of is not None and not text.strip(self.blank_of):
            self.blank.append(text)
            return []
        self._take_blank()
        self.pending += text
        return self._split(final=False)

    def finish(self) -> tuple[list[tuple[str, str]], list[ToolCall]]:
        self._take_blank()
        pieces = self._split(final=True)
        if self.calls_pieces is None:
            return pieces, []
        calls_text = "".join(self.calls_pieces)
        text, calls = self.dialect.parse(calls_text)
        if not calls:
            return [*pieces, ("content", calls_text)], []
        if text:
            pieces.append(("content", text))
        return pieces, [call.with_id() for call in calls]

    def _take_blank(self) -> None:
        self.pending += "".join(self.blank)
        self.blank.clear()

    def _split(self, final: bool) -> list[tuple[str, str]]:
        pieces: list[tuple[str, str]] = []
        self.blank_of = None
        while self.pending:
            if self.reasoning:
                end = self.pending.find(THINK_CLOSE)
                if end < 0:
                    keep = 0 if final else _held(self.pending, (THINK_CLOSE,))
                    if not final:  # newlines that may come right before the closing tag
                        body = self.pending[: len(self.pending) - keep]
                        keep += len(body) - len(body.rstrip("\n"))
                    self._give(pieces, "reasoning", self.pending[: len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep :]
                    if self.pending and not self.pending.strip("\n"):
                        self.blank_of = "\n"
                    return pieces
                self._give(pieces, "reasoning", self.pending[:end].rstrip("\n"))
                self.pending = self.pending[end + len(THINK_CLOSE) :].lstrip("\n")
                self.reasoning = False
                continue
            if self.thinks and not self.started:
                stripped = self.pending.lstrip()
                if stripped.startswith(THINK_OPEN):  # the model opened the tag itself
                    self.pending = stripped[len(THINK_OPEN) :]
                    self.reasoning = True
                    continue
                if not final and THINK_OPEN.startswith(stripped):
                    if not stripped:
                        self.blank_of = string.whitespace
                    return pieces  # may still become the tag
            starts = self.dialect.starts if self.dialect is not None else ()
            found = [i for i in (self.pending.find(s) for s in starts) if i >= 0]
            if found:
                at = min(found)
                self._give(pieces, "content", self.pending[:at])
                self.calls_pieces, self.pending = [self.pending[at:]], ""
                return pieces
            keep = 0 if final else _held(self.pending, starts)
            self._give(pieces, "content", self.pending[: len(self.pending) - keep])
            self.pending = self.pending[len(self.pending) - keep :]
            return pieces
        return pieces

    def _give(self, pieces: list[tuple[str, str]], kind: str, text: str) -> None:
        if kind == "reasoning" and not self.thought:
            text = text.lstrip("\n")
            self.thought = bool(text)
        if not text:
            return
        if kind == "content":
            if not self.started:
                text = text.lstrip("\n") if self.thinks else text
                if not text:
                    return
            self.started = True
        if pieces and pieces[-1][0] == kind:
            pieces[-1] = (kind, pieces[-1][1] + text)
        else:
            pieces.append((kind, text))
