"""How much memory the machine (or this process's cgroup) has, and how much is in use.

The memory bar needs a total and a "used, not reclaimable" figure to set MLX's own memory and the
checkpoint's page cache against. The total is physical RAM, or the cgroup's limit when the process
runs in a memory-limited cgroup (a container): that limit, not RAM, is where the memory wall is.

Linux only; elsewhere the total comes from `sysconf` and the used figure is unknown (None).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# cgroup v1 writes "no limit" as a huge page-aligned number rather than "max".
_V1_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class SystemMemory:
    total_bytes: int
    # Memory in use that the kernel cannot simply drop (page cache excluded); None when unknown.
    used_bytes: int | None
    # Where total_bytes came from: "RAM", "cgroup v2 limit" or "cgroup v1 limit".
    source: str


@dataclass(frozen=True)
class CgroupMemory:
    limit_bytes: int
    # The cgroup's usage less its inactive file pages: what `docker stats` calls the working set.
    used_bytes: int | None
    version: int


def read_system_memory(
    proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")
) -> SystemMemory:
    """Total and used memory now, from /proc/meminfo and the process's cgroup."""
    meminfo = _read_meminfo(proc / "meminfo")
    if meminfo is None:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return SystemMemory(pages, None, "RAM")
    ram = meminfo["MemTotal"]
    used = ram - meminfo.get("MemAvailable", meminfo.get("MemFree", 0))
    try:
        cgroup = cgroup_memory((proc / "self" / "cgroup").read_text(), cgroup_root)
    except OSError:
        cgroup = None
    if cgroup is not None and cgroup.limit_bytes < ram:
        return SystemMemory(
            cgroup.limit_bytes,
            cgroup.used_bytes if cgroup.used_bytes is not None else used,
            f"cgroup v{cgroup.version} limit",
        )
    return SystemMemory(ram, used, "RAM")


def cgroup_memory(proc_self_cgroup: str, cgroup_root: Path) -> CgroupMemory | None:
    """The tightest memory limit on the process's cgroup or its ancestors, with that cgroup's usage.

    `proc_self_cgroup` is the text of /proc/self/cgroup: "0::/path" lines for cgroup v2,
    "N:memory:/path" for the v1 memory controller. v2 is mounted at `cgroup_root` (or at
    `cgroup_root/unified` on hybrid systems), v1's memory controller at `cgroup_root/memory`.
    """
    candidates: list[tuple[Path, str, int]] = []
    for line in proc_self_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        relative = path.strip().lstrip("/")
        if controllers == "":
            candidates += [(cgroup_root, relative, 2), (cgroup_root / "unified", relative, 2)]
        elif "memory" in controllers.split(","):
            candidates.append((cgroup_root / "memory", relative, 1))
    found = [_limit_of(d, v) for mount, rel, v in candidates for d in _with_ancestors(mount, rel)]
    limited = [f for f in found if f is not None]
    return min(limited, key=lambda f: f.limit_bytes, default=None)


def _with_ancestors(mount: Path, relative: str) -> list[Path]:
    """The cgroup's directory and its parents up to the mount: a child cgroup may be unlimited
    while its parent is not."""
    leaf = mount / relative
    return [leaf, *(p for p in leaf.parents if p.is_relative_to(mount))]


def _limit_of(directory: Path, version: int) -> CgroupMemory | None:
    limit_file, usage_file, inactive_key = (
        ("memory.max", "memory.current", "inactive_file")
        if version == 2
        else ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    )
    limit = _read_int(directory / limit_file)
    if limit is None or limit >= _V1_UNLIMITED:
        return None
    usage = _read_int(directory / usage_file)
    inactive = _read_stat(directory / "memory.stat").get(inactive_key, 0)
    return CgroupMemory(limit, max(0, usage - inactive) if usage is not None else None, version)


def _read_int(path: Path) -> int | None:
    """An integer file's value; None when missing or "max" (cgroup v2's "no limit")."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _read_stat(path: Path) -> dict[str, int]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    pairs = (line.split() for line in lines)
    return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].isdigit()}


def _read_meminfo(path: Path) -> dict[str, int] | None:
    """/proc/meminfo in bytes (the file says kB, meaning KiB)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    values = {}
    for line in lines:
        name, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            values[name] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return values if "MemTotal" in values else None
