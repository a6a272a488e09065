"""Saved conversations: one SQLite file in the data directory.

Every message is written in its own transaction as soon as it is final (a user message when sent, a
reply when it ends), so a crash loses at most the reply being generated. WAL mode lets a second edge0
read the chats while this one writes. The schema version lives in `PRAGMA user_version`.

Another program may hold the database's write lock (a second edge0, an `sqlite3` shell inside a
transaction). A write waits for it up to `BUSY_TIMEOUT_S`; past that, `save` keeps the message in
memory, in order, and writes it with the next save or on `close`, so what the user wrote is never
dropped. Conversations are private: the directory is 0700, the database and its -wal/-shm files 0600
(looser modes left by an older edge0 are tightened on open). Text is stored through `sanitize`.
"""

from __future__ import annotations

import os
import sqlite3
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from engine import Edge0Error

from .sanitize import sanitize

SCHEMA_VERSION = 1
# How long a write waits for another program's lock before the message is kept for later. The UI
# thread waits that long, so a few seconds: enough for any normal transaction to end.
BUSY_TIMEOUT_S = 3.0
PRIVATE_DIR, PRIVATE_FILE = 0o700, 0o600

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
    # With a search: the first message that holds it (None: only the title does).
    match: str | None = None


@dataclass(frozen=True)
class ChatMessage:
    role: str  # "system", "user" or "assistant"
    content: str
    stopped_by: str | None = None

    def as_prompt(self) -> dict:
        """The `role`/`content` dict the engine's chat template takes."""
        return {"role": self.role, "content": self.content}

    def cleaned(self) -> ChatMessage:
        return replace(self, content=sanitize(self.content))


@dataclass
class ChatHandle:
    """A chat as the app holds it: `id` is None until its row is written (the database may be
    locked when its first message is saved)."""

    title: str
    model: str
    id: int | None = None


class ChatStore:
    """Chats and their messages in `<data_dir>/chats.sqlite3`. Use from one thread (the UI's)."""

    def __init__(self, data_dir: str | Path) -> None:
        self.path = Path(data_dir) / "chats.sqlite3"
        # Saved messages the database refused (locked, full), oldest first; see `save`.
        self._unsaved: list[tuple[ChatHandle, ChatMessage]] = []
        self.last_error = ""  # why the latest save had to wait
        try:
            _private_directory(self.path.parent)
            for suffix in ("", "-wal", "-shm"):
                _refuse_link(self.path.with_name(self.path.name + suffix))
            _private_file(self.path)
            # isolation_level=None: no implicit transactions; each write below opens its own.
            self._db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
            self._migrate()  # first: a file refused is left byte for byte (WAL rewrites its header)
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA foreign_keys = ON")
            # SQLite gives new -wal/-shm files the database's mode; older ones may be looser.
            for suffix in ("-wal", "-shm"):
                _private_file(self.path.with_name(self.path.name + suffix), create=False)
        except (OSError, sqlite3.Error) as e:
            raise Edge0Error(f"{self.path}: cannot open the chat database ({e})") from None

    def _migrate(self) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version == SCHEMA_VERSION:
            self._check_schema()
            return
        if version != 0:
            raise Edge0Error(
                f"{self.path} has schema version {version}; this edge0 reads version {SCHEMA_VERSION}"
            )
        # One script, one transaction: a half-created schema never stays behind.
        self._db.executescript(f"BEGIN; {_SCHEMA} PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;")

    def _check_schema(self) -> None:
        """The tables and columns of version 1 are there: a file that says version 1 without them
        left every message pending forever ("no such table"), and the chat was lost. Such a file
        is refused and left as it is (it may hold someone's data), never repaired or replaced."""
        for table, columns in _expected_columns().items():
            found = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
            if not found:
                raise Edge0Error(
                    f"{self.path}: says schema version {SCHEMA_VERSION} but has no {table!r} "
                    "table; left as it is (move it away to start a new chat database)"
                )
            missing = sorted(columns - found)
            if missing:
                raise Edge0Error(
                    f"{self.path}: the {table!r} table has no {missing[0]!r} column; left as it "
                    "is (move it away to start a new chat database)"
                )

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """Commits what the `with` block wrote, or rolls all of it back on an exception."""
        # IMMEDIATE takes the write lock now, waiting for another writer up to the busy timeout.
        self._db.execute("BEGIN IMMEDIATE")
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
                (sanitize(title), sanitize(model), now, now),
            )
        return int(cursor.lastrowid)

    def add_message(self, chat_id: int, message: ChatMessage) -> None:
        now = time.time()
        with self._transaction():
            self._db.execute(
                "INSERT INTO messages (chat_id, role, content, stopped_by, created_at) "
                "VALUES (?, ?, ?, ?, ?)",
                (chat_id, message.role, sanitize(message.content), message.stopped_by, now),
            )
            self._db.execute("UPDATE chats SET updated_at = ? WHERE id = ?", (now, chat_id))

    def save(self, chat: ChatHandle, message: ChatMessage) -> bool:
        """Write `message` to `chat` (creating the chat on its first message) after any messages
        still waiting. False when the database stays locked (or full): the message waits in
        memory, in order, for the next `save`, `flush` or `close`; `last_error` says why."""
        self._unsaved.append((chat, message.cleaned()))
        return self.flush()

    def flush(self) -> bool:
        """Write the messages that are waiting, oldest first; True when none is left."""
        while self._unsaved:
            chat, message = self._unsaved[0]
            try:
                if chat.id is None:
                    chat.id = self.create_chat(chat.title, chat.model)
                self.add_message(chat.id, message)
            except sqlite3.OperationalError as e:  # locked, busy, full, read-only: try again later
                self.last_error = str(e)
                return False
            except sqlite3.Error:
                # Not the database's state but this message (a bug): it can never be written, so
                # it must not hold back the ones after it.
                self._unsaved.pop(0)
                raise
            self._unsaved.pop(0)
        self.last_error = ""
        return True

    @property
    def unsaved(self) -> int:
        """Messages waiting to be written."""
        return len(self._unsaved)

    def chats(self, matching: str = "") -> list[ChatSummary]:
        """Every chat, most recently updated first; with `matching`, those whose title or any
        message holds it (case-insensitive for ASCII letters, as SQLite's LIKE)."""
        where, args, hit = "", (), "NULL"
        if matching:
            pattern = (
                "%" + matching.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            )
            where = (
                "WHERE c.title LIKE ?1 ESCAPE '\\' OR EXISTS (SELECT 1 FROM messages s WHERE "
                "s.chat_id = c.id AND s.content LIKE ?1 ESCAPE '\\') "
            )
            args = (pattern,)
            hit = (
                "(SELECT s.content FROM messages s WHERE s.chat_id = c.id AND s.content LIKE ?1 "
                "ESCAPE '\\' ORDER BY s.id LIMIT 1)"
            )
        rows = self._db.execute(
            f"SELECT c.id, c.title, c.model, c.updated_at, COUNT(m.id), {hit} FROM chats c "
            f"LEFT JOIN messages m ON m.chat_id = c.id {where}GROUP BY c.id "
            "ORDER BY c.updated_at DESC, c.id DESC",
            args,
        ).fetchall()
        # Cleaned on the way out too: a database written by an older edge0 may hold raw text.
        return [
            ChatSummary(
                id, sanitize(title), sanitize(model), updated, count, match and sanitize(match)
            )
            for id, title, model, updated, count, match in rows
        ]

    def messages(self, chat_id: int) -> list[ChatMessage]:
        """A chat's messages, those still waiting to be written included."""
        rows = self._db.execute(
            "SELECT role, content, stopped_by FROM messages WHERE chat_id = ? ORDER BY id",
            (chat_id,),
        ).fetchall()
        waiting = [message for chat, message in self._unsaved if chat.id == chat_id]
        return [ChatMessage(*row).cleaned() for row in rows] + waiting

    def rename_chat(self, chat_id: int, title: str) -> None:
        with self._transaction():
            self._db.execute("UPDATE chats SET title = ? WHERE id = ?", (sanitize(title), chat_id))

    def drop_last_reply(self, chat: ChatHandle) -> None:
        """Forget the chat's last message, a reply about to be written again: the one still
        waiting in memory if it is there, else the last one in the database."""
        for i in range(len(self._unsaved) - 1, -1, -1):
            if self._unsaved[i][0] is chat:
                if self._unsaved[i][1].role == "assistant":
                    del self._unsaved[i]
                return
        if chat.id is None:
            return
        with self._transaction():
            self._db.execute(
                "DELETE FROM messages WHERE id = (SELECT MAX(id) FROM messages WHERE chat_id = ?) "
                "AND role = 'assistant'",
                (chat.id,),
            )

    def delete_chat(self, chat_id: int) -> None:
        with self._transaction():
            self._db.execute("DELETE FROM chats WHERE id = ?", (chat_id,))

    def close(self) -> int:
        """Write what is waiting (a last try) and close. Returns how many messages were lost."""
        while True:
            try:
                self.flush()
                break
            except sqlite3.Error:
                continue  # that message cannot be written (flush dropped it); the next may be
        lost = self.unsaved
        self._db.close()
        return lost


def _expected_columns() -> dict[str, set[str]]:
    """Each table of `_SCHEMA` and its columns, read from the schema itself (in memory)."""
    db = sqlite3.connect(":memory:")
    try:
        db.executescript(_SCHEMA)
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        return {t: {row[1] for row in db.execute(f"PRAGMA table_info({t})")} for t in tables}
    finally:
        db.close()


def _refuse_link(path: Path) -> None:
    """A symbolic link where the database (or its -wal/-shm) goes is refused, not followed:
    followed, its target's mode was changed and a dangling link created the target."""
    if os.path.islink(path):
        raise Edge0Error(
            f"{path}: a symbolic link; the chat database must be a regular file (not followed, "
            "nothing changed)"
        )


def _private_directory(path: Path) -> None:
    """`path` as a directory only its owner can enter (created 0700, or tightened)."""
    path.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)
    _tighten(path, PRIVATE_DIR)


def _private_file(path: Path, create: bool = True) -> None:
    """`path` as a file only its owner can read: created 0600 before SQLite opens it (SQLite would
    create it 0644), or tightened when an older edge0 left it looser."""
    if create:  # O_NOFOLLOW: a link made since `_refuse_link` looked is not followed either
        nofollow = getattr(os, "O_NOFOLLOW", 0)
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | nofollow, PRIVATE_FILE))
    if path.exists():
        _tighten(path, PRIVATE_FILE)


def _tighten(path: Path, private: int) -> None:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & ~private:  # any group or other bit
        path.chmod(mode & private)


def chat_title(first_message: str, width: int = 48) -> str:
    """A chat's title: the first line of its first message, cut to `width` characters."""
    line = first_message.strip().splitlines()[0] if first_message.strip() else "New chat"
    return line if len(line) <= width else line[: width - 1] + "…"
