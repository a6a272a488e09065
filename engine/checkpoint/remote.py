"""A Hub repo's checkpoint layout without its weights: config.json, the safetensors index and each
shard's header, read by HTTP range requests.

`fetch_header_copy(repo_id, folder)` writes a header-only copy into `folder`: the small JSON files
as they are, and each shard as its 8-byte header length and its header, followed by a hole up to
the shard's size on the Hub (a sparse file: no disk space, no bytes transferred). Everything that
reads a local checkpoint's layout (`CheckpointIndex`, mlx-lm's lazy loader) reads this copy the
same way, and never reads the holes.

Requests go through huggingface_hub's HTTP client (its endpoint, `HF_ENDPOINT`, its token and
proxies, redirects followed up to its bound). Whatever the Hub answers that is not what a
checkpoint's files are (an error status, a redirect loop, a body cut short, a header length no
safetensors file has) is an Edge0Error of one line naming the repo and the file.
"""

from __future__ import annotations

import contextlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import Edge0Error
from .index import (
    HEADER_BYTES_FIXED,
    HEADER_BYTES_PER_TENSOR,
    INDEX_FILE,
    MAX_HEADER_BYTES,
    check_shard_count,
    max_checkpoint_tensors,
)

CONFIG_FILE = "config.json"
SINGLE_SHARD = "model.safetensors"
# JSON files a plan reads beside the config: the index, and ModelOpt's quantization (which
# changes the model's structure). Each is read whole, up to this bound.
MAX_JSON_BYTES = 32 * 1024 * 1024
OPTIONAL_FILES = ("hf_quant_config.json",)


class _Missing(Exception):
    """The Hub has no such file in the repo (404)."""


@dataclass
class HubRepo:
    """One repo on the Hub, read file by file; `bytes_read` counts every body byte received."""

    repo_id: str
    revision: str | None = None
    bytes_read: int = field(default=0, init=False)

    def fetch(self, name: str, start: int = 0, length: int | None = None) -> tuple[bytes, int]:
        """`length` bytes of file `name` from `start` (the whole file, up to `MAX_JSON_BYTES`,
        when None), and the file's size on the Hub."""
        try:
            return self._fetch(name, start, length)
        except (_Missing, Edge0Error):
            raise
        except Exception as e:  # the HTTP client's errors: connection, timeout, redirects
            what = f"{type(e).__name__}: {e}".strip().rstrip(":")
            raise Edge0Error(
                f"{self.repo_id}: {name}: cannot read it from the Hub ({what})"
            ) from None

    def _fetch(self, name: str, start: int, length: int | None) -> tuple[bytes, int]:
        from huggingface_hub import constants, hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session

        url = hf_hub_url(self.repo_id, name, revision=self.revision)
        headers = build_hf_headers()
        headers["Accept-Encoding"] = "identity"  # sizes are the file's, not a compressed body's
        wanted = length if length is not None else MAX_JSON_BYTES + 1
        if length is not None:
            headers["Range"] = f"bytes={start}-{start + length - 1}"
        timeout = constants.HF_HUB_DOWNLOAD_TIMEOUT
        with get_session().stream("GET", url, headers=headers, timeout=timeout) as response:
            no_repo = response.headers.get("X-Error-Code") == "RepoNotFound"
            if response.status_code in (401, 403) or no_repo:
                raise Edge0Error(
                    f"{self.repo_id}: no such model on the Hugging Face Hub (or it is private: "
                    "`hf auth login`)"
                )
            if response.status_code == 404:
                raise _Missing(name)
            if response.status_code >= 400:
                raise Edge0Error(
                    f"{self.repo_id}: {name}: the Hub answered HTTP {response.status_code}"
                )
            if length is not None and response.status_code != 206 and start > 0:
                raise Edge0Error(
                    f"{self.repo_id}: {name}: the Hub ignored a byte-range request "
                    f"(HTTP {response.status_code}); reading a header needs ranges"
                )
            size = _file_size(response.headers)
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) >= wanted:  # a server that ignores the range sends no more than this
                    break
        self.bytes_read += len(body)
        if length is None and len(body) > MAX_JSON_BYTES:
            raise Edge0Error(
                f"{self.repo_id}: {name}: larger than {MAX_JSON_BYTES} bytes, not a config file"
            )
        body = body[:wanted]
        if length is not None and len(body) < length:
            raise Edge0Error(
                f"{self.repo_id}: {name}: the Hub sent {len(body)} of the {length} bytes asked "
                f"for at offset {start} (the file is truncated)"
            )
        return bytes(body), size if size is not None else len(body)

    def copy_json(self, name: str, folder: Path) -> object:
        """Copy JSON file `name` into `folder` as the Hub has it; its value."""
        data, _ = self.fetch(name)
        try:
            value = json.loads(data.decode("utf-8"))
        except ValueError as e:
            raise Edge0Error(f"{self.repo_id}: {name}: not valid JSON ({e})") from None
        (folder / name).write_bytes(data)
        return value


def _file_size(headers: object) -> int | None:
    """The whole file's size: the total of a Content-Range, else the Content-Length."""
    content_range = headers.get("Content-Range", "")
    total = content_range.rpartition("/")[2]
    if total.isdigit():
        return int(total)
    length = headers.get("Content-Length", "")
    return int(length) if length.isdigit() else None


def fetch_header_copy(repo: HubRepo, folder: Path) -> Path:
    """Write the header-only copy of `repo`'s checkpoint into `folder` (see the module's doc)."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        config = repo.copy_json(CONFIG_FILE, folder)
    except _Missing:
        raise Edge0Error(f"{repo.repo_id}: no {CONFIG_FILE} (not a model checkpoint)") from None
    for name in OPTIONAL_FILES:
        with contextlib.suppress(_Missing):
            repo.copy_json(name, folder)
    try:
        index = repo.copy_json(INDEX_FILE, folder)
    except _Missing:
        shards = [SINGLE_SHARD]
    else:
        shards = _listed_shards(repo.repo_id, index)
    max_header = _max_header_bytes(config)
    for shard in shards:
        try:
            _fetch_shard_header(repo, shard, folder / shard, max_header)
        except _Missing:
            raise Edge0Error(f"{repo.repo_id}: {shard}: not on the Hub") from None
    return folder


def _listed_shards(repo_id: str, index: object) -> list[str]:
    """The shard names an index lists, each a plain file name."""
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise Edge0Error(f"{repo_id}: {INDEX_FILE}: corrupt index (no weight_map object)")
    names = set(weight_map.values())
    for name in names:
        if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
            raise Edge0Error(
                f"{repo_id}: {INDEX_FILE}: corrupt index (weight_map names {name!r:.80}, not a "
                "shard file of the repo)"
            )
    check_shard_count(len(names), f"{repo_id}: {INDEX_FILE}")
    return sorted(names)


def _max_header_bytes(config: object) -> int:
    """The largest header a shard of this model may have (`read_safetensors`'s bound)."""
    text = config.get("text_config") if isinstance(config, dict) else None
    text = text if isinstance(text, dict) else config if isinstance(config, dict) else {}
    layers = text.get("num_hidden_layers")
    tensors = max_checkpoint_tensors(layers if type(layers) is int else None)
    return min(MAX_HEADER_BYTES - 1, HEADER_BYTES_FIXED + HEADER_BYTES_PER_TENSOR * tensors)


def _fetch_shard_header(repo: HubRepo, name: str, path: Path, max_header: int) -> None:
    head, size = repo.fetch(name, 0, 8)
    (header_len,) = struct.unpack("<Q", head)
    if header_len > max_header or header_len > size - 8:
        raise Edge0Error(
            f"{repo.repo_id}: {name}: corrupt safetensors header (declares {header_len} header "
            f"bytes in a {size}-byte file, at most {max_header} for this model); refused before "
            "reading it"
        )
    header, _ = repo.fetch(name, 8, header_len)
    with open(path, "wb") as f:
        f.write(head + header)
        f.truncate(size)  # the data as a hole: never read, and no disk space taken
