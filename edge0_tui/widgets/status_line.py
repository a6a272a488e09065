"""The status line: model, K, mode, context tokens, peak memory, and what the engine is doing."""

from __future__ import annotations

from dataclasses import dataclass

from textual.widgets import Static

from engine import format_bytes

from ..sanitize import sanitize


@dataclass(frozen=True)
class Status:
    model: str
    state: str  # "loading model…", "ready", "writing…", "no model"
    k: int | None = None
    pending_k: int | None = None
    mode: str | None = None
    pending_mode: str | None = None
    context_tokens: int | None = 0  # None: not known yet
    peak_memory_bytes: int = 0
    unsaved: int = 0  # messages the chat database has not taken yet (it is locked)

    def line(self) -> str:
        parts = [self.model or "no model"]
        if self.k is not None:
            parts.append(f"K {self.k}" + (f" → {self.pending_k}" if self.pending_k else ""))
        if self.mode:
            parts.append(self.mode + (f" → {self.pending_mode}" if self.pending_mode else ""))
        context = "–" if self.context_tokens is None else self.context_tokens
        parts.append(f"context {context} tokens")
        parts.append(f"peak MLX {format_bytes(self.peak_memory_bytes)}")
        if self.unsaved:
            parts.append(f"{self.unsaved} unsaved: database busy")
        parts.append(self.state)
        return "  │  ".join(parts)


class StatusLine(Static):
    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("", markup=False, id=id)
        self.status: Status | None = None

    def show(self, status: Status) -> None:
        if status != self.status:
            self.status = status
            # The model's name and the state quote a path or repo id: shown cleaned.
            self.update(sanitize(status.line()))
