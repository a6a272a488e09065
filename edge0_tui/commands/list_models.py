"""`edge0 list`: the models used before and the MoE checkpoints in the Hugging Face cache, with
family, size on disk, native K and the K profiles found, like `ollama list`.

The models are found by `edge0_tui.model_list`, which the app's model picker uses too.
"""

from __future__ import annotations

import argparse
import json

from edge0_tui.commands import options
from edge0_tui.model_list import (
    NOT_RECOVERED_NOTE,
    any_not_recovered,
    known_models,
    profiles_text,
)
from engine import EngineConfig, format_bytes

NAME = "list"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        NAME, help="models used before and MoE checkpoints in the Hugging Face cache"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per model, a list")


def run(args: argparse.Namespace) -> int:
    from platformdirs import user_config_path

    from edge0_tui.preferences import PreferenceStore

    store = PreferenceStore(options.config_dir() or user_config_path("edge0"))
    rows, _ = known_models(store, EngineConfig(data_dir=options.data_dir()))
    if args.json:
        print(json.dumps(rows))
        return 0
    if not rows:
        print("no models yet: `edge0 chat demo`, or `edge0 chat OWNER/NAME` to download one")
        return 0
    print(table(rows))
    return 0


def table(rows: list[dict]) -> str:
    """Aligned columns: NAME, FAMILY, SIZE, K (native), PROFILES, WHERE."""
    head = ("NAME", "FAMILY", "SIZE", "K", "PROFILES", "WHERE")
    lines = [head]
    for row in rows:
        if "error" in row:
            lines.append((row["name"], "-", "-", "-", "-", f"{row['where']}: {row['error']}"))
            continue
        lines.append(
            (
                row["name"],
                row["family"],
                format_bytes(row["disk_bytes"]),
                str(row["native_k"]),
                profiles_text(row),
                row["where"],
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head) - 1)]
    out = [
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths)) + "  " + line[-1]
        for line in lines
    ]
    if any_not_recovered(rows):
        out.append(NOT_RECOVERED_NOTE)
    return "\n".join(line.rstrip() for line in out)
