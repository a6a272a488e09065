""" "Peak RSS" is the kernel's high-water mark of the process, never a maximum of samples.

A child's kernel figure is read with `os.wait4` from a small trampoline process: the parent's own
ru_maxrss would not do, because Linux counts in a child's the memory of the image it had before
exec, a copy of its parent's (the test runner's, hundreds of MiB).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from engine.runtime.metrics import (
    process_lifetime_peaks,
    process_peak_rss_bytes,
    process_rss_bytes,
    reset_process_peak_rss,
)

MIB = 2**20
TRANSIENT_BYTES = 400 * MIB  # well above what importing MLX and loading the tiny model hold

# Runs argv[1:] and prints its stdout, exit status and kernel max RSS (bytes) as one JSON object.
TRAMPOLINE = textwrap.dedent(
    """
    import json, os, subprocess, sys
    child = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = child.stdout.read(), child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    print(json.dumps({"stdout": out.decode(), "stderr": err.decode(),
                      "status": child.returncode, "max_rss_bytes": usage.ru_maxrss * scale}))
    """
)

ALLOCATE_AND_FREE = textwrap.dedent(
    f"""
    import json
    import numpy as np
    from engine.runtime.metrics import process_peak_rss_bytes, process_rss_bytes
    block = np.ones({200 * MIB // 8})  # written: every page resident
    del block
    print(json.dumps({{"peak": process_peak_rss_bytes(), "rss": process_rss_bytes()}}))
    """
)


def cli_holding_a_transient(nbytes: int) -> str:
    """A `python -c` script: `edge0 ARGS` whose engine holds `nbytes` for a moment inside each
    prompt's prefill, between two of its per-step samples: only the kernel's high-water mark
    sees it."""
    return textwrap.dedent(
        f"""
        import sys
        import numpy as np
        from engine.runtime.decode import Decoder
        from edge0_tui.cli import main

        build = Decoder.build

        def build_holding_a_transient(self, tokens, phase, *args, **kwargs):
            if phase == "prefill" and not self.steps:  # a reply's first forward
                block = np.ones({nbytes // 8})
                del block
            return build(self, tokens, phase, *args, **kwargs)

        Decoder.build = build_holding_a_transient
        sys.exit(main(sys.argv[1:]))
        """
    )


GENERATE_WITH_A_TRANSIENT = cli_holding_a_transient(TRANSIENT_BYTES)


def run_measured(*argv: str) -> dict:
    """Run argv under the trampoline: its stdout, stderr, status and the kernel's max RSS."""
    done = subprocess.run(
        [sys.executable, "-c", TRAMPOLINE, *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_peak_is_the_kernels_max_rss_of_the_process():
    measured = run_measured(sys.executable, "-c", ALLOCATE_AND_FREE)
    assert measured["status"] == 0, measured["stderr"]
    reported = json.loads(measured["stdout"])
    kernel = measured["max_rss_bytes"]
    assert abs(reported["peak"] - kernel) <= 0.1 * kernel, (reported, kernel)
    # The array was freed: the RSS now is far below, the peak still holds it.
    assert reported["peak"] >= reported["rss"] + 150 * MIB, reported


NO_CLEAR_REFS = (
    "this system has no writable /proc/self/clear_refs (not Linux, or a sandbox): the peak is the "
    "process's lifetime peak and cannot be reset"
)


def test_reset_brings_the_peak_down_to_the_current_rss():
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip(reason=NO_CLEAR_REFS)
    block = np.ones(200 * MIB // 8)
    del block
    before = process_peak_rss_bytes()
    assert before >= process_rss_bytes() + 150 * MIB
    assert reset_process_peak_rss() is True
    after, rss = process_peak_rss_bytes(), process_rss_bytes()
    assert rss <= after <= rss + 16 * MIB, (after, rss)
    # A report over the whole process still sees the peak from before the reset.
    assert process_lifetime_peaks()["peak_rss_bytes"] >= before


def test_generate_json_reports_the_kernels_peak_of_the_request(checkpoint_dir):
    model = checkpoint_dir("qwen3_moe")
    measured = run_measured(
        sys.executable,
        "-c",
        GENERATE_WITH_A_TRANSIENT,
        "generate",
        str(model),
        "--prompt",
        "def main():",
        "--max-tokens",
        "4",
        "--json",
    )
    assert measured["status"] == 0, measured["stderr"]
    summary = json.loads(measured["stdout"])["summary"]
    kernel = measured["max_rss_bytes"]
    assert abs(summary["peak_rss_bytes"] - kernel) <= 0.1 * kernel, (summary, kernel)
    assert summary["peak_rss_bytes"] >= TRANSIENT_BYTES
    expected_scope = "request" if os.access("/proc/self/clear_refs", os.W_OK) else "process"
    assert summary["peak_rss_scope"] == expected_scope
    # The per-step RSS samples are current values: the transient fell between them.
    steps = json.loads(measured["stdout"])["steps"]
    assert max(s["rss_bytes"] for s in steps) < kernel - TRANSIENT_BYTES // 2
