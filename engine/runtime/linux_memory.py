"""Linux's memory figures: /proc/meminfo and the tightest memory-cgroup limit on this process.

Read by the app's memory panel (`edge0_tui/system_memory.py`, which adds macOS) and by training,
which refuses up front a student that cannot fit (`available_memory_bytes`). Pure file reads, no
MLX.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# cgroup v1 writes "no limit" as a huge page-aligned number rather than "max".
_V1_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class CgroupMemory:
    limit_bytes: int
    # The cgroup's usage less its inactive file pages: what `docker stats` calls the working set.
    used_bytes: int | None
    version: int
    file_cache_bytes: int | None = None
    free_bytes: int | None = None


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
    limit_file, usage_file, stat_prefix = (
        ("memory.max", "memory.current", "")
        if version == 2
        else ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_")
    )
    limit = _read_int(directory / limit_file)
    if limit is None or limit >= _V1_UNLIMITED:
        return None
    usage = _read_int(directory / usage_file)
    stat = _read_stat(directory / "memory.stat")
    inactive = stat.get(f"{stat_prefix}inactive_file", 0)
    file_lru = [stat.get(f"{stat_prefix}{k}_file") for k in ("active", "inactive")]
    return CgroupMemory(
        limit,
        max(0, usage - inactive) if usage is not None else None,
        version,
        file_cache_bytes=sum(file_lru) if None not in file_lru else None,
        free_bytes=max(0, limit - usage) if usage is not None else None,
    )


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


def read_meminfo(path: Path) -> dict[str, int] | None:
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


def available_memory_bytes(
    proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")
) -> int | None:
    """Memory this process could still take: MemAvailable, lowered to what its memory cgroup (or
    an ancestor's limit) leaves beside the cgroup's working set; None without /proc/meminfo."""
    meminfo = read_meminfo(proc / "meminfo")
    if meminfo is None or "MemAvailable" not in meminfo:
        return None
    available = meminfo["MemAvailable"]
    try:
        cgroup = cgroup_memory((proc / "self" / "cgroup").read_text(), cgroup_root)
    except OSError:
        cgroup = None
    if cgroup is not None and cgroup.used_bytes is not None:
        available = min(available, max(0, cgroup.limit_bytes - cgroup.used_bytes))
    return available
