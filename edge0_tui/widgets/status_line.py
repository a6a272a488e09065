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
    peak_memory_bytes: int = 0  # MLX's peak
    peak_rss_bytes: int = 0  # the kernel's high-water mark of the process's RSS; 0: not known yet
    unsaved: int = 0  # messages the chat database has not taken yet (it is locked)

    def line(self, width: int | None = None) -> str:
        """The line, fitted to `width` columns: the least needed parts go first (peak memory,
        then context), then the model's name is shortened; K, mode and the state always stay."""
        context = "–" if self.context_tokens is None else self.context_tokens
        # (text, priority): lower priorities are dropped first when the line does not fit.
        parts = [(self.model or "no model", 3)]
        if self.k is not None:
            parts.append((f"K {self.k}" + (f" → {self.pending_k}" if self.pending_k else ""), 9))
        if self.mode:
            pending = f" → {self.pending_mode}" if self.pending_mode else ""
            parts.append((self.mode + pending, 9))
        parts.append((f"context {context} tokens", 2))
        # A peak not measured yet (0: no step since the model loaded) is left out, not shown as 0 B.
        peaks = [
            f"{name} {format_bytes(n)}"
            for name, n in (("MLX", self.peak_memory_bytes), ("RSS", self.peak_rss_bytes))
            if n
        ]
        if peaks:
            parts.append(("peak " + ", ".join(peaks), 1))
        if self.unsaved:
            parts.append((f"{self.unsaved} unsaved: database busy", 8))
        parts.append((self.state, 9))
        line = _joined(parts)
        while width is not None and len(line) > width:
            lowest = min(priority for _, priority in parts)
            if lowest == 3:  # only the model's name can give more: its end is what tells
                name, rest = parts[0][0], _joined(parts[1:])
                room = width - len(rest) - len(SEPARATOR) - 1
                if room >= 8:
                    return _joined([("…" + name[-room:], 3), *parts[1:]])
            if lowest >= 8:
                return line[: width - 1] + "…"
            parts = [p for p in parts if p[1] != lowest]
            line = _joined(parts)
        return line


SEPARATOR = "  │  "


def _joined(parts: list[tuple[str, int]]) -> str:
    return SEPARATOR.join(text for text, _ in parts)


class StatusLine(Static):
    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("", markup=False, id=id)
        self.status: Status | None = None

    def show(self, status: Status) -> None:
        if status != self.status:
            self.status = status
            self._render_line()

    def on_resize(self) -> None:
        self._render_line()

    def _render_line(self) -> None:
        if self.status is not None:
            # The model's name and the state quote a path or repo id: shown cleaned.
            width = self.content_size.width or None
            self.update(sanitize(self.status.line(width)))
