"""What every `edge0 doctor` check returns and takes: its outcome (`Check`: ok, FAIL or
skipped, with figures), the faults tests put in (`Faults`), and the machine's memory counters the
app reads for it. The checks (`doctor_*.py`) and the doctor that runs them (`doctor.py`) share
these; neither imports the other for them."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

OK, FAIL, SKIPPED = "ok", "FAIL", "skipped"
# The disk check's name, which the speed estimate reads its bandwidth from.
COLD_READS = "cold read bandwidth"


@dataclass(frozen=True)
class Check:
    """One check's outcome: `detail` says what was measured, or why it failed or was skipped."""

    group: str  # exactness, slots, disk, memory, backend, verdict
    name: str
    status: str  # OK, FAIL or SKIPPED
    detail: str
    figures: dict = field(default_factory=dict)  # numbers for --json and the verdict

    def line(self) -> str:
        if self.status == SKIPPED:
            return f"skipped  {self.name} ({self.detail})"
        return f"{self.status:<8} {self.name}: {self.detail}"


def ok(group: str, name: str, detail: str, **figures) -> Check:
    return Check(group, name, OK, detail, figures)


def fail(group: str, name: str, detail: str, **figures) -> Check:
    return Check(group, name, FAIL, detail, figures)


def skipped(group: str, name: str, why: str, **figures) -> Check:
    return Check(group, name, SKIPPED, why, figures)


@dataclass(frozen=True)
class Faults:
    """Faults put in on purpose, each breaking one check (tests/test_doctor.py); none in a user's
    run. Each is applied where the check gets its data, so the check's own logic is what fails."""

    wrong_token: bool = False  # on-demand's 6th token replaced before it is compared
    prefetch_wrong_token: bool = False  # prefetch's 6th token replaced
    misroute: bool = False  # a consumer layer routed by other experts than its prediction
    prefill_drift: float = 0.0  # added to one fast-prefill logit, times the row's largest
    racy_slot_write: bool = False  # a routed expert's slot overwritten before its layer computes
    pages_kept: bool = False  # the cold read's pages read in and not evicted before the reads


NO_FAULTS = Faults()


@dataclass(frozen=True)
class MachineMemory:
    """The memory panel's counters, read once (`edge0_tui.system_memory`; the engine does not
    import the app): the machine's total, the memory in use, the page cache; None: unknown."""

    total_bytes: int
    used_bytes: int | None
    page_cache_bytes: int | None
    source: str  # "RAM", "cgroup v2 limit", ...


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None
