"""What the app showed when it closed: the chat on screen and the text typed but not sent.

The next start opens that chat again with the text back in the prompt, as oterm and Elia reopen
theirs. One small JSON file beside the chats (`last_session.json`), private like them, written
through a temp file renamed into place. The file is treated as hostile like every file: one that is
too big, not a regular file or not what this module writes is ignored (the app starts on the latest
chat instead), never a traceback. What is written is bounded as what is read: a session too big to
be read back is refused when it is kept, not ignored at the next start.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine import Edge0Error, read_json_file, write_json_file

from .chat_store import PRIVATE_FILE
from .sanitize import sanitize

FILE_NAME = "last_session.json"
# A draft is what fits in a prompt box; a file much larger than that is not ours.
MAX_FILE_BYTES = 1 << 20


@dataclass(frozen=True)
class LastSession:
    chat_id: int | None  # None: a new chat, not saved yet
    draft: str = ""  # the prompt's unsent text


class LastSessionFile:
    def __init__(self, data_dir: str | Path) -> None:
        self.path = Path(data_dir) / FILE_NAME

    def load(self) -> LastSession | None:
        """The session kept at the last quit; None when there is none or it cannot be read."""
        try:
            kept = read_json_file(self.path, max_bytes=MAX_FILE_BYTES)
        except Edge0Error:
            return None
        if not isinstance(kept, dict):
            return None
        chat_id, draft = kept.get("chat_id"), kept.get("draft", "")
        if not (chat_id is None or (isinstance(chat_id, int) and chat_id > 0)):
            return None
        return LastSession(chat_id, sanitize(draft) if isinstance(draft, str) else "")

    def save(self, session: LastSession) -> None:
        """Keep `session` for the next start, as `load` reads it back. Raises Edge0Error when it
        cannot be written, or is too big to be read back (the file left as it was)."""
        kept = {"chat_id": session.chat_id, "draft": session.draft}
        write_json_file(
            self.path, kept, MAX_FILE_BYTES, "the unsent text", mode=PRIVATE_FILE, indent=None
        )
