"""What keeps one client from taking the server: time limits, a connection limit, Host and Origin
checks, and a log that cannot be flooded.

- `GuardedH11Protocol` (uvicorn's h11 protocol, per connection): a request's headers must arrive
  within `client_timeout_s` of the connection opening or of the previous response (a client that
  sends nothing, or its headers a byte at a time, is closed). The body's own time limit is in the
  app's body reader (app.read_json), which answers 408. An idle kept-alive connection closes
  after uvicorn's `timeout_keep_alive`.
- `GuardedListener` (the listening socket): a connection past `max_connections` gets a 503 and
  is closed inside `accept()`, before asyncio makes it a transport, so that idle sockets cannot
  use up the file descriptors.
- `connection_cap`: `--max-connections`, lowered to what the open-file limit leaves.
- `RequestGuard` (ASGI middleware): the Host header must name this server (DNS rebinding) and a
  browser's Origin must be allowed (`--cors`); see `allowed_hosts` for which hosts.
- `RepeatFilter`: a line logged again and again (uvicorn's "Invalid HTTP request", asyncio's
  "accept() out of system resource" with its traceback) is written at most once per window,
  then once more with the count of those left out.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import resource
import socket
import threading
import time
from collections.abc import Callable, Iterable

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, PlainTextResponse, Response
from uvicorn.protocols.http.h11_impl import H11Protocol

from .openai_shapes import ApiError

# Default --client-timeout: the time a client has for a request's headers, and again for its body.
CLIENT_TIMEOUT_S = 30.0
# An idle kept-alive connection is closed after this (uvicorn's timeout_keep_alive).
KEEP_ALIVE_S = 5
# Default --max-connections. One engine thread serves requests in turn: far fewer are useful.
MAX_CONNECTIONS = 256
# File descriptors kept for everything but connections: the model's shards, MLX, the log, the
# listening socket, the event loop's own.
FD_MARGIN = 64
# A repeated log line is written at most once per this many seconds.
REPEAT_WINDOW_S = 10.0

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


# -- connections -----------------------------------------------------------------------------------


def open_fds() -> int:
    """File descriptors this process holds now (0 where the system does not say)."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(folder))
        except OSError:
            continue
    return 0


def fd_limit() -> int | None:
    """The open-file limit this process runs under (None: none)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def connection_cap(requested: int, margin: int = FD_MARGIN) -> int:
    """`requested`, or less when the open-file limit would not hold that many connections beside
    what the process already has open and `margin` more (at least 1)."""
    soft = fd_limit()
    if soft is None:
        return requested
    return max(1, min(requested, soft - open_fds() - margin))


class ConnectionLimits:
    """Shared by the listening socket and every connection's protocol; `max_connections` may be
    lowered while serving (the model's load opens files too: the cap is measured again when it is
    ready). `held` counts the connections accepted and not yet closed."""

    def __init__(
        self, max_connections: int, client_timeout_s: float, log: Callable[[str], None]
    ) -> None:
        self.requested = max_connections
        self.max_connections = connection_cap(max_connections)
        self.client_timeout_s = client_timeout_s
        self.log = RepeatLimiter(log)
        self.refused = 0
        self.held = 0
        self._lock = threading.Lock()  # sockets are closed on the loop's thread, but say so

    def measure(self) -> int:
        """The cap again, from the open-file limit and the files open now."""
        self.max_connections = connection_cap(self.requested)
        return self.max_connections

    def admit(self) -> bool:
        """Whether one more connection may be held (then it is counted: `release` uncounts it)."""
        with self._lock:
            if self.held >= self.max_connections:
                return False
            self.held += 1
            return True

    def release(self) -> None:
        with self._lock:
            self.held -= 1

    def refuse(self, conn: socket.socket) -> None:
        """Answer a connection past the limit 503 and close it, holding its descriptor only for
        this call. The answer is a few hundred bytes into a fresh socket's empty send buffer:
        one non-blocking send writes it all, or the client has gone and nothing is lost."""
        self.refused += 1
        self.log(
            "connections",
            f"edge0: refused a connection: {self.max_connections} are open (the limit; "
            "--max-connections and the open-file limit set it)",
        )
        try:
            conn.setblocking(False)
            conn.send(busy_response())
        except OSError:
            pass
        finally:
            conn.close()

    def listener(self, sock: socket.socket) -> socket.socket:
        """`sock` (listening) as a `GuardedListener` under these limits; `sock` is detached."""
        return GuardedListener(sock, self)

    def protocol(self) -> type[H11Protocol]:
        """uvicorn's h11 protocol under these limits (uvicorn.Config's `http`)."""
        limits = self

        class Protocol(GuardedH11Protocol):
            pass

        Protocol.limits = limits
        return Protocol


_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
)
# Connections refused in one accept() at most: then asyncio's accept loop ends and the event loop
# serves the others before the listening socket's next turn, however fast clients connect.
REFUSALS_PER_ACCEPT = 64


def busy_response() -> bytes:
    """The 503 a connection past the limit gets, whole (status line, headers, JSON body)."""
    body = json.dumps(
        ApiError(
            503,
            "the server has too many open connections; try again shortly",
            "server_error",
            code="too_many_connections",
        ).body()
    ).encode()
    return _BUSY % (len(body), body)


class GuardedListener(socket.socket):
    """The listening socket uvicorn serves, refusing at accept time. asyncio accepts up to the
    backlog's worth (uvicorn: 2048) of waiting connections in one turn and makes their
    transports and protocols two turns later: a refusal in the protocol's connection_made came
    after every queued connection held a descriptor (measured under `ulimit -n 256` with 300
    connecting at once: 246 sockets open, then EMFILE and asyncio's traceback). Here a
    connection is counted when accepted, a `HeldConnection` uncounts it when closed, and one
    past the limit is answered and closed before the next is accepted."""

    def __init__(self, sock: socket.socket, limits: ConnectionLimits) -> None:
        super().__init__(sock.family, sock.type, sock.proto, fileno=sock.detach())
        self.limits = limits

    def accept(self) -> tuple[socket.socket, object]:
        # BlockingIOError (none waiting) ends asyncio's accept loop quietly; so does stopping
        # after REFUSALS_PER_ACCEPT refusals, and the loop calls again on the next turn.
        for _ in range(REFUSALS_PER_ACCEPT):
            conn, address = super().accept()
            if self.limits.admit():
                return HeldConnection.adopt(conn, self.limits), address
            self.limits.refuse(conn)
        raise BlockingIOError("refused connections past the limit; more may be waiting")


class HeldConnection(socket.socket):
    """An accepted connection that `ConnectionLimits.held` counts until it is closed (asyncio
    closes a transport's socket, or the socket of one it failed to make, with close())."""

    limits: ConnectionLimits | None = None

    @classmethod
    def adopt(cls, conn: socket.socket, limits: ConnectionLimits) -> HeldConnection:
        held = cls(conn.family, conn.type, conn.proto, fileno=conn.detach())
        held.limits = limits
        return held

    def close(self) -> None:
        super().close()
        self._uncount()

    def detach(self) -> int:
        fd = super().detach()
        self._uncount()  # no longer this object's to close: no longer counted by it
        return fd

    def _uncount(self) -> None:
        limits, self.limits = self.limits, None
        if limits is not None:
            limits.release()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's headers (the connection limit is
    the listener's)."""

    limits: ConnectionLimits

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline = None
        self._arm()

    def _arm(self) -> None:
        """The next request's headers must arrive within the client timeout."""
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(self.limits.client_timeout_s, self._expired)

    def _expired(self) -> None:
        self._deadline = None
        # A request whose headers arrived is the app's (it times its body out itself); only a
        # connection with no request under way is closed.
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc) -> None:
        if getattr(self, "_deadline", None) is not None:
            self._deadline.cancel()
            self._deadline = None
        super().connection_lost(exc)


# -- Host and Origin -------------------------------------------------------------------------------


def allowed_hosts(host: str, address: str) -> frozenset[str] | None:
    """The Host header names a server bound to `host` (as given; `address` is what it resolved
    to) answers to; None: any. On loopback, only loopback names: a web page whose name an
    attacker points at 127.0.0.1 (DNS rebinding) sends its own name and is refused. Bound to
    one other address: that address and the name given, besides the loopback names. Bound to
    every address (0.0.0.0, ::): any name, since clients reach it by names the server cannot
    know; there `--api-key` is the protection (the server warns when there is none), and a
    browser's requests are still refused by the Origin check."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if ip.is_unspecified:
        return None
    return LOOPBACK_NAMES | {_host_name(host), _host_name(str(ip))}


def _host_name(value: str) -> str:
    """A Host header's name: lower case, without the port, the brackets of an IPv6 address and a
    final dot."""
    value = value.strip().lower()
    if value.startswith("["):
        value = value[1:].partition("]")[0]
    elif value.count(":") == 1:
        value = value.partition(":")[0]
    return value.rstrip(".")


def _origin(value: str) -> str:
    return value.strip().lower().rstrip("/")


class RequestGuard:
    """ASGI middleware: a request whose Host is not this server's, or that comes from a web page
    whose Origin is not allowed, gets a 403 before anything else looks at it. Browsers send
    Origin on every cross-site request and on every POST, including the `text/plain` ones that
    need no preflight; other clients (curl, the openai library) send none."""

    def __init__(self, app, hosts: frozenset[str] | None, origins: Iterable[str]) -> None:
        self.app = app
        self.hosts = hosts
        self.origins = frozenset(_origin(o) for o in origins)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            error = self.refusal(dict(scope["headers"]))
            if error is not None:
                response = JSONResponse(error.body(), status_code=error.status)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, headers: dict[bytes, bytes]) -> ApiError | None:
        host = headers.get(b"host")
        if host is not None and self.hosts is not None:
            name = _host_name(host.decode("latin-1"))
            if name not in self.hosts:
                return ApiError(
                    403,
                    f"the Host header names {_shorten(name)}, not this server (it answers to "
                    f"{', '.join(sorted(self.hosts))}; --host sets it)",
                    code="host_not_allowed",
                )
        origin = headers.get(b"origin")
        if origin is not None and "*" not in self.origins:
            shown = _origin(origin.decode("latin-1"))
            if shown not in self.origins:
                return ApiError(
                    403,
                    f"requests from web pages at {_shorten(shown)} are not allowed "
                    "(edge0 serve --cors ORIGIN allows one)",
                    code="origin_not_allowed",
                )
        return None


# A preflight's Access-Control-Request-Headers: header names (HTTP tokens), comma-separated.
# Browsers ask for the headers a page's script sets, and the official SDKs set their own
# (`x-stainless-*`, `openai-organization`, `anthropic-dangerous-direct-browser-access`): once the
# origin is allowed, any name is, within these bounds on what the answer echoes back.
HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}")
MAX_PREFLIGHT_HEADERS = 64
MAX_PREFLIGHT_CHARS = 2048


def preflight_header_names(value: str) -> list[str] | None:
    """The header names a preflight asks for, lower-cased; None when the value is not a short
    list of header names (a control character, a value, too many, too long)."""
    if len(value) > MAX_PREFLIGHT_CHARS:
        return None
    names = [name.strip(" ").lower() for name in value.split(",")]
    if len(names) > MAX_PREFLIGHT_HEADERS or not all(HEADER_NAME.fullmatch(n) for n in names):
        return None
    return names


class BrowserCORS(CORSMiddleware):
    """Starlette's CORS for the origins allowed (--cors), allowing the request headers a
    preflight names when they are header names within bounds (`preflight_header_names`);
    `expose_headers`: the reply headers a page's script may read."""

    def __init__(self, app, origins: Iterable[str], expose_headers: Iterable[str]) -> None:
        super().__init__(
            app,
            allow_origins=list(origins),
            allow_methods=["GET", "POST"],
            allow_headers=["*"],
            expose_headers=list(expose_headers),
        )

    def preflight_response(self, request_headers: Headers) -> Response:
        asked = request_headers.get("access-control-request-headers")
        if asked is None:
            return super().preflight_response(request_headers)
        names = preflight_header_names(asked)
        if names is None:
            return PlainTextResponse(
                f"Disallowed CORS headers: Access-Control-Request-Headers must list at most "
                f"{MAX_PREFLIGHT_HEADERS} header names in {MAX_PREFLIGHT_CHARS} characters",
                status_code=400,
            )
        response = super().preflight_response(request_headers)
        if response.status_code == 200:  # the names as checked, not the client's bytes
            response.headers["Access-Control-Allow-Headers"] = ", ".join(names)
        return response


def _shorten(value: str) -> str:
    shown = repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."


# -- the log ---------------------------------------------------------------------------------------


class RepeatLimiter:
    """A log function that writes a line of a given kind at most once per `window_s`; the next
    one written says how many were left out in between."""

    def __init__(
        self,
        log: Callable[[str], None],
        window_s: float = REPEAT_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = log
        self.window_s = window_s
        self.clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def allow(self, kind: str) -> tuple[bool, int]:
        """Whether a line of `kind` may be written now, and how many were left out before it."""
        now = self.clock()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.window_s:
                self._skipped[kind] = self._skipped.get(kind, 0) + 1
                return False, 0
            self._last[kind] = now
            if len(self._last) > 1024:  # kinds are few; never let them grow without bound
                self._last = {kind: now}
            return True, self._skipped.pop(kind, 0)

    def __call__(self, kind: str, line: str) -> None:
        write, skipped = self.allow(kind)
        if write:
            self._log(line + (f" ({skipped} more like it not shown)" if skipped else ""))


class RepeatFilter(logging.Filter):
    """A logging filter with a `RepeatLimiter`'s rule, a record's kind being its logger and
    message template; a repeat that is written loses its traceback (the first had it)."""

    def __init__(self, window_s: float = REPEAT_WINDOW_S, clock=time.monotonic) -> None:
        super().__init__()
        self.limiter = RepeatLimiter(lambda line: None, window_s, clock)
        self._seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        # The first line: asyncio's lines go on with details (a socket's number) that vary.
        kind = f"{record.name}:{str(record.msg).partition(chr(10))[0]}"
        write, skipped = self.limiter.allow(kind)
        if not write:
            return False
        if kind in self._seen:
            record.exc_info = None
            record.exc_text = None
        elif len(self._seen) < 1024:
            self._seen.add(kind)
        if skipped:
            record.msg = f"{record.msg} ({skipped} more like it not shown)"
        return True


def limit_repeated_logs(names: Iterable[str] = ("asyncio", "uvicorn.error", "uvicorn")) -> None:
    """Put a `RepeatFilter` on the loggers a flood comes from (once per logger)."""
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RepeatFilter) for f in logger.filters):
            logger.addFilter(RepeatFilter())
