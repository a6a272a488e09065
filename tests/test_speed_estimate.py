"""The decode speed `edge0 info --memory` expects from `edge0 doctor`'s figures
(`engine.measure.speed_estimate`), and the figures kept from a doctor run."""

from __future__ import annotations

import pytest

from engine.measure.doctor_checks import COLD_READS, fail, ok, skipped
from engine.measure.speed_estimate import MachineSpeed, estimate_decode_speed, machine_speed

GB = 10**9


def test_cold_reads_every_expert_and_warm_only_what_the_cache_misses():
    # A token computes through 1 GB of dense weights and 1 GB of experts at 2 GB/s (1 s), and
    # reads the experts at 1 GB/s: 1 s cold, half of it with half the experts cached.
    estimate = estimate_decode_speed(GB, GB, 0.5, MachineSpeed(1 * GB, 2 * GB))
    assert estimate.cold_tok_per_s == pytest.approx(1 / 2)
    assert estimate.warm_tok_per_s == pytest.approx(1 / 1.5)
    assert estimate_decode_speed(GB, GB, 1.0, MachineSpeed(GB, 2 * GB)).warm_tok_per_s == 1.0
    # A share past the whole (a cache larger than the experts) is the whole.
    assert estimate_decode_speed(GB, GB, 3.0, MachineSpeed(GB, 2 * GB)).hit_share == 1.0


def doctor_checks(slots_status=ok, compute_ms=50.0):
    return [
        ok(
            "exactness",
            "on-demand = resident (demo)",
            "",
            cold_bytes_per_token=60,
            resident_bytes=40,
        ),
        ok("exactness", "on-demand = resident (synthetic gpt_oss)", "", cold_bytes_per_token=1),
        slots_status("slots", "slot writes under compute", "", compute_ms=compute_ms),
        ok("disk", COLD_READS, "", bytes_per_s=1000.0),
    ]


def test_the_machine_figures_come_from_the_doctors_model_and_its_checks():
    # The demo's step computes through 100 bytes in 50 ms: 2000 bytes a second.
    assert machine_speed(doctor_checks()) == MachineSpeed(1000.0, 2000.0)
    assert machine_speed(doctor_checks(slots_status=fail)) is None
    assert machine_speed(doctor_checks(compute_ms=None)) is None
    # The doctor's model could not run resident: no figures (not a synthetic model's).
    model_skipped = skipped("exactness", "on-demand = resident (demo)", "too big")
    assert machine_speed([model_skipped, *doctor_checks()[1:]]) is None


@pytest.mark.parametrize(
    "text", ['{"disk_bytes_per_s": -1, "compute_bytes_per_s": 5}', "[]", "{", '{"date": "x"}']
)
def test_a_kept_speed_file_that_is_not_the_doctors_says_so_in_one_line(tmp_path, monkeypatch, text):
    from edge0_tui.commands.info import NO_SPEED, speed_line
    from edge0_tui.machine_speed import FILE_NAME, load_speed, save_speed
    from engine import Edge0Error, MemoryPlan

    save_speed(tmp_path, MachineSpeed(GB, 2 * GB), "demo")
    assert load_speed(tmp_path).speed == MachineSpeed(GB, 2 * GB)
    (tmp_path / FILE_NAME).write_text(text)
    with pytest.raises(Edge0Error, match=FILE_NAME):
        load_speed(tmp_path)

    monkeypatch.setenv("EDGE0_DATA_DIR", str(tmp_path))
    plan = MemoryPlan(0, GB, 0, 0, 0, 0, False, 0, 4, None, "unknown")
    line = speed_line("on-demand", plan, GB, 8)
    assert line.startswith(f"{NO_SPEED} ({tmp_path / FILE_NAME}: ") and "\n" not in line
