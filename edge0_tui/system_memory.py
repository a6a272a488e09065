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
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# Linux's readers (/proc/meminfo, the memory cgroup) are the engine's: training reads them too.
from engine import cgroup_memory, read_meminfo


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

# Two short subprocesses cost a few ms, and the panel asks several times a second from the UI
# thread: one sample a second is plenty for a memory figure.
MACOS_SAMPLE_SECONDS = 1.0
# A hung `vm_stat` must not freeze the app: past this, the figures are unknown for that sample.
MACOS_COMMAND_TIMEOUT_S = 0.5
# Full paths: an app started from a launcher may have a PATH without /usr/sbin.
VM_STAT, SYSCTL = "/usr/bin/vm_stat", "/usr/sbin/sysctl"
# sysctl names, printed as "name: value" lines (not `-n`: a name one macOS lacks is then skipped,
# instead of shifting every later value by one line).
MACOS_SYSCTLS = (
    "hw.memsize",
    "hw.pagesize",
    "vm.page_pageable_internal_count",
    "vm.page_purgeable_count",
)

_VM_STAT_PAGE_SIZE = re.compile(r"page size of (\d+) bytes")
_macos_sample: list[tuple[float, SystemMemory]] = []  # the latest (time, figures), at most one


@dataclass(frozen=True)
class VmStat:
    page_size: int | None  # from the header line, "(page size of 16384 bytes)"
    pages: dict[str, int]  # page counts by their label: "Pages free", "File-backed pages", ...


@dataclass(frozen=True)
class MacMemoryCounters:
    """macOS's own page counters, in bytes: what Activity Monitor's memory tab is made of."""

    wired: int
    active: int
    inactive: int
    compressed: int  # "Pages occupied by compressor": RAM the compressed pages take
    file_backed: int
    anonymous: int  # app memory: pageable pages not backed by a file
    purgeable: int  # anonymous pages their owner allows the OS to drop
    free: int


def read_macos_memory() -> SystemMemory:
    """The Mac's memory now, from `vm_stat` and `sysctl` (sampled at most once a second)."""
    now = time.monotonic()
    if _macos_sample and now - _macos_sample[0][0] < MACOS_SAMPLE_SECONDS:
        return _macos_sample[0][1]
    memory = macos_memory(
        _command_output([VM_STAT]), _command_output([SYSCTL, *MACOS_SYSCTLS]), _sysconf_total()
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


def mac_counters(vm_stat: VmStat, sysctl: dict[str, int]) -> MacMemoryCounters | None:
    """The counters in bytes; None when the page size or a needed counter is missing."""
    page_size = sysctl.get("hw.pagesize") or vm_stat.page_size
    pages = vm_stat.pages
    needed = (
        "Pages wired down",
        "Pages active",
        "Pages inactive",
        "Pages occupied by compressor",
        "File-backed pages",
        "Pages free",
    )
    if not page_size or any(name not in pages for name in needed):
        return None
    wired, active, inactive, compressed, file_backed, free = (pages[name] for name in needed)
    # sysctl's counts are the kernel's own; vm_stat's lines are the fallback on an older macOS.
    anonymous = sysctl.get("vm.page_pageable_internal_count", pages.get("Anonymous pages"))
    if anonymous is None:
        anonymous = max(0, active + inactive + pages.get("Pages speculative", 0) - file_backed)
    purgeable = sysctl.get("vm.page_purgeable_count", pages.get("Pages purgeable", 0))
    return MacMemoryCounters(
        wired=wired * page_size,
        active=active * page_size,
        inactive=inactive * page_size,
        compressed=compressed * page_size,
        file_backed=file_backed * page_size,
        anonymous=anonymous * page_size,
        purgeable=purgeable * page_size,
        free=free * page_size,
    )


def parse_vm_stat(text: str) -> VmStat:
    """`vm_stat`'s output: "Label:   12345." lines under a header that gives the page size."""
    found = _VM_STAT_PAGE_SIZE.search(text)
    pages = {}
    for line in text.splitlines():
        label, _, value = line.rpartition(":")
        value = value.strip().rstrip(".")
        if label and value.isdigit():
            pages[label.strip().strip('"')] = int(value)
    return VmStat(int(found.group(1)) if found else None, pages)


def parse_sysctl(text: str) -> dict[str, int]:
    """`sysctl NAME...` output, "name: value" lines; values that are not integers are left out."""
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if value.strip().isdigit():
            values[name.strip()] = int(value.strip())
    return values


def _command_output(command: list[str]) -> str:
    """A command's stdout, or "" when it cannot run or takes too long. A non-zero exit still
    returns what was printed: sysctl exits 1 for one unknown name but prints the others."""
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=MACOS_COMMAND_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.SubprocessError, ValueError):
        return ""
    return done.stdout or ""


def _sysconf_total() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0
