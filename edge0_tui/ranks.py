"""`--hosts`: run a command as several ranks of one model, each with its share of the experts.

`edge0 generate MODEL --hosts 127.0.0.1,127.0.0.1 ...` starts the same command once per host, as
ranks of an MLX distributed group (engine/experts/share.py). Rank 0 is the command the user sees:
its stdout and exit status are the command's. The other ranks print nothing on stdout, and their
lines on stderr are labelled with their rank; where rank 0 draws on the terminal (`edge0 chat`),
they write those lines to a log file instead.

Processes on this machine (every host 127.0.0.1) are started by the engine's
`run_ranks_here`, on free ports of the ring backend. Other machines are reached through `mlx.launch` (ssh, and the backend it picks or
`--backend` names: JACCL over Thunderbolt where the OS has RDMA, else ring).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engine import LOCAL_HOST, MAX_RANKS, RANK_VARIABLE, Edge0Error, run_ranks_here

STATUS_VARIABLE = "EDGE0_RANK0_STATUS"  # where rank 0 leaves its status for mlx.launch's caller


def in_rank() -> bool:
    """This process is a rank that a launcher started (not the command the user typed)."""
    return RANK_VARIABLE in os.environ


def rank() -> int:
    return int(os.environ.get(RANK_VARIABLE, "0"))


@dataclass(frozen=True)
class Hosts:
    """Where the ranks run: a host each (`names`), or the ranks of an mlx.launch hostfile."""

    names: tuple[str, ...] = ()
    hostfile: Path | None = None

    @property
    def here(self) -> bool:
        return self.hostfile is None and all(h == LOCAL_HOST for h in self.names)


def parse_hosts(spec: str) -> Hosts:
    """`--hosts`: a number of ranks on this machine, comma-separated hosts (one rank each), or an
    mlx.launch hostfile (JSON; it may name the backend)."""
    if spec.endswith(".json"):
        path = Path(spec)
        if not path.is_file():
            raise Edge0Error(f"--hosts {spec}: no such hostfile")
        return Hosts(hostfile=path)
    names = (
        [LOCAL_HOST] * int(spec) if spec.strip().isdigit() else [h.strip() for h in spec.split(",")]
    )
    if not 2 <= len(names) <= MAX_RANKS or not all(names):
        raise Edge0Error(
            f"--hosts {spec!r}: name 2 to {MAX_RANKS} hosts, comma-separated, a number of ranks on "
            "this machine, or an mlx.launch hostfile (.json)"
        )
    return Hosts(tuple(names))


def launch(hosts: Hosts, argv: list[str]) -> int:
    """Run `edge0 ARGV` as one rank per host; the exit status is rank 0's, or the first failing
    rank's."""
    command = [sys.executable, "-m", "edge0_tui.cli", *argv]
    if hosts.here:
        return run_ranks_here(len(hosts.names), command)
    return _launch_with_mlx(hosts, command)


def enter_rank(log: Path | None = None) -> None:
    """In a rank other than 0: nothing on stdout (rank 0 prints the command's output), and each
    stderr line labelled with the rank. With `log`, the process's stdout and stderr (MLX's own
    lines too) go to that file, appended to, instead of the terminal."""
    if rank() == 0:
        return
    if log is not None:
        _write_to(log)
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the process's life)
    sys.stderr = _Labelled(sys.stderr, f"edge0 rank {rank()}: ")


def _write_to(log: Path) -> None:
    """Point this process's stdout and stderr descriptors at `log`."""
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError as e:
        raise Edge0Error(f"{log}: cannot write this rank's log ({e.strerror})") from None
    sys.stderr.flush()
    for target in (1, 2):
        os.dup2(fd, target)
    os.close(fd)


class _Labelled:
    """A text stream that starts each line with `label`."""

    def __init__(self, stream, label: str) -> None:
        self._stream, self._label, self._at_start = stream, label, True

    def write(self, text: str) -> int:
        for line in text.splitlines(keepends=True):
            if self._at_start:
                self._stream.write(self._label)
            self._stream.write(line)
            self._at_start = line.endswith("\n")
        return len(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _launch_with_mlx(hosts: Hosts, command: list[str]) -> int:
    """Ranks on other machines, through mlx.launch. Its own status says nothing of the ranks',
    so rank 0 (the first host: this machine) writes its status to a file here."""
    with tempfile.TemporaryDirectory(prefix="edge0-ranks-") as folder:
        status = Path(folder) / "status"
        launcher = [command[0], "-c", "from mlx._distributed_utils.launch import main; main()"]
        if hosts.hostfile is not None:
            launcher += ["--hostfile", str(hosts.hostfile)]
        else:
            launcher += ["--hosts", ",".join(hosts.names)]
        launcher += ["--env", f"{STATUS_VARIABLE}={status}", "--python", command[0], "--"]
        subprocess.run(launcher + command[1:])
        try:
            return int(status.read_text())
        except (OSError, ValueError):
            return 1


def follow(args, config) -> int:
    """A rank other than 0: load the model as rank 0 does and run each of its replies with it,
    saying each one's figures (this rank's reads and memory) on stderr."""
    from edge0_tui.commands import options
    from edge0_tui.commands.generate import summary_line
    from engine import Engine

    model = options.model_path(str(args.model))  # (serve resolves it on its engine thread)
    with Engine(model, config) as engine:
        engine.follow(lambda result: print(summary_line(result.summary), file=sys.stderr))
    return 0


def note_status(code: int) -> None:
    """In rank 0 started by mlx.launch: leave the command's exit status for the launcher."""
    path = os.environ.get(STATUS_VARIABLE)
    if path and rank() == 0:
        Path(path).write_text(str(code))
