"""`edge0 list`: the models used before and the MoE checkpoints in the Hugging Face cache, with
family, size on disk, native K and the K profiles found, like `ollama list`.

Read from config files and shard headers only: no weights, no network. "Used before" are the
models the app keeps settings for (models.json, by the model's identity: demo, a repo id, a
folder). A Hub snapshot is listed by its repo id, once, whichever way it was found.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from edge0_tui.commands import options
from engine import Edge0Error, EngineConfig, format_bytes

NAME = "list"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        NAME, help="models used before and MoE checkpoints in the Hugging Face cache"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per model, a list")


def used_models() -> list[str]:
    """The models the app keeps settings for, as keyed (most recently saved last)."""
    from platformdirs import user_config_path

    from edge0_tui.preferences import PreferenceStore

    store = PreferenceStore(options.config_dir() or user_config_path("edge0"))
    return store.models()


def hub_snapshots() -> dict[str, Path]:
    """repo id -> the folder of its cached snapshot (refs/main's, else the newest), for every
    model repo in the Hugging Face cache."""
    from huggingface_hub import constants

    found = {}
    for repo in sorted(Path(constants.HF_HUB_CACHE).glob("models--*--*")):
        owner_name = repo.name.removeprefix("models--").split("--")
        if len(owner_name) != 2:
            continue
        main = repo / "refs" / "main"
        snapshot = repo / "snapshots" / main.read_text().strip() if main.is_file() else None
        if snapshot is None or not snapshot.is_dir():
            candidates = sorted((repo / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime)
            snapshot = candidates[-1] if candidates else None
        if snapshot is not None:
            found["/".join(owner_name)] = snapshot
    return found


def run(args: argparse.Namespace) -> int:
    from edge0_tui.model_source import BUNDLED_DEMO, DEMO, is_hub_id
    from engine import summarize_checkpoint

    config = EngineConfig(data_dir=options.data_dir())
    snapshots = hub_snapshots()
    rows: list[dict] = []
    listed: set[str] = set()

    def add(name: str, path: Path | None, where: str, quiet: bool) -> None:
        if name in listed:
            return
        listed.add(name)
        if path is None:
            rows.append({"name": name, "where": where, "error": "not in the Hugging Face cache"})
            return
        try:
            summary = summarize_checkpoint(path, config)
        except Edge0Error as e:
            if not quiet:  # a used model that no longer opens is said; other cache repos skipped
                rows.append({"name": name, "where": where, "error": str(e)})
            return
        rows.append({"name": name, "where": where, **summary.as_dict()})

    for key in used_models():
        if key == DEMO:
            add(DEMO, BUNDLED_DEMO, "used", quiet=False)
        elif is_hub_id(key) and not Path(key).exists():
            add(key, snapshots.get(key), "used", quiet=False)
        else:
            add(key, Path(key), "used", quiet=False)
    for repo_id, snapshot in snapshots.items():
        add(repo_id, snapshot, "hub cache", quiet=True)  # not an MoE edge0 runs: not listed

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
        recovered = set(row["recovered"])
        profiles = " ".join(
            f"K={k}" + ("" if int(k) in recovered else "*") for k in row["profiles"]
        )
        lines.append(
            (
                row["name"],
                row["family"],
                format_bytes(row["disk_bytes"]),
                str(row["native_k"]),
                profiles or "-",
                row["where"],
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head) - 1)]
    out = [
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths)) + "  " + line[-1]
        for line in lines
    ]
    if any(
        row.get("profiles") and set(row["profiles"]) - {str(k) for k in row["recovered"]}
        for row in rows
        if "error" not in row
    ):
        out.append("* heads or LoRA only: quality not recovered at that K")
    return "\n".join(line.rstrip() for line in out)
