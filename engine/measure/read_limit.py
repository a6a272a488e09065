"""A read-bandwidth-limited cgroup for one benchmark arm: a laptop SSD under a fast GPU, on any box.

Linux throttles a cgroup's reads per block device: cgroup v1 `blkio.throttle.read_bps_device` or
cgroup v2 `io.max` (`rbps=`), both keyed by the whole disk's `major:minor` (a partition's rule is
refused, so a partition is mapped to its parent disk). Reads served from the page cache are not
throttled: the limit bites on cold reads only. The throttle works in time slices, so short bursts
pass above the limit; `edge0 bench` therefore reports the bandwidth each arm actually got.

If the group cannot be made (not Linux, no blkio or io controller, not writable, a file system
without a block device), `create` raises an Edge0Error saying why in one line: a benchmark never
silently runs unthrottled.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from ..errors import Edge0Error
from .memory_cgroup import mounts, own_cgroups

REFUSAL = "cannot throttle reads for --read-limit: "


def block_device(path: Path, sys_root: Path = Path("/sys")) -> tuple[int, int]:
    """(major, minor) of the whole disk holding `path`, as the throttle rules need it."""
    try:
        dev = os.stat(path).st_dev
    except OSError as e:
        raise Edge0Error(f"{path}: cannot read ({e.strerror or e})") from None
    return whole_disk(os.major(dev), os.minor(dev), str(path), sys_root)


def whole_disk(major: int, minor: int, what: str, sys_root: Path = Path("/sys")) -> tuple[int, int]:
    """The disk of block device `major:minor` (itself, or a partition's parent), from sysfs."""
    node = sys_root / "dev" / "block" / f"{major}:{minor}"
    if major == 0 or not node.exists():
        raise Edge0Error(
            f"{REFUSAL}{what} is on a file system without a block device (device {major}:{minor}: "
            "tmpfs, overlayfs, btrfs or a network file system?); reads can be throttled only per "
            "block device"
        )
    if (node / "partition").exists():  # a partition: its disk is the directory above it
        try:
            major, minor = (int(n) for n in (node.resolve().parent / "dev").read_text().split(":"))
        except (OSError, ValueError) as e:
            raise Edge0Error(
                f"{REFUSAL}cannot find the disk of partition {node.name} ({e})"
            ) from None
    return major, minor


class ReadLimitCgroup:
    def __init__(self, path: Path, version: int, rules: list[str]) -> None:
        self.path = path
        self.version = version
        self.rules = rules  # the throttle file's lines for our devices, as read back from it

    @classmethod
    def create(
        cls,
        bytes_per_s: int,
        devices: list[tuple[int, int]],
        name: str,
        inside: Path | None = None,
    ) -> ReadLimitCgroup:
        """A group whose reads from `devices` are limited to `bytes_per_s`.

        `inside`: a cgroup v2 group (the arm's memory group) to nest in, since a process is in one
        v2 group only; cgroup v1 has a blkio hierarchy of its own.
        """
        if sys.platform != "linux":
            raise Edge0Error(
                f"{REFUSAL}it needs Linux cgroups (blkio or io); this is {sys.platform}"
            )
        if bytes_per_s < 1:
            raise Edge0Error(f"{REFUSAL}the limit must be at least 1 byte/s")
        try:
            own = own_cgroups()
            mounted = mounts()
        except OSError as e:
            raise Edge0Error(f"{REFUSAL}cannot read this process's cgroups ({e})") from None
        reasons = []
        v1_root = next(
            (m for m, t, o in mounted if t == "cgroup" and "blkio" in o.split(",")), None
        )
        if v1_root and "blkio" in own:
            group = Path(v1_root) / own["blkio"].lstrip("/") / name
            lines = [f"{major}:{minor} {bytes_per_s}" for major, minor in devices]
            try:
                return cls(group, 1, _make(group, "blkio.throttle.read_bps_device", lines))
            except OSError as e:
                reasons.append(f"cgroup v1 blkio at {group}: {e.strerror or e}")
        v2_root = next((m for m, t, _ in mounted if t == "cgroup2"), None)
        if v2_root and "" in own:
            parent = inside or Path(v2_root) / own[""].lstrip("/")
            group = parent / name
            lines = [f"{major}:{minor} rbps={bytes_per_s}" for major, minor in devices]
            try:
                if "io" not in (parent / "cgroup.controllers").read_text().split():
                    raise OSError("the io controller is not available to this group")
                if "io" not in (parent / "cgroup.subtree_control").read_text().split():
                    (parent / "cgroup.subtree_control").write_text("+io")
                return cls(group, 2, _make(group, "io.max", lines))
            except OSError as e:
                reasons.append(f"cgroup v2 at {group}: {e.strerror or e}")
        if not reasons:
            reasons.append("no cgroup blkio (v1) or io (v2) controller is mounted")
        raise Edge0Error(REFUSAL + "; ".join(reasons))

    def join(self) -> None:
        """Move the calling process into the group (used in the arm's child before exec)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def read_bytes(self) -> int:
        """Bytes the group's processes read from the throttled devices (not from the page cache)."""
        devices = {rule.split()[0] for rule in self.rules}
        total = 0
        try:
            if self.version == 1:  # "254:0 Read 1234" lines
                for line in (
                    (self.path / "blkio.throttle.io_service_bytes").read_text().splitlines()
                ):
                    fields = line.split()
                    if len(fields) == 3 and fields[0] in devices and fields[1] == "Read":
                        total += int(fields[2])
            else:  # "254:0 rbytes=1234 wbytes=..." lines
                for line in (self.path / "io.stat").read_text().splitlines():
                    fields = line.split()
                    if fields and fields[0] in devices:
                        stats = dict(f.split("=", 1) for f in fields[1:] if "=" in f)
                        total += int(stats.get("rbytes", 0))
        except (OSError, ValueError):
            return 0
        return total

    def remove(self) -> None:
        for _ in range(20):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)  # the arm's process may still be exiting


def _make(group: Path, limit_file: str, lines: list[str]) -> list[str]:
    """mkdir the group, write the rules, and return them as the kernel reads them back."""
    group.mkdir(exist_ok=True)
    try:
        for line in lines:
            (group / limit_file).write_text(line)
        written = (group / limit_file).read_text().splitlines()
        devices = {line.split()[0] for line in lines}
        rules = sorted(r for r in written if r.split() and r.split()[0] in devices)
        if len(rules) != len(devices):
            raise OSError(f"{limit_file} reads back {written!r}, not the rules written")
        return rules
    except OSError:
        try:
            group.rmdir()
        except OSError:
            pass
        raise
