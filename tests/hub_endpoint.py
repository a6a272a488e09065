"""A small Hugging Face-compatible HTTP endpoint serving local folders as model repos.

It answers what huggingface_hub's `snapshot_download`, `hf_hub_download`, `HfApi.model_info` and
`HfApi.list_repo_tree` ask for, on 127.0.0.1 (stdlib `http.server` in a thread):

- `GET /api/models/{repo}` and `/api/models/{repo}/revision/{rev}`: the repo's id, commit and files;
- `GET /api/models/{repo}/tree/{rev}`: the file listing;
- `HEAD`/`GET /{repo}/resolve/{rev}/{file}`: a file, with `Range` (one range), `ETag`,
  `X-Repo-Commit` and `Content-Length`.

Every byte of a file body it sends is counted per (repo, file), so a test can say how much a
command transferred. `fault(repo, kind)` makes one repo misbehave, for the hostile-hub tests:
`"500"` (every request fails), `"json_shape"` (the API answers a JSON list where an object is
expected, the tree an object where a list is), `"redirect_loop"` (every file redirects to itself),
`"short_body"` (every file's body stops half way, the connection closed), `"get_500"` (a
file's HEAD answers, its GET is a 500), `"no_range"` (a Range header is ignored: the whole file). `cut(repo, file, at)`
drops the connection once, the next time that file's body reaches byte `at` (an interrupted
download, to be resumed). A repo answers for the revisions `main`, its commit and those `serve`
names; any other is RevisionNotFound.

Point huggingface_hub at it with `pointed_at(endpoint, hf_home)`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import re
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"  # every repo's one commit
_API = re.compile(
    r"/api/models/(?P<repo>[^/]+/[^/]+)(?:/(?P<what>revision|tree)/(?P<rev>[^/]+))?/?"
)
_RESOLVE = re.compile(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)")
CHUNK_BYTES = 1 << 20
_RANGE = re.compile(r"bytes=(\d+)-(\d*)")


class HubEndpoint:
    """The endpoint: `serve(repo_id, folder)`, then point huggingface_hub at `url`."""

    def __init__(self) -> None:
        self.repos: dict[str, Path] = {}
        self.faults: dict[str, str] = {}
        self.revisions: dict[str, set[str]] = {}
        self.cuts: dict[tuple[str, str], int] = {}
        self.bytes_sent: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._sending = 0  # file bodies being sent now
        handler = type("Handler", (_Handler,), {"hub": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> HubEndpoint:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def serve(self, repo_id: str, folder: Path, revisions: tuple[str, ...] = ()) -> None:
        self.repos[repo_id] = Path(folder)
        self.revisions[repo_id] = {"main", COMMIT, *revisions}

    def cut(self, repo_id: str, file: str, at: int) -> None:
        """The next body of `file` stops at byte `at` of the file, the connection closed."""
        self.cuts[(repo_id, file)] = at

    def take_cut(self, repo_id: str, file: str) -> int | None:
        with self._lock:
            return self.cuts.pop((repo_id, file), None)

    def fault(self, repo_id: str, kind: str) -> None:
        self.faults[repo_id] = kind

    def bytes_served(self, repo_id: str) -> int:
        """Bytes of file bodies sent for `repo_id` so far."""
        with self._lock:
            return sum(n for (repo, _), n in self.bytes_sent.items() if repo == repo_id)

    def count(self, repo_id: str, file: str, n: int) -> None:
        with self._lock:
            self.bytes_sent[(repo_id, file)] += n

    def sending(self, change: int) -> None:
        with self._idle:
            self._sending += change
            self._idle.notify_all()

    def wait_until_idle(self, timeout: float = 30.0) -> None:
        """Until no file body is being sent: a client that stopped reading leaves its handler
        writing (and counting) into the socket until the connection is seen closed."""
        with self._idle:
            assert self._idle.wait_for(lambda: self._sending == 0, timeout), "a body still sent"


def files_of(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def etag_of(path: Path) -> str:
    stat = path.stat()
    return hashlib.sha1(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    hub: HubEndpoint
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # quiet test output
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        if match := _API.fullmatch(path):
            self._api(match["repo"], match["what"], match["rev"] or "main")
        elif match := _RESOLVE.fullmatch(path):
            self._resolve(match["repo"], match["rev"], match["file"], body)
        else:
            self._send(404, b'{"error": "not found"}', {"X-Error-Code": "EntryNotFound"})

    def _api(self, repo_id: str, what: str | None, revision: str) -> None:
        folder = self.hub.repos.get(repo_id)
        if folder is None:
            return self._send(404, b'{"error": "Repository not found"}', _NOT_FOUND)
        if revision not in self.hub.revisions[repo_id]:
            return self._send(404, b'{"error": "Invalid rev id"}', _NO_REVISION)
        fault = self.hub.faults.get(repo_id)
        if fault == "500":
            return self._send(500, b'{"error": "Internal Error"}')
        files = files_of(folder)
        if what == "tree":
            listing: object = [
                {
                    "type": "file",
                    "oid": etag_of(p),
                    "size": p.stat().st_size,
                    "path": p.relative_to(folder).as_posix(),
                }
                for p in files
            ]
            if fault == "json_shape":
                listing = {"files": listing}
        else:
            siblings = [{"rfilename": p.relative_to(folder).as_posix()} for p in files]
            if fault == "many_files":  # a listing far longer than any checkpoint's
                siblings += [
                    {"rfilename": f"model-{i:06d}-of-100000.safetensors"} for i in range(100_000)
                ]
            listing = {"id": repo_id, "modelId": repo_id, "sha": COMMIT, "siblings": siblings}
            if fault == "json_shape":
                listing = [listing]
        self._send(200, json.dumps(listing).encode(), {"Content-Type": "application/json"})

    def _resolve(self, repo_id: str, revision: str, name: str, body: bool) -> None:
        folder = self.hub.repos.get(repo_id)
        if folder is None:
            return self._send(404, b"", _NOT_FOUND, body)
        if revision not in self.hub.revisions[repo_id]:
            return self._send(404, b"", _NO_REVISION, body)
        fault = self.hub.faults.get(repo_id)
        if fault == "500":
            return self._send(500, b"Internal Error", {}, body)
        if fault == "redirect_loop":
            return self._send(302, b"", {"Location": self.path}, body)
        if fault == "get_500" and body:  # HEAD answers: the download fails
            return self._send(500, b"Internal Error", {}, body)
        path = folder / name
        if ".." in Path(name).parts or not path.is_file():
            return self._send(404, b"", {"X-Error-Code": "EntryNotFound"}, body)
        size = path.stat().st_size
        start, end, status = 0, size - 1, 200
        headers = {"ETag": f'"{etag_of(path)}"', "X-Repo-Commit": COMMIT, "Accept-Ranges": "bytes"}
        wanted = self.headers.get("Range") if fault != "no_range" else None
        if wanted and (match := _RANGE.fullmatch(wanted)):
            start = int(match[1])
            end = min(int(match[2]) if match[2] else size - 1, size - 1)
            if start >= size:
                headers["Content-Range"] = f"bytes */{size}"
                return self._send(416, b"", headers, body)
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        headers["Content-Length"] = str(end - start + 1)
        if fault == "size_differs" and not body:  # HEAD says one size, the file has another
            headers["Content-Length"] = str(end - start + 1 + 1000)
        self._send(status, b"", headers, body, length_set=True)
        if body:
            self._send_file(repo_id, name, path, start, end - start + 1)

    def _send_file(self, repo_id: str, name: str, path: Path, start: int, length: int) -> None:
        """`length` bytes of the file from `start`, a chunk at a time (a client that stops
        reading, as one reading a header does, ends it), each chunk counted as it is sent."""
        if self.hub.faults.get(repo_id) == "short_body":  # the connection drops half way
            length //= 2
            self.close_connection = True
        if (cut := self.hub.take_cut(repo_id, name)) is not None:
            length = max(0, min(length, cut - start))
            self.close_connection = True
        self.hub.sending(+1)
        try:
            with open(path, "rb") as f:
                f.seek(start)
                while length > 0:
                    chunk = f.read(min(length, CHUNK_BYTES))
                    try:
                        self.wfile.write(chunk)
                    except (BrokenPipeError, ConnectionResetError):
                        return
                    self.hub.count(repo_id, name, len(chunk))
                    length -= len(chunk)
        finally:
            self.hub.sending(-1)

    def _send(
        self,
        status: int,
        data: bytes,
        headers: dict[str, str] | None = None,
        body: bool = True,
        length_set: bool = False,
    ) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if not length_set:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body and data:
            self.wfile.write(data)


_NOT_FOUND = {"X-Error-Code": "RepoNotFound"}
_NO_REVISION = {"X-Error-Code": "RevisionNotFound"}


@contextlib.contextmanager
def pointed_at(endpoint: HubEndpoint, hf_home: Path) -> Iterator[None]:
    """huggingface_hub pointed at `endpoint`, its cache in `hf_home`, for this process and the
    processes it starts.

    huggingface_hub reads HF_ENDPOINT and HF_HOME once, when `huggingface_hub.constants` is
    imported (which MLX's and transformers' imports have done before any test runs), and its
    functions read the constants module's attributes at call time. So the variables are set for
    child processes and the constants module is reloaded to read them here; on the way out it is
    reloaded again with the variables as they were."""
    import huggingface_hub.constants as constants

    names = ("HF_ENDPOINT", "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_HUB_DISABLE_XET")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(
        HF_ENDPOINT=endpoint.url,
        HF_HOME=str(hf_home),
        HF_HUB_CACHE=str(hf_home / "hub"),
        HF_HUB_OFFLINE="0",
        HF_HUB_DISABLE_XET="1",
    )
    importlib.reload(constants)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        importlib.reload(constants)
