"""One log line per HTTP request, whatever answered it: its status, time, and what happened.

An ASGI middleware, outermost, so refusals made before any route (the Host and Origin checks,
404, 405) are logged as well as the routes' own answers. A reply that ends in an error status
has its message in the line (read from the error body, in OpenAI's or Anthropic's shape, both
`{"error": {"message": ...}}`); a route adds its own account of a generation (tokens, speed,
profile) through `note`. A client that went away before its answer is logged as 499 (nginx's
"client closed request"; never sent). The same pass counts client errors (4xx but 429) for
/metrics, apart from the server's own failures, and gives every reply an `x-request-id` header,
the one in its log line: the client's own when it sent a sane one, else a new one.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable

# The scope key under which a request's log entry lives (a dict the routes add to).
ENTRY = "edge0.log"
CLIENT_CLOSED = 499
# An error body is JSON of a few hundred bytes; only that much is kept to read its message.
ERROR_BODY_BYTES = 4096
REQUEST_ID = "x-request-id"
# A client's request id taken as it is: short, and of characters ids are made of (UUIDs, ULIDs,
# base64, `req_...`), nothing a log line or a header could be confused by.
SANE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:+/=-]{1,128}")


def request_id(scope: dict) -> str:
    """The client's x-request-id when it is sane, else a new one."""
    for name, value in scope.get("headers", ()):
        if name == REQUEST_ID.encode():
            sent = value.decode("latin-1")
            if SANE_REQUEST_ID.fullmatch(sent):
                return sent
            break
    return uuid.uuid4().hex


def note(scope: dict, detail: str, status: int | None = None) -> None:
    """Say what the request did, for its log line (`status`: what to log instead of the status
    sent, e.g. CLIENT_CLOSED for a client that left mid-stream)."""
    entry = scope.get(ENTRY)
    if entry is not None:
        entry["detail"] = detail
        if status is not None:
            entry["status"] = status


class AccessLog:
    """ASGI middleware: logs each HTTP request once it has been answered."""

    def __init__(self, app, log: Callable[[str], None], stats) -> None:
        self.app = app
        self.log = log
        self.stats = stats  # metrics.ServerStats: client_errors counted here

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        entry: dict = {}
        scope[ENTRY] = entry
        started = time.perf_counter()
        sent: dict = {"status": None, "body": b""}
        rid = request_id(scope)

        async def send_logged(message: dict) -> None:
            if message["type"] == "http.response.start":
                sent["status"] = message["status"]
                headers = [*message.get("headers", ()), (REQUEST_ID.encode(), rid.encode())]
                message = {**message, "headers": headers}
            elif message["type"] == "http.response.body" and (sent["status"] or 0) >= 400:
                if len(sent["body"]) < ERROR_BODY_BYTES:
                    sent["body"] += message.get("body", b"")[:ERROR_BODY_BYTES]
            await send(message)

        try:
            await self.app(scope, receive, send_logged)
        finally:
            status = entry.get("status") or sent["status"] or CLIENT_CLOSED
            if 400 <= status < 500 and status not in (429, CLIENT_CLOSED):
                self.stats.client_errors += 1
            detail = entry.get("detail") or error_message(sent["body"])
            ms = (time.perf_counter() - started) * 1e3
            path = scope.get("path", "")
            line = f"edge0: {scope.get('method', '')} {path} {status} {ms:.0f} ms"
            line = f"{line}: {detail}" if detail else line
            self.log(f"{line} [{REQUEST_ID} {rid}]")


def error_message(body: bytes) -> str | None:
    """The message of an error body (OpenAI's or Anthropic's shape), or None."""
    if not body:
        return None
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"][:300]
    return None
