"""macOS's memory figures: `vm_stat` and `sysctl`, parsed by pure functions (testable anywhere).

Read by the memory plan (what a run may hold: `available_bytes`) and by the app's memory panel
(`edge0_tui/system_memory.py`, which splits them as Activity Monitor does). The commands run with
a short timeout: a hung `vm_stat` must not freeze a load or the app. No MLX.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

# A hung `vm_stat` must not freeze the app or a load: past this, the figures are unknown.
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


def read_mac_counters() -> MacMemoryCounters | None:
    """The counters now (two short subprocesses); None when they cannot be read."""
    sysctl = parse_sysctl(command_output([SYSCTL, *MACOS_SYSCTLS]))
    return mac_counters(parse_vm_stat(command_output([VM_STAT])), sysctl)


def available_bytes(counters: MacMemoryCounters) -> int:
    """What a new allocation can have without compressing or swapping anyone's memory: free
    pages, file-backed pages (the cache the OS drops first) and purgeable ones. Activity
    Monitor's total less its "Memory Used"."""
    return counters.free + counters.file_backed + counters.purgeable


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


def command_output(command: list[str]) -> str:
    """A command's stdout, or "" when it cannot run or takes too long. A non-zero exit still
    returns what was printed: sysctl exits 1 for one unknown name but prints the others."""
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=MACOS_COMMAND_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.SubprocessError, ValueError):
        return ""
    return done.stdout or ""
