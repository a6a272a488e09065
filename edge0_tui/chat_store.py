"""Saved conversations: one SQLite file in the data directory.

Every message is written in its own transaction as soon as it is final (a user message when sent, a
reply when it ends), so a crash loses at most the reply being generated. WAL mode lets a second edge0
read the chats while this one writes. The schema version lives in `PRAGMA user_version`.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from engine import Edge0Error

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE chats (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    model TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE messages (
    id INTEGER PRIMARY KEY,
    chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
    role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
    content TEXT NOT NULL,
    -- for replies: "eos", "max_tokens", "cancelled" or "error"; NULL for other roles
    stopped_by TEXT,
    created_at REAL NOT NULL
);
CREATE INDEX messages_by_chat ON messages (chat_id, id);
"""


@dataclass(frozen=True)
class ChatSummary:
    id: int
    title: str
    model: str
    updated_at: float
    message_count: int


@dataclass(frozen=True)
class ChatMessage:
    role: str  # "system", "user" or "assistant"
    content: str
    stopped_by: str | None = None

    def as_prompt(self) -> dict:
        """The `role`/`content` dict the engine's chat template takes."""
        return {"role": self.role, "content": self.content}


class ChatStore:
    """Chats and their messages in `<data_dir>/chats.sqlite3`. Use from one thread (the UI's)."""

    def __init__(self, data_dir: str | Path) -> None:
        self.path = Path(data_dir) / "chats.sqlite3"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # isolation_level=None: no implicit transactions; each write below opens its own.
            self._db = sqlite3.connect(self.path, isolation_level=None)
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA foreign_keys = ON")
            self._migrate()
        except (OSError, sqlite3.Error) as e:
            raise Edge0Error(f"{self.path}: cannot open the chat database ({e})") from None

    def _migrate(self) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version == SCHEMA_VERSION:
            return
        if version != 0:
            raise Edge0Error(
                f"{self.path} has schema version {version}; this edge0 reads version {SCHEMA_VERSION}"
            )
        # One script, one transaction: a half-created schema never stays behind.
        self._db.executescript(f"BEGIN; {_SCHEMA} PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;")

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """Commits what the `with` block wrote, or rolls all of it back on an exception."""
        self._db.execute("BEGIN")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def create_chat(self, title: str, model: str) -> int:
        now = time.time()
        with self._transaction():
            cursor = self._db.execute(
                "INSERT INTO chats (title, model, created_at, updated_at) VALUES (?, ?, ?, ?)",
                (title, model, now, now),
            )
        return int(cursor.lastrowid)

    def add_message(self, chat_id: int, message: ChatMessage) -> None:
        now = time.time()
        with self._transaction():
            self._db.execute(
                "INSERT INTO messages (chat_id, role, content, stopped_by, created_at) "
                "VALUES (?, ?, ?, ?, ?)",
                (chat_id, message.role, message.content, message.stopped_by, now),
            )
            self._db.execute("UPDATE chats SET updated_at = ? WHERE id = ?", (now, chat_id))

    def chats(self) -> list[ChatSummary]:
        """Every chat, most recently updated first."""
        rows = self._db.execute(
            "SELECT c.id, c.title, c.model, c.updated_at, COUNT(m.id) FROM chats c "
            "LEFT JOIN messages m ON m.chat_id = c.id GROUP BY c.id "
            "ORDER BY c.updated_at DESC, c.id DESC"
        ).fetchall()
        return [ChatSummary(*row) for row in rows]

    def messages(self, chat_id: int) -> list[ChatMessage]:
        rows = self._db.execute(
            "SELECT role, content, stopped_by FROM messages WHERE chat_id = ? ORDER BY id",
            (chat_id,),
        ).fetchall()
        return [ChatMessage(*row) for row in rows]

    def delete_chat(self, chat_id: int) -> None:
        with self._transaction():
            self._db.execute("DELETE FROM chats WHERE id = ?", (chat_id,))

    def close(self) -> None:
        self._db.close()


def chat_title(first_message: str, width: int = 48) -> str:
    """A chat's title: the first line of its first message, cut to `width` characters."""
    line = first_message.strip().splitlines()[0] if first_message.strip() else "New chat"
    return line if len(line) <= width else line[: width - 1] + "…"
