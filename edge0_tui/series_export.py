"""The live series saved to a file: the recent decode steps the panels draw (tok/s, blocked ms,
cold share, memory, hit rates), one row a step, as CSV or JSON, from the palette.

The rows are the engine's own step figures (`StepMetrics`) and the app's token times; nothing is
averaged or resampled, so a spreadsheet or a notebook sees what the sparklines were drawn from.
"""

from __future__ import annotations

import csv
import io
import json
import time
from pathlib import Path

from engine import Edge0Error

from .live_metrics import LiveMetrics

FORMATS = ("csv", "json")
FIELDS = (
    "step",
    "k",
    "mode",
    "token_ms",
    "tok_per_s",
    "forward_ms",
    "blocked_ms",
    "loads",
    "hits",
    "hit_rate",
    "mib_read",
    "cold_fraction",
    "prefetch_hit_rate",
    "mlx_active_bytes",
    "mlx_cache_bytes",
    "rss_bytes",
    "page_cache_expert_bytes",
)


def series_rows(metrics: LiveMetrics) -> list[dict]:
    """One dict a decode step, oldest first: the steps the panels show."""
    rows = []
    for i, (step, token_ms) in enumerate(zip(metrics.recent_steps, metrics.recent_token_ms)):
        wanted = step.loads + step.hits
        rows.append(
            {
                "step": i + 1,
                "k": step.k,
                "mode": step.mode,
                "token_ms": round(token_ms, 3),
                "tok_per_s": round(1e3 / token_ms, 3) if token_ms > 0 else None,
                "forward_ms": round(step.wall_ms, 3),
                "blocked_ms": round(step.blocked_ms, 3),
                "loads": step.loads,
                "hits": step.hits,
                "hit_rate": round(step.hits / wanted, 4) if wanted else None,
                "mib_read": round(step.mib_read, 4),
                "cold_fraction": round(step.cold_fraction, 4),
                "prefetch_hit_rate": step.prefetch_hit_rate,
                "mlx_active_bytes": step.mlx_active_bytes,
                "mlx_cache_bytes": step.mlx_cache_bytes,
                "rss_bytes": step.rss_bytes,
                "page_cache_expert_bytes": step.page_cache_expert_bytes,
            }
        )
    return rows


def series_text(rows: list[dict], fmt: str) -> str:
    if fmt == "json":
        return json.dumps({"fields": list(FIELDS), "steps": rows}, indent=1)
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=FIELDS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def write_series(metrics: LiveMetrics, folder: Path, fmt: str) -> tuple[Path, int]:
    """Save the series as `folder/edge0-steps-<time>.<fmt>`; (the file, its rows). Edge0Error
    when there is no step yet or the file cannot be written."""
    rows = series_rows(metrics)
    if not rows:
        raise Edge0Error("no decode steps yet: export after a reply")
    path = Path(folder) / f"edge0-steps-{time.strftime('%Y%m%d-%H%M%S')}.{fmt}"
    try:
        path.write_text(series_text(rows, fmt), encoding="utf-8")
    except OSError as e:
        raise Edge0Error(f"{path}: cannot write the steps ({e.strerror or e})") from None
    return path, len(rows)
