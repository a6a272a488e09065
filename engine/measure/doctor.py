"""`edge0 doctor`: the checks a user runs on their own machine, each a line: ok, FAIL or skipped.

    edge0 doctor [MODEL] [--json] [--quick]

CI and every measurement run on Linux CPU; a user's Mac runs paths nothing else runs (reader
threads writing slots of MLX arrays while Metal computes, F_NOCACHE reads, the memory counters).
The doctor proves on the user's machine, in about a minute on the demo, that the engine is exact
and sound there, and hands them a report to paste into an issue:

1. exactness (`doctor_exactness.py`): on-demand = resident, prefetch = on-demand, prerouter routes
   by its prediction, the fast prefill within its bound;
2. slot writes under compute (`doctor_slots.py`): every step's logits with reads landing while
   the device computes = those of a run with one reader and compute synchronised;
3. the disk (`doctor_disk.py`): cold read bandwidth (eviction proven with mincore), the fixed cost
   of one load, F_NOCACHE on macOS;
4. memory and 5. backend (`doctor_machine.py`): the memory plan against the machine, the panel's
   counters, Metal's working set; MLX, device, BLAS, threads, and the temp folder, checked before
   the checks that write there (a missing TMPDIR or a full disk is that one line's FAIL);
6. the verdict: the decode speed to expect from the measured compute and bandwidth.

Each check takes its faults from `Faults`: tests break every check on purpose and see it FAIL.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..config import format_bytes
from . import doctor_disk, doctor_exactness, doctor_machine, doctor_slots
from .doctor_checks import FAIL, Check, Faults, MachineMemory, fail, ok, skipped

# The tiny synthetic checkpoints the exactness check also runs, written on the fly: families
# whose blocks differ most from the demo's Qwen3-MoE (linear attention and a gated shared
# expert; mxfp4 experts with biases; group routing and latent attention).
FAMILIES = ("qwen3_next", "gpt_oss", "deepseek_v3")
# Why a check that runs the engine did not run.
NOT_RUN = "not run: the temp folder check failed"
# Checks of the machine's setup rather than of edge0.
ENVIRONMENT_CHECKS = {"temp folder"}


@dataclass(frozen=True)
class DoctorConfig:
    model_dir: Path
    model_name: str  # as the user named it (demo, a folder's name): the report holds no path
    quick: bool = False
    families: tuple[str, ...] = FAMILIES
    tokens: int = 32  # greedy tokens each exactness run compares
    faults: Faults = field(default_factory=Faults)

    @property
    def stress_steps(self) -> int:
        """Decode steps of the slot-write stress run (a few hundred; --quick: enough for every
        layer's slots to be rewritten under compute many times over)."""
        return 32 if self.quick else 200


def run_doctor(
    config: DoctorConfig, memory: MachineMemory, on_check: Callable[[Check], None]
) -> list[Check]:
    """Every check in order, each handed to `on_check` as soon as it is known; the verdict last.
    A check that raises is a FAIL naming the error; the others still run."""
    checks: list[Check] = []

    def report(group: str, name: str, measure: Callable[[], Check | tuple]) -> Check:
        start = time.perf_counter()
        try:
            found = measure()
        except Exception as e:  # noqa: BLE001  (a doctor reports what broke and goes on)
            found = fail(group, name, f"{type(e).__name__}: {one_line(e)}")
        seconds = round(time.perf_counter() - start, 2)
        for check in found if isinstance(found, tuple) else (found,):
            check.figures.setdefault("seconds", seconds)
            checks.append(check)
            on_check(check)
        return found

    model, faults = config.model_dir, config.faults
    report("backend", "device", doctor_machine.check_device)
    report("backend", "BLAS", doctor_machine.check_blas)
    report("backend", "threads", doctor_machine.check_threads)
    temp, named_by = doctor_machine.temp_folder()
    temp_check = report(
        "backend", "temp folder", lambda: doctor_machine.check_temp_folder(temp, named_by)
    )

    def computes(group: str, name: str, measure: Callable[[], Check | tuple]) -> Check:
        """A check that runs the engine: MLX compiles its kernels into the temp folder, and the
        synthetic checkpoints are written there. Without one, it is not run (the temp folder's
        line says why), rather than a FAIL that blames the engine."""
        if temp_check.status == FAIL:
            return report(group, name, lambda: skipped(group, name, NOT_RUN))
        return report(group, name, measure)

    def synthetic(family: str) -> Check:
        with tempfile.TemporaryDirectory(prefix="edge0-doctor-", dir=temp) as folder:
            return doctor_exactness.check_family(Path(folder), family, config.tokens)

    # (A model the engine cannot open stops here: its one-line error is the command's.)
    budget = doctor_exactness.evicting_budget(model)
    on_demand = computes(
        "exactness",
        f"on-demand = resident ({config.model_name})",
        lambda: doctor_exactness.check_on_demand(
            model, config.model_name, config.tokens, budget, faults
        ),
    )
    for family in config.families:
        computes(
            "exactness",
            f"on-demand = resident (synthetic {family})",
            lambda family=family: synthetic(family),
        )
    tokens = on_demand.figures.get("tokens")
    computes(
        "exactness",
        "prefetch = on-demand",
        lambda: doctor_exactness.check_prefetch(model, tokens, config.tokens, budget, faults),
    )
    computes(
        "exactness",
        "prerouter routes by its prediction",
        lambda: doctor_exactness.check_prerouter(model, config.tokens, budget, faults),
    )
    computes(
        "exactness",
        "fast prefill within its bound",
        lambda: doctor_exactness.check_fast_prefill(model, faults),
    )
    slots = computes(
        "slots",
        doctor_slots.TITLE,
        lambda: doctor_slots.check_slot_writes(model, config.stress_steps, budget, faults),
    )
    disk = report("disk", "cold reads", lambda: doctor_disk.check_cold_reads(model, faults))
    cold = disk[0] if isinstance(disk, tuple) else disk
    report("disk", "F_NOCACHE", lambda: doctor_disk.check_nocache(model))
    plan = report("memory", "memory plan", lambda: doctor_machine.check_memory_plan(model, memory))
    report(
        "memory",
        "memory counters",
        lambda: doctor_machine.check_memory_counters(memory, doctor_machine.process_rss_two_ways()),
    )
    report(
        "memory",
        "Metal working set",
        lambda: doctor_machine.check_metal_memory(plan.figures.get("total_bytes")),
    )
    report(
        "verdict",
        "verdict",
        lambda: verdict(checks, slots.figures, cold.figures, on_demand.figures),
    )
    return checks


def one_line(error: Exception, limit: int = 300) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def verdict(checks: list[Check], slots: dict, cold: dict, model: dict) -> Check:
    """The summary line: any FAIL, else the decode speed to expect. A step computes in
    `compute_ms` (measured: the one-reader run's step less its wait for reads) and, with every
    routed expert read cold, reads `moe_layers * K * expert bytes` at the measured bandwidth.
    On-demand waits for its reads (compute + read); prefetch and prerouter read under compute, so
    their step cannot beat max(compute, read): the overlap limit (docs/benchmarks.md)."""
    failed = [c.name for c in checks if c.status == FAIL]
    compute_ms = slots.get("compute_ms")
    step_bytes = model.get("cold_bytes_per_token")
    bandwidth = cold.get("bytes_per_s")
    figures: dict = {"failed": failed}
    speed = ""
    if compute_ms and step_bytes and bandwidth:
        read_ms = step_bytes / bandwidth * 1e3
        figures.update(
            compute_ms=compute_ms,
            read_ms=read_ms,
            cached_tok_per_s=1e3 / compute_ms,
            on_demand_cold_tok_per_s=1e3 / (compute_ms + read_ms),
            overlap_limit_tok_per_s=1e3 / max(compute_ms, read_ms),
        )
        speed = (
            f"expect {1e3 / compute_ms:.1f} tok/s with its experts cached (compute "
            f"{compute_ms:.1f} ms a token); every expert read cold ({format_bytes(step_bytes)} "
            f"a token, {read_ms:.1f} ms at {format_bytes(bandwidth)}/s): on-demand "
            f"{figures['on_demand_cold_tok_per_s']:.1f} tok/s, prefetch and prerouter at most "
            f"{figures['overlap_limit_tok_per_s']:.1f} (the overlap limit)"
        )
    if failed:
        # The machine's own setup (the temp folder) is the user's to fix, not an issue to file.
        advice = (
            "fix what its line says, then run `edge0 doctor` again"
            if set(failed) <= ENVIRONMENT_CHECKS
            else "run `edge0 doctor --json` and attach its output to an issue"
        )
        return fail(
            "verdict",
            "verdict",
            f"{len(failed)} check{'s' * (len(failed) != 1)} failed ({', '.join(failed)}): {advice}",
            **figures,
        )
    return ok("verdict", "verdict", speed or "every check ok or skipped", **figures)


def report_dict(checks: list[Check], header: dict) -> dict:
    """The `--json` object: the header (versions, platform, model) and every check."""
    return {**header, "checks": [asdict(c) for c in checks]}
