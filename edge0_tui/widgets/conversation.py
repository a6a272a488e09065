"""The conversation: user turns as plain text, assistant replies as Markdown streamed in."""

from __future__ import annotations

from markdown_it import MarkdownIt
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Label, Markdown, Static
from textual.widgets.markdown import MarkdownStream

from ..chat_store import ChatMessage
from ..sanitize import sanitize

# What the line under a reply says about how it ended; nothing for a normal end.
ENDINGS = {
    "eos": "",
    "max_tokens": "stopped: reached the max tokens setting",
    "cancelled": "stopped by you",
    "error": "stopped by an error",
}


def ending(stopped_by: str | None, nonfinite_repaired: int = 0) -> str:
    """The line under a reply: how it ended, and whether its numbers needed repair."""
    parts = [ENDINGS.get(stopped_by or "", stopped_by or "")]
    if nonfinite_repaired:
        # The engine's guard replaced NaN/inf hidden values so decoding could go on; the reply
        # may be degraded, and the user should know it was not a clean run.
        parts.append(f"numerical repair: {nonfinite_repaired} non-finite values fixed")
    return " · ".join(p for p in parts if p)


def reply_parser() -> MarkdownIt:
    """Textual's Markdown parser, with every newline of the model's text a line break: verse and
    lists written line by line keep their lines (plain Markdown joins them into one paragraph).
    markdown-it's `breaks` option acts only in its HTML renderer, so the soft breaks are turned
    into hard ones in the token stream that Textual's Markdown widget reads."""
    parser = MarkdownIt("gfm-like")
    parser.core.ruler.push("hard_breaks", _hard_breaks)
    return parser


def _hard_breaks(state) -> None:
    for token in state.tokens:
        for child in token.children or ():
            if child.type == "softbreak":
                child.type = "hardbreak"


class UserTurn(Static):
    """What the user wrote, shown as typed (no Markdown, no markup)."""

    def __init__(self, text: str) -> None:
        super().__init__(sanitize(text), markup=False)


class ChatNote(Label):
    """A line about the chat itself, not a turn: which model answers from here. Shown, not saved
    (the model is not part of what the next model reads)."""

    def __init__(self, text: str) -> None:
        super().__init__(sanitize(text), markup=False)


class AssistantTurn(Vertical):
    """One reply: Markdown that text streams into, and a line saying how the reply ended."""

    def __init__(self, text: str = "", stopped_by: str | None = None) -> None:
        super().__init__()
        self.text = sanitize(text)  # kept here: never read back from the Markdown widget
        self._stopped_by = stopped_by
        self._stream: MarkdownStream | None = None

    def compose(self) -> ComposeResult:
        # Links in model output must not open a browser on a stray click.
        yield Markdown(self.text, open_links=False, parser_factory=reply_parser)
        yield Label("", markup=False, classes="ending")

    def on_mount(self) -> None:
        self.set_class(self._stopped_by is None and not self.text, "-writing")
        self._show_ending(ending(self._stopped_by))

    def _show_ending(self, line: str) -> None:
        # A normal end says nothing: no empty line under the reply either.
        label = self.query_one(".ending", Label)
        label.update(line)
        label.display = bool(line)

    async def append(self, text: str) -> None:
        """Add streamed text at the end. Markdown.get_stream merges writes that arrive faster than
        the widget renders, and re-parses only the last block."""
        text = sanitize(text)
        self.text += text
        if self._stream is None:
            self._stream = Markdown.get_stream(self.query_one(Markdown))
        await self._stream.write(text)

    async def finish(self, text: str, stopped_by: str, nonfinite_repaired: int = 0) -> None:
        """End the reply with its full text (one clean parse; a stream can leave partial-block
        state behind) and say how it ended."""
        text = sanitize(text)
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.text = text
        await self.query_one(Markdown).update(text)
        self._show_ending(ending(stopped_by, nonfinite_repaired))
        self.set_class(nonfinite_repaired > 0, "-repaired")
        self.remove_class("-writing")


class Conversation(VerticalScroll):
    """The turns of one chat, kept scrolled to the newest unless the user scrolls up."""

    def on_mount(self) -> None:
        self.anchor()

    async def add_user_turn(self, text: str) -> None:
        await self.mount(UserTurn(text))

    async def add_reply(self) -> AssistantTurn:
        reply = AssistantTurn()
        await self.mount(reply)
        return reply

    async def add_note(self, text: str) -> None:
        await self.mount(ChatNote(text))

    async def drop_last_reply(self) -> None:
        replies = self.query(AssistantTurn)
        if replies:
            await replies.last().remove()

    async def show(self, messages: list[ChatMessage]) -> None:
        """Replace the turns with those of a saved chat."""
        await self.remove_children()
        turns = [
            UserTurn(m.content) if m.role == "user" else AssistantTurn(m.content, m.stopped_by)
            for m in messages
            if m.role in ("user", "assistant")
        ]
        if turns:
            await self.mount_all(turns)
        self.anchor()
