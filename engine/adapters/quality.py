"""Each K profile's measured quality, kept by `edge0 eval --profiles` for the app and `info`.

The table is `quality.json` in the base's automatic adapter folder (by its fingerprint: a model
folder may be read-only). Read back as {K: {"heads only": ratio, "heads + LoRA": ratio}}, each
ratio the profile's perplexity over the 4-bit model's at its native K. The file is data from
disk: read as every kept JSON file is (`json_files`: a size bound, nesting too deep an error),
every value checked; a table that does not check out is ignored with one warning naming the
file (the engine's `warnings`), never an error: it only adds a label.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint.index import brief
from ..checkpoint.json_files import read_json_file, write_json_file
from ..errors import Edge0Error
from .locations import auto_adapter_dir

QUALITY_FILE = "quality.json"
# A kept table is a few KiB; past this it is not one of ours.
MAX_QUALITY_BYTES = 1 << 20
VARIANTS = ("heads only", "heads + LoRA")


@dataclass(frozen=True)
class KeptQuality:
    """A base's kept table as {K: {"heads only": ratio, "heads + LoRA": ratio}}, and why the file
    was ignored where it was (one line naming it); an empty table where there is no file."""

    table: dict[int, dict[str, float]] = field(default_factory=dict)
    warning: str | None = None


def keep_quality(table: dict, fingerprint: str, data_dir: Path | None = None) -> Path:
    """Write the table whole or not at all, as `kept_quality` reads it back; its path."""
    path = auto_adapter_dir(fingerprint, data_dir) / QUALITY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_file(path, table, MAX_QUALITY_BYTES, "the quality table")
    return path


def kept_quality(fingerprint: str, data_dir: Path | None = None) -> KeptQuality:
    """The kept table of this base. A file that is not a table of ours (too big, not JSON,
    nested too deeply, a number out of range) is ignored with a warning, never an error: it only
    adds a label."""
    path = auto_adapter_dir(fingerprint, data_dir) / QUALITY_FILE
    if not os.path.lexists(path):
        return KeptQuality()
    try:
        return KeptQuality(_ratios(read_json_file(path, max_bytes=MAX_QUALITY_BYTES)))
    except Edge0Error as e:
        return KeptQuality(warning=f"{e}; the measured quality is not shown")
    except ValueError as e:
        return KeptQuality(warning=f"{path}: {e}; the measured quality is not shown")


def _ratios(table: object) -> dict[int, dict[str, float]]:
    """The heads' rows of an `eval --profiles` table (the first row is the native model's); a
    ValueError names the first value that is not what `keep_quality` writes."""
    rows = table.get("rows") if isinstance(table, dict) else None
    if not isinstance(rows, list) or not rows:
        raise ValueError('no "rows" list')
    quality: dict[int, dict[str, float]] = {}
    for i, row in enumerate(rows[1:], start=1):
        if not isinstance(row, dict):
            raise ValueError(f"rows[{i}] is not an object")
        if row.get("variant") not in VARIANTS:
            continue  # a row of another kind: not a label of the K selector
        k, ratio = row.get("k"), _positive_ratio(row.get("vs_native"))
        if not (isinstance(k, int) and not isinstance(k, bool) and k > 0):
            raise ValueError(f"rows[{i}].k: {brief(k)} is not a routing width")
        if ratio is None:
            raise ValueError(f"rows[{i}].vs_native: {brief(row.get('vs_native'))} is not a ratio")
        quality.setdefault(k, {})[row["variant"]] = ratio
    return quality


def _positive_ratio(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        ratio = float(value)
    except OverflowError:  # an integer beyond a float's range
        return None
    return ratio if math.isfinite(ratio) and ratio > 0 else None
