"""Ranks of one model on this machine: processes of an MLX distributed group on the ring backend.

`edge0 ... --hosts 2` and the bench's ranked arms start their ranks here: each process gets its
rank and a hostfile of free local ports in its environment, as `mlx.launch` would give it, and
`mx.distributed.init` joins them (engine/experts/share.py). Ranks on other machines are started
by `mlx.launch` (edge0_tui/ranks.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

RANK_VARIABLE = "MLX_RANK"  # a rank's number, in its environment (as mlx.launch sets it)
LOCAL_HOST = "127.0.0.1"
MAX_RANKS = 16  # the most ranks a command or a bench arm is run as
STOP_GRACE_S = 10  # how long a rank told to stop may take before it is killed
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind((LOCAL_HOST, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def run_ranks_here(
    ranks: int,
    command: list[str],
    stdout: IO | None = None,
    stderr: IO | None = None,
    timeout_s: float | None = None,
) -> int:
    """Run `command` as `ranks` processes of one group on this machine; the exit status is rank
    0's, or that of the rank that failed first (-1: past `timeout_s`, every rank stopped).
    `stdout`: where rank 0's output goes (the others' is dropped then); `stderr`, every rank's."""
    with tempfile.TemporaryDirectory(prefix="edge0-ranks-") as folder:
        hostfile = Path(folder) / "hosts.json"
        hostfile.write_text(json.dumps([[f"{LOCAL_HOST}:{port}"] for port in _free_ports(ranks)]))
        processes = []
        for r in range(ranks):
            env = {**os.environ, RANK_VARIABLE: str(r), "MLX_HOSTFILE": str(hostfile)}
            out = stdout if r == 0 or stdout is None else subprocess.DEVNULL
            processes.append(subprocess.Popen(command, env=env, stdout=out, stderr=stderr))
        return _wait_for_all(processes, timeout_s)


def _wait_for_all(processes: list[subprocess.Popen], timeout_s: float | None) -> int:
    """Rank 0's status, or that of the rank that failed first; a rank that fails stops the
    others (they would wait for it forever in the next sum). SIGTERM or SIGINT here is passed
    to rank 0 (a server stops, its engine closing tells the others), then the others follow.
    Once rank 0 has ended, the others are given STOP_GRACE_S to end, then stopped: a rank left
    inside a reply that rank 0 never finished would wait for it forever."""
    failed: list[int] = []  # statuses of ranks that failed on their own, in order
    stopping = threading.Event()
    asked = threading.Event()

    def wait(process: subprocess.Popen) -> None:
        status = process.wait()
        if status != 0 and not stopping.is_set():
            failed.append(status)
            stopping.set()

    waiters = [threading.Thread(target=wait, args=(p,), daemon=True) for p in processes]
    for w in waiters:
        w.start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with _signals_set(asked):
        while not stopping.is_set() and not asked.is_set() and waiters[0].is_alive():
            stopping.wait(0.2)
            if deadline is not None and time.monotonic() > deadline:
                failed.append(-1)
                break
        stopping.set()
        if asked.is_set() and not failed and processes[0].poll() is None:
            processes[0].terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                processes[0].wait(timeout=STOP_GRACE_S)
        for p in processes:
            if p.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=0 if failed else STOP_GRACE_S)
            if p.poll() is None:
                p.terminate()
        for p in processes:  # a rank still joining the group does not hear SIGTERM's handler
            try:
                p.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                p.kill()
    for w in waiters:
        w.join()
    return failed[0] if failed else processes[0].returncode


@contextlib.contextmanager
def _signals_set(asked: threading.Event):
    """SIGTERM and SIGINT set `asked` (main thread only; elsewhere they stay as they are)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {sig: signal.signal(sig, lambda *_: asked.set()) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
