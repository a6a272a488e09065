"""Each K profile's measured quality, kept by `edge0 eval --profiles` for the app and `info`.

The table is `quality.json` in the base's automatic adapter folder (by its fingerprint: a model
folder may be read-only). Read back as {K: {"heads only": ratio, "heads + LoRA": ratio}}, each
ratio the profile's perplexity over the 4-bit model's at its native K. The file is data from
disk: read with a size bound, every number checked, and anything else ignored (it only adds a
label).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from .locations import auto_adapter_dir

QUALITY_FILE = "quality.json"
# A kept table is a few KiB; past this it is not one of ours.
MAX_QUALITY_BYTES = 1 << 20


def keep_quality(table: dict, fingerprint: str, data_dir: Path | None = None) -> Path:
    """Write the table whole or not at all (temp file, then rename); its path."""
    path = auto_adapter_dir(fingerprint, data_dir) / QUALITY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(table, indent=1))
    os.replace(temporary, path)
    return path


def kept_quality(fingerprint: str, data_dir: Path | None = None) -> dict[int, dict[str, float]]:
    """The kept table of this base as {K: {"heads only": ratio, "heads + LoRA": ratio}}; empty
    when there is none, or when the file is not a table of ours (never an error: it only adds
    a label)."""
    path = auto_adapter_dir(fingerprint, data_dir) / QUALITY_FILE
    try:
        if not path.is_file() or path.stat().st_size > MAX_QUALITY_BYTES:
            return {}
        table = json.loads(path.read_text(encoding="utf-8"))
        quality: dict[int, dict[str, float]] = {}
        for row in table["rows"][1:]:
            k, variant, ratio = int(row["k"]), str(row["variant"]), float(row["vs_native"])
            if variant in ("heads only", "heads + LoRA") and math.isfinite(ratio) and ratio > 0:
                quality.setdefault(k, {})[variant] = ratio
        return quality
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return {}
