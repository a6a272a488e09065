"""Ranks of one model on this machine: processes of an MLX distributed group on the ring backend.

`edge0 ... --hosts 2` and the bench's ranked arms start their ranks here: each process gets its
rank and a hostfile of free local ports in its environment, as `mlx.launch` would give it, and
`mx.distributed.init` joins them (engine/experts/share.py). Ranks on other machines are started
by `mlx.launch` (edge0_tui/ranks.py).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import threading
from pathlib import Path

RANK_VARIABLE = "MLX_RANK"
LOCAL = "127.0.0.1"


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind((LOCAL, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def run_ranks_here(ranks: int, command: list[str]) -> int:
    """Run `command` as `ranks` processes of one group on this machine; the exit status is rank
    0's, or that of the rank that failed first."""
    with tempfile.TemporaryDirectory(prefix="edge0-ranks-") as folder:
        hostfile = Path(folder) / "hosts.json"
        hostfile.write_text(json.dumps([[f"{LOCAL}:{port}"] for port in _free_ports(ranks)]))
        processes = []
        for r in range(ranks):
            env = {**os.environ, RANK_VARIABLE: str(r), "MLX_HOSTFILE": str(hostfile)}
            processes.append(subprocess.Popen(command, env=env))
        return _wait_for_all(processes)


def _wait_for_all(processes: list[subprocess.Popen]) -> int:
    """Rank 0's status, or that of the rank that failed first; a rank that fails stops the
    others (they would wait for it forever in the next sum)."""
    failed: list[int] = []  # statuses of ranks that failed on their own, in order

    def wait(process: subprocess.Popen) -> None:
        status = process.wait()
        if status != 0 and not stopping.is_set():
            failed.append(status)
            stopping.set()

    stopping = threading.Event()
    waiters = [threading.Thread(target=wait, args=(p,), daemon=True) for p in processes]
    for w in waiters:
        w.start()
    try:
        while not stopping.is_set() and any(w.is_alive() for w in waiters):
            stopping.wait(0.2)
    except KeyboardInterrupt:
        stopping.set()
        failed.append(130)
    stopping.set()
    for p in processes:
        if p.poll() is None:
            p.terminate()
    for w in waiters:
        w.join()
    return failed[0] if failed else processes[0].returncode
