"""How much memory the machine (or this process's cgroup) has, and where it is.

The memory panel sets edge0's own memory against the machine's: its total, the memory in use that
the OS cannot simply drop, the reclaimable file cache, and what is free. The total is physical RAM,
or the cgroup's limit when the process runs in a memory-limited cgroup (a container): that limit,
not RAM, is where the memory wall is.

One reader per platform, chosen in `read_system_memory`: Linux reads /proc/meminfo and cgroups;
macOS runs `vm_stat` and `sysctl` and parses their text with pure functions (testable anywhere).
Elsewhere the total comes from `sysconf` and the other figures are unknown (None).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# Linux's readers (/proc/meminfo, the memory cgroup) are the engine's: training reads them too.
# macOS's parsers are the engine's too: the memory plan reads what the Mac has available.
from engine import (
    MACOS_SYSCTLS,
    SYSCTL,
    VM_STAT,
    cgroup_memory,
    command_output,
    mac_counters,
    parse_sysctl,
    parse_vm_stat,
    read_meminfo,
)


@dataclass(frozen=True)
class SystemMemory:
    total_bytes: int
    # Memory in use that the OS cannot simply drop (file cache excluded); None when unknown.
    used_bytes: int | None
    # Where total_bytes came from: "RAM", "cgroup v2 limit" or "cgroup v1 limit".
    source: str
    # File-backed pages the OS drops under pressure (the page cache); None when unknown.
    file_cache_bytes: int | None = None
    # Memory holding nothing at all; None when unknown.
    free_bytes: int | None = None


def read_system_memory() -> SystemMemory:
    """The machine's memory now, read the way this platform exposes it."""
    if sys.platform == "darwin":
        return read_macos_memory()
    return read_linux_memory()


# -- Linux -----------------------------------------------------------------------------------------


def read_linux_memory(
    proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")
) -> SystemMemory:
    """Total, used, file cache and free memory now, from /proc/meminfo and the process's cgroup."""
    meminfo = read_meminfo(proc / "meminfo")
    if meminfo is None:
        return SystemMemory(_sysconf_total(), None, "RAM")
    ram = meminfo["MemTotal"]
    used = ram - meminfo.get("MemAvailable", meminfo.get("MemFree", 0))
    # The file LRU lists, not "Cached": that one also counts shmem/tmpfs, which cannot be dropped.
    file_lru = [meminfo.get(k) for k in ("Active(file)", "Inactive(file)")]
    file_cache = sum(file_lru) if None not in file_lru else meminfo.get("Cached")
    try:
        cgroup = cgroup_memory((proc / "self" / "cgroup").read_text(), cgroup_root)
    except OSError:
        cgroup = None
    if cgroup is not None and cgroup.limit_bytes < ram:
        return SystemMemory(
            cgroup.limit_bytes,
            cgroup.used_bytes if cgroup.used_bytes is not None else used,
            f"cgroup v{cgroup.version} limit",
            cgroup.file_cache_bytes,
            cgroup.free_bytes,
        )
    return SystemMemory(ram, used, "RAM", file_cache, meminfo.get("MemFree"))


# -- macOS -----------------------------------------------------------------------------------------

_macos_sample: list[tuple[float, SystemMemory]] = []  # the latest (time, figures), at most one

# Two short subprocesses cost a few ms, and the panel asks several times a second from the UI
# thread: one sample a second is plenty for a memory figure.
MACOS_SAMPLE_SECONDS = 1.0


def read_macos_memory() -> SystemMemory:
    """The Mac's memory now, from `vm_stat` and `sysctl` (sampled at most once a second)."""
    now = time.monotonic()
    if _macos_sample and now - _macos_sample[0][0] < MACOS_SAMPLE_SECONDS:
        return _macos_sample[0][1]
    memory = macos_memory(
        command_output([VM_STAT]), command_output([SYSCTL, *MACOS_SYSCTLS]), _sysconf_total()
    )
    _macos_sample[:] = [(now, memory)]
    return memory


def macos_memory(vm_stat: str, sysctl: str, fallback_total: int) -> SystemMemory:
    """The Linux panel's split from macOS counters: not reclaimable, file cache, free.

    Used is Activity Monitor's "Memory Used": wired + compressed + app memory (anonymous less
    purgeable). The file cache is its "Cached Files": file-backed + purgeable pages.
    """
    values = parse_sysctl(sysctl)
    total = values.get("hw.memsize") or fallback_total
    counters = mac_counters(parse_vm_stat(vm_stat), values)
    if counters is None:
        return SystemMemory(total, None, "RAM")
    used = counters.wired + counters.compressed + max(0, counters.anonymous - counters.purgeable)
    file_cache = counters.file_backed + counters.purgeable
    return SystemMemory(total, used, "RAM", file_cache, counters.free)


def _sysconf_total() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0
