"""The wall in one line, for terminals too small for the side panels (the compact layout).

    12.4 tok/s │ blocked 33 ms (41%) │ cold 29% │ 3.2 loads/step │ MLX 21 MiB

The same figures as the panels, from the same snapshot; F6 shows the full panels instead of the chat.
"""

from __future__ import annotations

from textual.widgets import Static

from engine import format_bytes

from ..live_metrics import LiveMetrics


def wall_line(metrics: LiveMetrics) -> str:
    token_ms = 1e3 / metrics.tok_per_s if metrics.tok_per_s else 0.0
    share = f" ({metrics.blocked_ms / token_ms:.0%})" if token_ms else ""
    parts = [
        f"{metrics.tok_per_s:.1f} tok/s",
        f"blocked {metrics.blocked_ms:.0f} ms{share}",
        f"cold {metrics.cold_fraction:.0%}",
        f"{metrics.loads_per_step:.1f} loads/step",
    ]
    step = metrics.last_step
    if step is not None:
        parts.append(f"MLX {format_bytes(step.mlx_active_bytes + step.mlx_cache_bytes)}")
    return " │ ".join(parts)


class WallStrip(Static):
    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("", markup=False, id=id)

    def show(self, metrics: LiveMetrics) -> None:
        self.update(wall_line(metrics))
