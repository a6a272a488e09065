"""A memory-limited cgroup for one benchmark arm: the "checkpoint does not fit in RAM" machine.

The limit caps anonymous memory and page cache together, so a checkpoint larger than the limit
cannot stay cached. cgroup v1 (`memory.limit_in_bytes`) and v2 (`memory.max`) are both handled; the
child group is made under the process's own group. If neither can be made, `create` raises an
Edge0Error saying why: a benchmark never silently runs without its limit.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ..errors import Edge0Error


def mounts() -> list[tuple[str, str, str]]:
    with open("/proc/mounts") as f:
        return [tuple(line.split()[1:4]) for line in f]  # (mount point, fstype, options)


def own_cgroups() -> dict[str, str]:
    """controller (or "" for v2) -> path of this process's group."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                out[controller] = path
    return out


class MemoryCgroup:
    def __init__(self, path: Path, version: int) -> None:
        self.path = path
        self.version = version

    @classmethod
    def create(cls, limit_bytes: int, name: str) -> MemoryCgroup:
        try:
            own = own_cgroups()
            mounted = mounts()
        except OSError as e:
            raise Edge0Error(
                f"cannot read this process's cgroups ({e}); --ram-limit needs Linux"
            ) from None
        reasons = []
        v1_root = next(
            (m for m, t, o in mounted if t == "cgroup" and "memory" in o.split(",")), None
        )
        if v1_root and "memory" in own:
            group = Path(v1_root) / own["memory"].lstrip("/") / name
            try:
                group.mkdir(exist_ok=True)
                (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
                return cls(group, 1)
            except OSError as e:
                reasons.append(f"cgroup v1 at {group}: {e.strerror or e}")
        v2_root = next((m for m, t, _ in mounted if t == "cgroup2"), None)
        if v2_root and "" in own:
            parent = Path(v2_root) / own[""].lstrip("/")
            group = parent / name
            try:
                if "memory" not in (parent / "cgroup.controllers").read_text().split():
                    raise OSError("the memory controller is not enabled for this group")
                group.mkdir(exist_ok=True)
                (group / "memory.max").write_text(str(limit_bytes))
                return cls(group, 2)
            except OSError as e:
                reasons.append(f"cgroup v2 at {group}: {e.strerror or e}")
        if not reasons:
            reasons.append("no cgroup memory controller is mounted")
        raise Edge0Error(
            "cannot make a memory-limited cgroup for --ram-limit: " + "; ".join(reasons)
        )

    def join(self) -> None:
        """Move the calling process into the group (used in the arm's child before exec)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak_bytes(self) -> int:
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            return int((self.path / name).read_text())
        except (OSError, ValueError):
            return 0

    def remove(self) -> None:
        """Release the group's page-cache charge and delete it."""
        for _ in range(20):
            try:
                if self.version == 1:
                    (self.path / "memory.force_empty").write_text("0")
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)  # the arm's process may still be exiting


def run_limited(limit_bytes: int, command: list[str], name: str | None = None) -> int:
    """Run `command` in a memory cgroup of `limit_bytes` and print its kernel peaks on stderr:
    the process tree's VmHWM (getrusage of the children: the largest RSS any of them reached)
    and the group's own peak (anonymous memory plus page cache). Returns the command's status,
    or 128+signal when it was killed (137: the OOM killer)."""
    import resource
    import subprocess
    import sys

    # A group of its own: a group left by a killed run would carry its peak into this one's.
    group = MemoryCgroup.create(limit_bytes, name or f"edge0-limited-{os.getpid()}")
    try:
        child = subprocess.Popen(command, preexec_fn=group.join)
        status = child.wait()
        group_peak = group.peak_bytes()
    finally:
        group.remove()
    peak_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    code = status if status >= 0 else 128 - status
    mib = 1024 * 1024
    print(
        f"memory cgroup {limit_bytes / mib:.0f} MiB: exit {code}, peak RSS (VmHWM) "
        f"{peak_rss / mib:.1f} MiB, group peak with page cache {group_peak / mib:.1f} MiB",
        file=sys.stderr,
    )
    return code


if __name__ == "__main__":
    # python -m engine.measure.memory_cgroup 360M -- edge0 train lora ...: the docs' cgroup runs.
    import sys

    from ..config import parse_size

    if len(sys.argv) < 4 or sys.argv[2] != "--":
        sys.exit("usage: python -m engine.measure.memory_cgroup LIMIT -- COMMAND [ARGS...]")
    sys.exit(run_limited(parse_size(sys.argv[1]), sys.argv[3:]))
