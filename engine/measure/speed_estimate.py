"""The decode speed to expect of a model on this machine, from `edge0 doctor`'s two figures.

`edge0 doctor` measures, on its own model, the time a decode step computes (its reads excluded)
and the disk's cold read bandwidth. `machine_speed(checks)` turns them into what carries over to
another model: the weight bytes a step computes through a second (a decode step is bound by the
bytes its products stream, not by arithmetic) and the disk's bytes a second.
`estimate_decode_speed` applies them to a plan: a token computes through the dense weights and
K routed experts of every MoE layer, and reads from disk the experts the expert cache misses.
On-demand waits for its reads (compute + read), as the doctor's verdict counts it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .doctor_checks import COLD_READS, OK, Check


@dataclass(frozen=True)
class MachineSpeed:
    disk_bytes_per_s: float  # cold reads of expert bytes
    compute_bytes_per_s: float  # weight bytes a decode step computes through, a second


@dataclass(frozen=True)
class DecodeEstimate:
    cold_tok_per_s: float  # every routed expert read from disk
    warm_tok_per_s: float  # the expert cache holding `hit_share` of what a token routes to
    expert_bytes_per_token: int
    hit_share: float


def estimate_decode_speed(
    dense_bytes: int, expert_bytes_per_token: int, hit_share: float, speed: MachineSpeed
) -> DecodeEstimate:
    """Tokens a second of on-demand decode: a step computes through `dense_bytes` and
    `expert_bytes_per_token` at the compute rate, and reads the part of the experts the cache
    misses (all of them cold, `1 - hit_share` warm) at the disk's rate."""
    hit_share = min(max(hit_share, 0.0), 1.0)
    compute_s = (dense_bytes + expert_bytes_per_token) / speed.compute_bytes_per_s
    read_s = expert_bytes_per_token / speed.disk_bytes_per_s
    return DecodeEstimate(
        cold_tok_per_s=1 / (compute_s + read_s),
        warm_tok_per_s=1 / (compute_s + read_s * (1 - hit_share)),
        expert_bytes_per_token=expert_bytes_per_token,
        hit_share=hit_share,
    )


def machine_speed(checks: list[Check]) -> MachineSpeed | None:
    """The two figures from a doctor run, or None where a check they come from did not pass:
    the step's compute time (the slot-write run), the bytes its model computes through a token
    (the first on-demand check: the doctor's model) and the cold read bandwidth (the disk)."""
    model = _first(checks, lambda c: c.name.startswith("on-demand = resident ("))
    slots = _first(checks, lambda c: c.group == "slots")
    disk = _first(checks, lambda c: c.name == COLD_READS)
    if any(c is None or c.status != OK for c in (model, slots, disk)):
        return None
    compute_ms = slots.figures.get("compute_ms")
    step_bytes = model.figures.get("resident_bytes", 0) + model.figures.get(
        "cold_bytes_per_token", 0
    )
    bandwidth = disk.figures.get("bytes_per_s")
    if not compute_ms or not step_bytes or not bandwidth:
        return None
    return MachineSpeed(bandwidth, step_bytes / (compute_ms / 1e3))


def _first(checks: list[Check], wanted: Callable[[Check], bool]) -> Check | None:
    return next((c for c in checks if wanted(c)), None)
