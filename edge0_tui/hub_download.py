"""Downloading a Hub repo's files into the Hugging Face cache: planned first, checked against the
free disk space, and resumed where an interrupted download stopped.

`plan_download` asks the Hub what the repo holds at a revision (its commit, the files matching
the patterns, each file's size and etag) and looks in the cache for each file: complete, partly
downloaded, or missing. It writes nothing. `fetch_missing` refuses, before writing anything, when
the disk that holds the cache has less free space than the bytes still to come; then it fetches
each file that is not complete into `blobs/<etag>.incomplete`, beside where huggingface_hub keeps
the file, appending from the partial file's end with a Range request, and renames it to
`blobs/<etag>` once whole. huggingface_hub's `snapshot_download` then finds every blob in place
and only links the snapshot folder (no file bytes).

Why not `snapshot_download` alone: huggingface_hub writes each download into a temporary file of
a name unique to the process and removes it when the download fails or is interrupted, so an
interrupted download of a large shard starts again from zero.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine import Edge0Error, check_shard_count, format_bytes

# (what is happening, units done, units in total or None when unknown): model_source's
# ProgressCallback.
Progress = Callable[[str, float, "float | None"], None]
PARTIAL_SUFFIX = ".incomplete"
CHUNK_BYTES = 1 << 20
# The progress callback is called at most this often during a file (the app redraws on each).
REPORT_EVERY_S = 0.1
# An etag names a file in the cache: a hostile hub's cannot name a path outside it.
_ETAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


@dataclass(frozen=True)
class HubFile:
    """One file of the repo: its size on the Hub, where the cache keeps it, what is here."""

    name: str
    size: int
    blob: Path  # the file once whole (a snapshot's link points at it)
    have: int  # bytes already here: the size when whole, else the partial file's
    complete: bool
    lock: Path  # huggingface_hub's lock for this blob (an edge0 pull and its downloads share it)

    @property
    def partial(self) -> Path:
        return self.blob.with_name(self.blob.name + PARTIAL_SUFFIX)


@dataclass(frozen=True)
class DownloadPlan:
    """What a download of `repo_id` at `revision` has to fetch into `storage`."""

    repo_id: str
    revision: str | None
    commit: str
    storage: Path  # the repo's folder in the Hugging Face cache
    files: tuple[HubFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def have_bytes(self) -> int:
        return sum(f.have for f in self.files)

    @property
    def missing_bytes(self) -> int:
        return self.total_bytes - self.have_bytes


def plan_download(
    repo_id: str, patterns: list[str], revision: str | None = None, cache_dir: Path | None = None
) -> DownloadPlan:
    """The files of `repo_id` matching `patterns` and what of each the cache holds. Asks the Hub
    (its errors are huggingface_hub's, for the caller to word); writes nothing."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.file_download import repo_folder_name
    from huggingface_hub.utils import filter_repo_objects

    cache = Path(cache_dir or constants.HF_HUB_CACHE)
    folder_name = repo_folder_name(repo_id=repo_id, repo_type="model")
    storage = cache / folder_name
    info = HfApi().model_info(repo_id, revision=revision)
    if not isinstance(info.sha, str) or not info.sha:
        raise Edge0Error(f"{repo_id}: the Hugging Face Hub named no commit for it")
    names = [s.rfilename for s in info.siblings or []]
    wanted = sorted(filter_repo_objects(names, allow_patterns=patterns))
    # Each file wanted is asked for its size: a listing of more files than a checkpoint has is
    # refused before one is asked.
    check_shard_count(sum(name.endswith(".safetensors") for name in wanted), repo_id)
    locks = cache / ".locks" / folder_name
    files = tuple(_hub_file(repo_id, name, info.sha, storage, locks) for name in wanted)
    return DownloadPlan(repo_id, revision, info.sha, storage, files)


def _hub_file(repo_id: str, name: str, commit: str, storage: Path, locks: Path) -> HubFile:
    """File `name` at `commit`: a snapshot link already here is complete, without asking the
    Hub; otherwise the Hub's HEAD answer gives its size and etag (the blob's name)."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    link = storage / "snapshots" / commit / name
    if link.is_file():
        size = link.stat().st_size
        blob = link.resolve()
        return HubFile(name, size, blob, size, True, locks / f"{blob.name}.lock")
    meta = get_hf_file_metadata(hf_hub_url(repo_id, name, revision=commit))
    if meta.size is None or meta.size < 0:
        raise Edge0Error(f"{repo_id}: {name}: the Hugging Face Hub did not say its size")
    if not meta.etag or not _ETAG.fullmatch(meta.etag):
        raise Edge0Error(f"{repo_id}: {name}: the Hugging Face Hub's etag is not a file name")
    blob = storage / "blobs" / meta.etag
    lock = locks / f"{meta.etag}.lock"
    if blob.is_file():
        return HubFile(name, meta.size, blob, meta.size, True, lock)
    partial = blob.with_name(blob.name + PARTIAL_SUFFIX)
    have = partial.stat().st_size if partial.is_file() else 0
    return HubFile(name, meta.size, blob, min(have, meta.size), False, lock)


def free_bytes(folder: Path) -> int:
    """Free bytes on the disk that holds `folder` (or its nearest parent that exists)."""
    existing = folder
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    return shutil.disk_usage(existing).free


def check_space(plan: DownloadPlan) -> None:
    """Refuse a download the disk cannot hold, before any byte of it is written."""
    needed = plan.missing_bytes
    free = free_bytes(plan.storage)
    if needed > free:
        raise Edge0Error(
            f"{plan.repo_id}: {format_bytes(needed)} still to download but the disk of "
            f"{plan.storage.parent} has {format_bytes(free)} free ({format_bytes(needed - free)} "
            "short); free some space or point HF_HUB_CACHE at a larger disk"
        )


def fetch_missing(plan: DownloadPlan, on_progress: Progress) -> int:
    """Fetch every file of `plan` that is not complete (see the module); the bytes received."""
    check_space(plan)
    meter = _Meter(on_progress, f"downloading {plan.repo_id}", plan.have_bytes, plan.total_bytes)
    # The small files first: an interrupted pull has the config and tokenizer already.
    for file in sorted(plan.files, key=lambda f: f.size):
        if not file.complete:
            _fetch(plan.repo_id, plan.commit, file, meter)
    meter.report()
    return meter.received


class _Meter:
    """Bytes done over the whole download, reported to `on_progress` at most every
    REPORT_EVERY_S (and on `report`)."""

    def __init__(self, on_progress: Progress, what: str, done: int, total: int) -> None:
        self.on_progress, self.what, self.done, self.total = on_progress, what, done, total
        self.received = 0
        self.last = 0.0

    def advance(self, n: int) -> None:
        self.done += n
        self.received += n
        if time.monotonic() - self.last >= REPORT_EVERY_S:
            self.report()

    def rewind(self, n: int) -> None:
        """`n` bytes counted done were thrown away (the server ignored a range)."""
        self.done -= n

    def report(self) -> None:
        self.last = time.monotonic()
        self.on_progress(self.what, self.done, self.total)


def _fetch(repo_id: str, commit: str, file: HubFile, meter: _Meter) -> None:
    """Bring `file` whole into its blob, resuming its partial file; errors are one line."""
    from huggingface_hub.utils import WeakFileLock

    try:
        file.blob.parent.mkdir(parents=True, exist_ok=True)
        file.lock.parent.mkdir(parents=True, exist_ok=True)
        with WeakFileLock(file.lock):
            if file.blob.is_file():  # another process finished it meanwhile
                return
            _append_rest(repo_id, commit, file, meter)
            os.replace(file.partial, file.blob)
    except OSError as e:
        raise Edge0Error(
            f"{repo_id}: {file.name}: cannot write {e.filename or file.partial} ({e.strerror or e})"
        ) from None


def _append_rest(repo_id: str, commit: str, file: HubFile, meter: _Meter) -> None:
    """Write the bytes of `file` that its partial file lacks, from a Range request."""
    import httpx2
    from huggingface_hub import constants, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    start = file.partial.stat().st_size if file.partial.is_file() else 0
    if start > file.size:  # not this file's beginning: start again
        start = 0
    with open(file.partial, "r+b" if file.partial.exists() else "wb") as out:
        out.truncate(start)
        out.seek(start)
        if start == file.size:
            return
        headers = build_hf_headers()
        headers["Accept-Encoding"] = "identity"  # the file's bytes, not a compressed body
        if start:
            headers["Range"] = f"bytes={start}-"
        url = hf_hub_url(repo_id, file.name, revision=commit)
        timeout = constants.HF_HUB_DOWNLOAD_TIMEOUT
        written = start
        try:
            with get_session().stream("GET", url, headers=headers, timeout=timeout) as response:
                hf_raise_for_status(response)
                if start and response.status_code != 206:  # the whole file: overwrite
                    meter.rewind(start)
                    out.seek(0)
                    out.truncate()
                    written = 0
                for chunk in response.iter_bytes(CHUNK_BYTES):
                    out.write(chunk)
                    written += len(chunk)
                    meter.advance(len(chunk))
                    if written > file.size:
                        raise Edge0Error(
                            f"{repo_id}: {file.name}: the Hub sent more than its {file.size} bytes"
                        )
        except HfHubHTTPError as e:
            status = getattr(e.response, "status_code", None)
            why = f"the Hugging Face Hub answered HTTP {status}"
            raise Edge0Error(_stopped(repo_id, file, written, why)) from None
        except httpx2.TransportError as e:
            raise Edge0Error(_stopped(repo_id, file, written, f"{type(e).__name__}: {e}")) from None
    if written != file.size:
        raise Edge0Error(_stopped(repo_id, file, written, "the Hub sent no more"))


def _stopped(repo_id: str, file: HubFile, written: int, why: str) -> str:
    why = " ".join(why.split())[:200]
    return (
        f"{repo_id}: {file.name}: the download stopped at {format_bytes(written)} of "
        f"{format_bytes(file.size)} ({why}); run it again to resume from there"
    )
