"""The memory panel's macOS figures, parsed from recorded `vm_stat` and `sysctl` outputs (no Mac
runs the tests): the same split as Linux, and unknown figures, never an error, on bad output."""

from __future__ import annotations

import subprocess

import pytest

from edge0_tui import system_memory
from edge0_tui.system_memory import (
    SystemMemory,
    mac_counters,
    macos_memory,
    parse_sysctl,
    parse_vm_stat,
    read_macos_memory,
)

PAGE = 16384
GIB = 1 << 30
FALLBACK_TOTAL = 8 * GIB  # what sysconf would say; used only when sysctl gives no hw.memsize

# A 16 GB Apple-silicon Mac (macOS 14) with a model loaded and a browser open.
VM_STAT_16GB = """\
Mach Virtual Memory Statistics: (page size of 16384 bytes)
Pages free:                               20311.
Pages active:                            381042.
Pages inactive:                          369877.
Pages speculative:                         7920.
Pages throttled:                              0.
Pages wired down:                        161204.
Pages purgeable:                          12130.
"Translation faults":                 918273645.
Pages copy-on-write:                   23456789.
Pages zero filled:                    412345678.
Pages reactivated:                      9876543.
Pages purged:                           1234567.
File-backed pages:                       331508.
Anonymous pages:                         427331.
Pages stored in compressor:              452119.
Pages occupied by compressor:            104987.
Decompressions:                        31234567.
Compressions:                          45678901.
Pageins:                               12345678.
Pageouts:                                 98765.
Swapins:                                  43210.
Swapouts:                                 54321.
"""

SYSCTL_16GB = """\
hw.memsize: 17179869184
hw.pagesize: 16384
vm.page_pageable_internal_count: 429012
vm.page_purgeable_count: 12130
"""

# An older macOS without vm.page_pageable_internal_count: sysctl prints the others, complains on
# stderr and exits 1. The anonymous count then comes from vm_stat's line.
SYSCTL_MISSING_NAME = """\
hw.memsize: 17179869184
hw.pagesize: 16384
vm.page_purgeable_count: 12130
"""


def test_vm_stat_is_parsed_into_page_counts():
    parsed = parse_vm_stat(VM_STAT_16GB)
    assert parsed.page_size == PAGE
    assert parsed.pages["Pages wired down"] == 161204
    assert parsed.pages["Pages occupied by compressor"] == 104987
    assert parsed.pages["File-backed pages"] == 331508
    assert parsed.pages["Translation faults"] == 918273645  # quoted label, quotes dropped


def test_sysctl_is_parsed_by_name():
    assert parse_sysctl(SYSCTL_16GB) == {
        "hw.memsize": 17179869184,
        "hw.pagesize": 16384,
        "vm.page_pageable_internal_count": 429012,
        "vm.page_purgeable_count": 12130,
    }
    assert parse_sysctl("kern.ostype: Darwin\nhw.memsize: 17179869184\n") == {
        "hw.memsize": 17179869184
    }


def test_counters_are_bytes():
    counters = mac_counters(parse_vm_stat(VM_STAT_16GB), parse_sysctl(SYSCTL_16GB))
    assert counters.wired == 161204 * PAGE
    assert counters.active == 381042 * PAGE
    assert counters.inactive == 369877 * PAGE
    assert counters.compressed == 104987 * PAGE
    assert counters.file_backed == 331508 * PAGE
    assert counters.anonymous == 429012 * PAGE  # sysctl's count wins over vm_stat's
    assert counters.purgeable == 12130 * PAGE
    assert counters.free == 20311 * PAGE


def test_a_mac_shows_the_linux_split():
    memory = macos_memory(VM_STAT_16GB, SYSCTL_16GB, FALLBACK_TOTAL)
    assert memory == SystemMemory(
        total_bytes=16 * GIB,
        # Not reclaimable: wired + compressor + app memory (anonymous less purgeable).
        used_bytes=(161204 + 104987 + 429012 - 12130) * PAGE,
        source="RAM",
        # Reclaimable: file-backed pages and purgeable ones.
        file_cache_bytes=(331508 + 12130) * PAGE,
        free_bytes=20311 * PAGE,
    )
    # The figures are plausible for the machine: about 10.7 GiB used, 5.2 GiB cached.
    assert 10 * GIB < memory.used_bytes < 11 * GIB
    assert memory.used_bytes + memory.file_cache_bytes + memory.free_bytes <= memory.total_bytes


def test_a_missing_sysctl_name_falls_back_to_vm_stat():
    memory = macos_memory(VM_STAT_16GB, SYSCTL_MISSING_NAME, FALLBACK_TOTAL)
    assert memory.used_bytes == (161204 + 104987 + 427331 - 12130) * PAGE
    # No sysctl output at all: the page size comes from vm_stat's header, the total from sysconf.
    memory = macos_memory(VM_STAT_16GB, "", FALLBACK_TOTAL)
    assert memory.total_bytes == FALLBACK_TOTAL
    assert memory.used_bytes == (161204 + 104987 + 427331 - 12130) * PAGE


@pytest.mark.parametrize(
    "vm_stat",
    [
        "",
        "vm_stat: command not found\n",
        # Cut off before the compressor and file-backed lines.
        "\n".join(VM_STAT_16GB.splitlines()[:8]),
        VM_STAT_16GB.replace("Pages free:                               20311.", "Pages free: ???"),
    ],
    ids=["empty", "garbage", "truncated", "bad-number"],
)
def test_malformed_output_leaves_the_figures_unknown(vm_stat):
    memory = macos_memory(vm_stat, SYSCTL_16GB, FALLBACK_TOTAL)
    assert memory == SystemMemory(16 * GIB, None, "RAM")


def test_no_page_size_anywhere_leaves_the_figures_unknown():
    vm_stat = VM_STAT_16GB.replace("(page size of 16384 bytes)", "")
    assert macos_memory(vm_stat, "hw.memsize: 17179869184\n", FALLBACK_TOTAL).used_bytes is None
    assert macos_memory("", "", FALLBACK_TOTAL) == SystemMemory(FALLBACK_TOTAL, None, "RAM")


def test_commands_that_fail_or_hang_give_unknown_figures(monkeypatch):
    def hangs(*args, **kwargs):
        raise subprocess.TimeoutExpired(args[0], kwargs.get("timeout"))

    monkeypatch.setattr(system_memory, "_macos_sample", [])
    monkeypatch.setattr(subprocess, "run", hangs)
    assert read_macos_memory().used_bytes is None

    def missing(*args, **kwargs):
        raise FileNotFoundError(args[0][0])

    monkeypatch.setattr(system_memory, "_macos_sample", [])
    monkeypatch.setattr(subprocess, "run", missing)
    assert read_macos_memory().used_bytes is None


def test_read_macos_memory_runs_the_commands_once_a_second(monkeypatch):
    outputs = {system_memory.VM_STAT: VM_STAT_16GB, system_memory.SYSCTL: SYSCTL_16GB}
    calls = []

    def recorded(command, **kwargs):
        calls.append(command[0])
        assert kwargs["timeout"] <= 1  # a hung command cannot freeze the UI for long
        return subprocess.CompletedProcess(command, 1, outputs[command[0]], "")

    clock = iter([100.0, 100.5, 101.5])
    monkeypatch.setattr(system_memory.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(system_memory, "_macos_sample", [])
    monkeypatch.setattr(subprocess, "run", recorded)
    first = read_macos_memory()
    assert first.total_bytes == 16 * GIB and first.used_bytes is not None  # exit 1 still parsed
    assert read_macos_memory() is first and len(calls) == 2  # within the second: the same sample
    read_macos_memory()
    assert len(calls) == 4


def test_the_platform_picks_the_reader(monkeypatch):
    monkeypatch.setattr(system_memory.sys, "platform", "darwin")
    monkeypatch.setattr(system_memory, "read_macos_memory", lambda: "mac")
    monkeypatch.setattr(system_memory, "read_linux_memory", lambda: "linux")
    assert system_memory.read_system_memory() == "mac"
    monkeypatch.setattr(system_memory.sys, "platform", "linux")
    assert system_memory.read_system_memory() == "linux"


# -- the memory plan's limit on a Mac (engine/runtime/memory_plan.py) ------------------------------


def test_a_macs_limit_is_what_vm_stat_leaves_at_most_metals_working_set():
    from engine.runtime.memory_plan import mac_memory_limit

    counters = mac_counters(parse_vm_stat(VM_STAT_16GB), parse_sysctl(SYSCTL_16GB))
    # free 20311 + file-backed 331508 + purgeable 12130 pages, plus what the process holds.
    available = (20311 + 331508 + 12130) * PAGE
    rss = 300 << 20
    assert mac_memory_limit(rss, counters, None) == (
        rss + available,
        "vm_stat: free + file-backed + purgeable",
    )
    assert mac_memory_limit(rss, counters, 4 * GIB) == (4 * GIB, "Metal's recommended working set")


def test_the_plan_reads_the_mac_counters_where_there_is_no_proc(monkeypatch, tmp_path):
    from engine.runtime import memory_plan

    counters = mac_counters(parse_vm_stat(VM_STAT_16GB), parse_sysctl(SYSCTL_16GB))
    monkeypatch.setattr(memory_plan.sys, "platform", "darwin")
    monkeypatch.setattr(memory_plan, "read_mac_counters", lambda: counters)
    monkeypatch.setattr(memory_plan, "metal_wired_limit_bytes", lambda: 4 * GIB)
    limit, source = memory_plan.memory_limit(proc=tmp_path)  # no meminfo there
    assert (limit, source) == (4 * GIB, "Metal's recommended working set")


def test_the_wired_limit_is_the_resident_part_of_the_plan_within_the_working_set():
    from engine.runtime.memory_plan import MemoryPlan, wired_bytes_for

    plan = MemoryPlan(
        runtime_bytes=100 << 20,
        resident_bytes=3 * GIB,
        expert_cache_bytes=2 * GIB,
        prefill_bytes=GIB,
        kv_cache_bytes=GIB,
        working_bytes=0,
        whole_layer_prefill=False,
        context_tokens=8192,
        k=8,
        limit_bytes=16 * GIB,
        limit_source="test",
    )
    assert wired_bytes_for(plan, None) is None  # no Metal: nothing wired
    assert wired_bytes_for(plan, 10 * GIB) == 5 * GIB
    assert wired_bytes_for(plan, 4 * GIB) == 4 * GIB  # never above the working set
