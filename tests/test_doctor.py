"""`edge0 doctor`: every check ok or skipped with a reason here, and each one broken on purpose
(`engine.measure.doctor.Faults`, or the data a pure check is given) shows FAIL."""

from __future__ import annotations

import json
import os
import shutil
import sys

import mlx.core as mx
import pytest
from adapters import write_random_profile
from cli_runner import REPO, run_cli, run_process

import engine.experts.switch_glu as switch_glu
import engine.measure.doctor_exactness as doctor_exactness
import engine.runtime.loader as loader
from edge0_tui.machine_speed import load_speed, this_machine
from engine.measure import doctor_disk, doctor_machine, doctor_slots
from engine.measure.doctor import verdict
from engine.measure.doctor_checks import FAIL, OK, SKIPPED, Faults, MachineMemory, fail, ok
from engine.measure.doctor_exactness import evicting_budget

TOKENS = 16
# Every line of the report, by name (the model's line names the model).
CHECKS = {
    "device",
    "BLAS",
    "threads",
    "temp folder",
    "on-demand = resident (demo)",
    "on-demand = resident (synthetic qwen3_next)",
    "on-demand = resident (synthetic gpt_oss)",
    "on-demand = resident (synthetic deepseek_v3)",
    "prefetch = on-demand",
    "prerouter routes by its prediction",
    "fast prefill within its bound",
    "slot writes under compute",
    "cold read bandwidth",
    "fixed cost of one load",
    "F_NOCACHE reads bypass the cache",
    "memory plan",
    "memory counters",
    "Metal working set",
    "verdict",
}


@pytest.fixture(scope="module")
def tiny(checkpoint_dir):
    return checkpoint_dir("qwen3_moe")


@pytest.fixture(scope="module")
def budget(tiny):
    return evicting_budget(tiny)


# -- the command ---------------------------------------------------------------------------------


def test_the_demo_report_is_every_check_ok_or_skipped_with_no_home_path(tmp_path, monkeypatch):
    """`edge0 doctor --quick --json` on a copy of the demo inside the home folder: one JSON
    object, every check there and ok or skipped with its reason, and the home folder nowhere.
    A process of its own, as a user runs it (the entry's fast BLAS and limits): `make test`
    relies on this run, and runs no doctor of its own after the suite."""
    home = tmp_path / "home-of-someone"
    model = home / "models" / "demo"
    shutil.copytree(REPO / "assets" / "demo", model)
    monkeypatch.setenv("HOME", str(home))
    done = run_process("doctor", str(model), "--quick", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    assert str(home) not in done.stdout and "home-of-someone" not in done.stdout
    report = json.loads(done.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert set(checks) == CHECKS
    for check in report["checks"]:
        assert check["status"] in (OK, SKIPPED), check
        assert check["detail"].strip(), check  # a skipped check says why
    # This box runs Linux on the CPU: the Mac's lines are skipped, the rest ran.
    assert checks["F_NOCACHE reads bypass the cache"]["status"] == SKIPPED
    assert checks["Metal working set"]["status"] == SKIPPED
    assert checks["prerouter routes by its prediction"]["status"] == OK  # the demo has heads
    assert checks["slot writes under compute"]["figures"]["read_ahead"] > 0
    assert checks["cold read bandwidth"]["figures"]["bytes_per_s"] > 0
    assert checks["verdict"]["figures"]["overlap_limit_tok_per_s"] > 0


def test_each_check_is_one_line(tiny, private_data_dir):
    """The text report: a header, then one line per check, starting ok / FAIL / skipped (why).
    Its disk and compute figures are kept for `edge0 info --memory`'s speed estimate."""
    done = run_cli("doctor", str(tiny), "--quick")
    assert done.returncode == 0, done.stdout + done.stderr
    header, *lines = done.stdout.splitlines()
    assert header.startswith("edge0 doctor: qwen3_moe-tiny")
    assert len(lines) == len(CHECKS)
    for line in lines:
        status, rest = line.split(maxsplit=1)
        assert status in (OK, SKIPPED), line
        if status == SKIPPED:
            assert rest.endswith(")") and " (" in rest, line
    # No heads in the tiny checkpoint: the prerouter line says so.
    assert any(line.startswith("skipped  prerouter") and "train heads" in line for line in lines)
    kept = load_speed(private_data_dir)
    assert kept.model == "qwen3_moe-tiny" and kept.machine == this_machine()
    assert kept.speed.disk_bytes_per_s > 0 and kept.speed.compute_bytes_per_s > 0


def test_a_model_that_is_not_there_is_a_one_line_error(tmp_path):
    done = run_cli("doctor", str(tmp_path / "nothing"))
    assert done.returncode == 2
    assert done.stderr.startswith("edge0: error: ") and done.stderr.count("\n") == 1


# -- exactness -----------------------------------------------------------------------------------


def test_a_wrong_on_demand_token_fails(tiny, budget):
    assert doctor_exactness.check_on_demand(tiny, "tiny", TOKENS, budget).status == OK
    check = doctor_exactness.check_on_demand(tiny, "tiny", TOKENS, budget, Faults(wrong_token=True))
    assert check.status == FAIL and "token 5" in check.detail


def test_a_wrong_prefetch_token_fails(tiny, budget):
    reference = doctor_exactness.check_on_demand(tiny, "tiny", TOKENS, budget).figures["tokens"]
    good = doctor_exactness.check_prefetch(tiny, reference, TOKENS, budget)
    assert good.status == OK
    faulty = Faults(prefetch_wrong_token=True)
    check = doctor_exactness.check_prefetch(tiny, reference, TOKENS, budget, faulty)
    assert check.status == FAIL and "token 5" in check.detail


def test_a_consumer_routed_off_its_prediction_fails(tiny, tmp_path):
    model = tmp_path / "profiled"
    shutil.copytree(tiny, model)
    write_random_profile(model, 4)
    budget = evicting_budget(model)
    assert doctor_exactness.check_prerouter(model, TOKENS, budget).status == OK
    check = doctor_exactness.check_prerouter(model, TOKENS, budget, Faults(misroute=True))
    assert check.status == FAIL and "dropped" in check.detail


def test_the_fast_prefill_out_of_its_bound_fails(tiny, monkeypatch):
    """The dense prefill path on whatever BLAS this process has (as tests/test_prefill_fast.py
    does: the arithmetic is the same, only slower), then a logit pushed past the bound."""
    dense = lambda config: None if config.exact_kernels else switch_glu.DENSE_MIN_ROWS  # noqa: E731
    monkeypatch.setattr(loader, "dense_prefill_rows", dense)
    monkeypatch.setattr(doctor_exactness, "dense_prefill_rows", dense)
    assert doctor_exactness.check_fast_prefill(tiny).status == OK
    check = doctor_exactness.check_fast_prefill(tiny, Faults(prefill_drift=1e-3))
    assert check.status == FAIL and "bound" in check.detail


def test_the_fast_prefill_is_skipped_with_a_reason_where_prefill_is_exact(tiny):
    """This test process preloads no fast BLAS: prefill keeps the 4-bit kernels."""
    check = doctor_exactness.check_fast_prefill(tiny)
    assert check.status == SKIPPED and "exact 4-bit kernels" in check.detail


# -- slot writes under compute -------------------------------------------------------------------


def test_a_slot_written_while_its_layer_is_queued_fails(tiny, budget):
    good = doctor_slots.check_slot_writes(tiny, 16, budget)
    assert good.status == OK and good.figures["read_ahead"] > 0
    check = doctor_slots.check_slot_writes(tiny, 16, budget, Faults(racy_slot_write=True))
    assert check.status == FAIL and "logits differ" in check.detail


# -- the disk ------------------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="evicting a file's pages: Linux")
def test_pages_left_in_the_cache_fail_both_disk_checks(tiny):
    cold, fixed = doctor_disk.check_cold_reads(tiny)
    assert (cold.status, fixed.status) == (OK, OK), (cold, fixed)
    assert cold.figures["cold_bytes"] > 0
    cold, fixed = doctor_disk.check_cold_reads(tiny, Faults(pages_kept=True))
    assert cold.status == FAIL and "stayed in the page cache" in cold.detail
    assert fixed.status == FAIL and "were cached" in fixed.detail


def test_f_nocache_is_macos_only(tiny):
    check = doctor_disk.check_nocache(tiny)
    if sys.platform == "darwin":
        assert check.status in (OK, SKIPPED), check
    else:
        assert check.status == SKIPPED and "macOS only" in check.detail


# -- memory --------------------------------------------------------------------------------------

GiB = 1 << 30
SANE = MachineMemory(16 * GiB, 4 * GiB, 2 * GiB, "RAM")
SAME_RSS = {"engine": 100 << 20, "second source": 101 << 20}


def test_sane_counters_pass():
    assert doctor_machine.check_memory_counters(SANE, SAME_RSS).status == OK
    # And this process's own, read twice.
    rss = doctor_machine.process_rss_two_ways()
    assert doctor_machine.check_memory_counters(SANE, rss).status == OK


@pytest.mark.parametrize(
    "memory, rss, wrong",
    [
        (MachineMemory(16 * GiB, 17 * GiB, 2 * GiB, "RAM"), SAME_RSS, "used"),
        (MachineMemory(16 * GiB, 4 * GiB, -1, "RAM"), SAME_RSS, "page cache"),
        (SANE, {"engine": 100 << 20, "second source": 150 << 20}, "RSS"),
    ],
    ids=["used-over-total", "negative-page-cache", "rss-disagrees"],
)
def test_a_bad_memory_counter_fails(memory, rss, wrong):
    check = doctor_machine.check_memory_counters(memory, rss)
    assert check.status == FAIL and f"wrong: {wrong}" in check.detail


def test_a_plan_counting_on_more_than_the_machine_has_fails(tiny):
    from edge0_tui.system_memory import read_system_memory

    panel = read_system_memory()
    machine = MachineMemory(panel.total_bytes, panel.used_bytes, panel.file_cache_bytes, "RAM")
    assert doctor_machine.check_memory_plan(tiny, machine).status == OK
    small = MachineMemory(256 << 20, 0, 0, "RAM")  # a panel that reads far less than the plan's
    check = doctor_machine.check_memory_plan(tiny, small)
    assert check.status == FAIL and "counts on more than there is" in check.detail


def test_a_metal_working_set_below_the_plan_fails():
    assert doctor_machine.check_metal_memory(GiB, working_set=4 * GiB).status == OK
    check = doctor_machine.check_metal_memory(8 * GiB, working_set=4 * GiB)
    assert check.status == FAIL and "lower --expert-cache" in check.detail
    assert doctor_machine.check_metal_memory(GiB).status == (
        SKIPPED if not mx.metal.is_available() else OK
    )


# -- backend -------------------------------------------------------------------------------------


def test_a_blas_symbol_resolved_elsewhere_fails():
    here = doctor_machine.check_blas()
    assert here.status in (OK, SKIPPED), here
    check = doctor_machine.check_blas(resolved="/usr/lib/libsomeotherblas.so.3")
    assert check.status == FAIL and "libsomeotherblas" in check.detail


def test_a_gpu_left_unused_fails():
    assert doctor_machine.check_device().status == OK
    check = doctor_machine.check_device(mx.Device(mx.cpu), {"Metal": True, "CUDA": False})
    assert check.status == FAIL and "does not use it" in check.detail


def test_the_thread_layout_is_reported():
    check = doctor_machine.check_threads()
    assert check.status == OK and check.figures["reader_threads"] >= 1


def test_a_missing_temp_folder_is_one_fail_and_the_engine_checks_are_not_run(tiny, monkeypatch):
    """Issue 47 item 12: with TMPDIR=/nonexistent, MLX's kernels could not be compiled and every
    exactness check FAILed with `temp_directory_path`, blaming the engine for the environment."""
    monkeypatch.setenv("TMPDIR", "/nonexistent")
    done = run_cli("doctor", str(tiny), "--quick")
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()[1:]
    failed = [line for line in lines if line.startswith("FAIL")]
    assert failed[0] == (
        "FAIL     temp folder: /nonexistent (TMPDIR): no such directory; set TMPDIR to a folder "
        "you can write"
    )
    assert failed[1:] == [
        "FAIL     verdict: 1 check failed (temp folder): fix what its line says, then run "
        "`edge0 doctor` again"
    ]
    not_run = [line for line in lines if line.endswith("(not run: the temp folder check failed)")]
    assert len(not_run) == 8  # the seven exactness lines and the slot writes
    assert "temp_directory_path" not in done.stdout


def test_a_full_disk_is_the_temp_folders_fail(tmp_path, monkeypatch):
    assert doctor_machine.check_temp_folder(str(tmp_path), "TMPDIR").status == OK
    monkeypatch.setattr(doctor_machine, "free_bytes", lambda folder: 1 << 20)
    check = doctor_machine.check_temp_folder(str(tmp_path), "TMPDIR")
    assert check.status == FAIL and "1.00 MiB free, the checks write up to" in check.detail
    (tmp_path / "file").touch()
    check = doctor_machine.check_temp_folder(str(tmp_path / "file"), "TMP")
    assert check.status == FAIL and "(TMP): not a directory" in check.detail


# -- verdict -------------------------------------------------------------------------------------


def test_the_verdict_fails_when_any_check_failed():
    figures = ({"compute_ms": 20.0}, {"bytes_per_s": 100e6}, {"cold_bytes_per_token": 2e6})
    good = verdict([ok("disk", "a", "fine")], *figures)
    assert good.status == OK
    # Compute 20 ms, reads 2 MB at 100 MB/s = 20 ms: on-demand 25 tok/s, the overlap limit 50.
    assert good.figures["on_demand_cold_tok_per_s"] == pytest.approx(25.0)
    assert good.figures["overlap_limit_tok_per_s"] == pytest.approx(50.0)
    bad = verdict([ok("disk", "a", "fine"), fail("slots", "b", "broken")], *figures)
    assert bad.status == FAIL and "b" in bad.figures["failed"]


def test_where_pages_cannot_be_dropped_the_disk_lines_say_why(tiny, monkeypatch):
    """The macOS path (msync(MS_INVALIDATE), F_NOCACHE descriptors) runs here too; Linux's msync
    drops no page, so mincore finds them cached and both lines are skipped, saying so."""
    monkeypatch.setattr(doctor_disk, "CAN_EVICT_RANGES", False)
    doctor_disk.check_cold_reads(tiny)  # (the pages are in the cache after a first pass)
    cold, fixed = doctor_disk.check_cold_reads(tiny)
    assert cold.status == SKIPPED and "msync(MS_INVALIDATE)" in cold.detail
    assert fixed.status == SKIPPED and "purge" in fixed.detail
