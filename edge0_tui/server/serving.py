"""`serve`: the listening socket, uvicorn, and the engine thread beside them; the start-up text.

The ASGI app itself is app.py; this is the `edge0 serve` command's body around it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import signal
import socket
import threading
from collections.abc import Callable

from engine import Edge0Error

from .app import ServerSettings, create_app
from .engine_worker import EngineWorker
from .limits import KEEP_ALIVE_S, ConnectionLimits, allowed_hosts, fd_limit, limit_repeated_logs


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one). Raises Edge0Error."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise Edge0Error(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise Edge0Error(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def is_loopback(sock: socket.socket) -> bool:
    return ipaddress.ip_address(sock.getsockname()[0]).is_loopback


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(
    open_engine: Callable[[], object],
    settings: ServerSettings,
    host: str = "127.0.0.1",
    port: int = 8080,
    queue_limit: int = 16,
    max_batch: int = 1,
) -> None:
    """Listen, load the model on the engine thread, answer until SIGINT/SIGTERM. Raises
    Edge0Error when the address cannot be used or the model cannot be loaded."""
    import uvicorn

    sock = bind(host, port)
    url = url_of(sock)
    log = settings.log
    server: uvicorn.Server | None = None
    settings.hosts = allowed_hosts(host, sock.getsockname()[0])
    limits = ConnectionLimits(settings.max_connections, settings.client_timeout_s, log)
    sock = limits.listener(sock)  # refuses past the limit in accept(): before it holds a socket

    def on_ready(worker: EngineWorker) -> None:
        # The model's files are open now (and loading it may have raised the open-file limit).
        if limits.measure() < settings.max_connections:
            log(
                f"edge0: at most {limits.max_connections} connections at a time: the open-file "
                f"limit ({fd_limit()}) leaves no room for --max-connections "
                f"{settings.max_connections}"
            )
        for line in startup_lines(settings, worker, url):
            log(line)

    def on_failed(message: str) -> None:
        if server is not None:
            server.should_exit = True

    worker = EngineWorker(open_engine, queue_limit, on_ready, on_failed, max_batch)
    app = create_app(worker, settings)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            worker.cancel_all()  # streams end now, not after the graceful-shutdown timeout
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            """uvicorn's, without raising the signal again once shut down: a stop by SIGINT or
            SIGTERM is the server's normal end (exit status 0), not a kill."""
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            stops = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in stops}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=5,
        # The server's own lines only; uvicorn's stay at warnings.
        server_header=False,
        http=limits.protocol(),  # the header deadline
        timeout_keep_alive=min(KEEP_ALIVE_S, settings.client_timeout_s),
    )
    limit_repeated_logs()  # after Config, which sets up uvicorn's loggers
    server = Server(config)
    if not is_loopback(sock) and settings.api_key is None:
        log(f"edge0: warning: {url} is reachable from other machines and no --api-key is set")
    log(f"edge0: serving {settings.model_ids[0]} at {url} (loading the model...)")
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if worker.error:
        raise Edge0Error(worker.error)


def startup_lines(settings: ServerSettings, worker: EngineWorker, url: str) -> list[str]:
    """What the server offers, once the model is ready (called on the engine thread): its URL
    and APIs, the model's ids, the profile requests run with, and the memory plan."""
    name, *aliases = settings.model_ids
    also = f", also answers to {', '.join(aliases)}" if aliases else ""
    if not settings.strict_model_name:
        also += " and any other model name" if aliases else ", answers to any model name"
    k, mode = worker.configured or (worker.live.k, worker.live.mode)
    ks = ", ".join(str(p["k"]) for p in worker.profiles) or str(k)
    engine = worker.service.engine
    plan = getattr(engine, "memory_plan", None)  # what this K's pool and caches take
    key = "an API key (Bearer or x-api-key)" if settings.api_key else "no API key"
    lines = [
        f"edge0: ready: {name} ({worker.info.get('family')}){also}",
        f"edge0:   OpenAI API     {url}/v1/chat/completions, /v1/completions, /v1/responses, "
        "/v1/models",
        f"edge0:   Anthropic API  {url}/v1/messages, /v1/messages/count_tokens",
        f"edge0:   profile        K={k} {mode}; a request may name its own k ({ks}) and mode "
        f"({', '.join(worker.modes)}), for itself only",
        f"edge0:   {plan.line() if plan is not None else 'memory plan: none (resident)'}",
        f"edge0:   metrics        {url}/metrics, health at {url}/health; {key}",
    ]
    if worker.service.max_batch > 1:
        lines.append(
            f"edge0:   batching       up to {worker.service.max_batch} replies decode together; "
            "drafted ones run alone"
        )
    if settings.origins:
        lines.append(f"edge0:   CORS           web pages at {', '.join(settings.origins)}")
    return lines
