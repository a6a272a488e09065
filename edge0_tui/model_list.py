"""The models edge0 knows of: those used before and the MoE checkpoints in the Hugging Face cache,
each with family, size on disk, native K and the K profiles found. `edge0 list` prints them; the
app's model picker (Ctrl+L) lists them to open one.

Read from config files and shard headers only: no weights, no network. "Used before" are the
models the app keeps settings for (models.json, by the model's identity: demo, a repo id, a
folder). A Hub snapshot is listed by its repo id, once, whichever way it was found. Scanning the
Hugging Face cache reads a few files per repo: the app does it off its UI thread, and at most
`max_hub_repos` of them.
"""

from __future__ import annotations

from pathlib import Path

from engine import Edge0Error, EngineConfig

from .model_source import BUNDLED_DEMO, DEMO, is_hub_id
from .preferences import PreferenceStore

# Where a model was found: a model the app keeps settings for, or one only in the HF cache.
USED, HUB_CACHE = "used", "hub cache"


def hub_snapshots(max_repos: int | None = None) -> tuple[dict[str, Path], int]:
    """repo id -> the folder of its cached snapshot (refs/main's, else the newest), for the model
    repos in the Hugging Face cache (the first `max_repos` by name; None: all), and how many repos
    were left unread past that bound."""
    from huggingface_hub import constants

    repos = sorted(Path(constants.HF_HUB_CACHE).glob("models--*--*"))
    left = 0 if max_repos is None else max(0, len(repos) - max_repos)
    found = {}
    for repo in repos[: None if max_repos is None else max_repos]:
        owner_name = repo.name.removeprefix("models--").split("--")
        if len(owner_name) != 2:
            continue
        main = repo / "refs" / "main"
        try:
            snapshot = repo / "snapshots" / main.read_text().strip() if main.is_file() else None
            if snapshot is None or not snapshot.is_dir():
                candidates = sorted((repo / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime)
                snapshot = candidates[-1] if candidates else None
        except (OSError, UnicodeDecodeError):
            continue  # a repo folder half written or unreadable: not one to list
        if snapshot is not None:
            found["/".join(owner_name)] = snapshot
    return found, left


def known_models(
    store: PreferenceStore | None, config: EngineConfig, max_hub_repos: int | None = None
) -> tuple[list[dict], int]:
    """One row a model: `name` (what opens it: demo, a repo id, a folder), `where` (USED or
    HUB_CACHE), and the checkpoint's summary (`CheckpointSummary.as_dict`), or `error` for a used
    model that no longer opens; plus how many HF cache repos were left unread (`hub_snapshots`).
    Cache repos that are not an MoE edge0 runs are left out. `config` gives the adapter search
    (the data folder)."""
    from engine import summarize_checkpoint  # the checkpoint readers, imported when used

    snapshots, left = hub_snapshots(max_hub_repos)
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

    for key in store.models() if store is not None else ():
        if key == DEMO:
            add(DEMO, BUNDLED_DEMO, USED, quiet=False)
        elif is_hub_id(key) and not Path(key).exists():
            add(key, snapshots.get(key), USED, quiet=False)
        else:
            add(key, Path(key), USED, quiet=False)
    for repo_id, snapshot in snapshots.items():
        add(repo_id, snapshot, HUB_CACHE, quiet=True)  # not an MoE edge0 runs: not listed
    return rows, left


def profiles_text(row: dict) -> str:
    """The K profiles found, `K=2 K=4*`: a star where quality is not recovered (heads or LoRA
    only); "-" when there are none."""
    recovered = set(row["recovered"])
    text = " ".join(f"K={k}" + ("" if int(k) in recovered else "*") for k in row["profiles"])
    return text or "-"


NOT_RECOVERED_NOTE = "* heads or LoRA only: quality not recovered at that K"


def any_not_recovered(rows: list[dict]) -> bool:
    """True when a row shows a starred profile (`profiles_text`): NOT_RECOVERED_NOTE applies."""
    return any(
        row.get("profiles") and set(row["profiles"]) - {str(k) for k in row["recovered"]}
        for row in rows
        if "error" not in row
    )
