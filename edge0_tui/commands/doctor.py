"""`edge0 doctor`: prove on this machine that edge0 is exact and sound, one line a check.

The checks are the engine's (`engine.measure.doctor`); this module reads the memory panel's
counters (the engine does not import the app), prints each check's line as it is known and
writes the `--json` report with the user's home folder shown as ~. Exit status 1 when a check
FAILs."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from edge0_tui.commands.common import edge0_version, print_stderr

NAME = "doctor"
HELP = "check that edge0 is exact and sound on this machine (run it first on a Mac)"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        NAME,
        help=HELP,
        description=(
            "Each check prints one line: ok, FAIL, or skipped (why): exactness of the streamed "
            "modes, slot writes under compute, the disk, memory, the backend, and a verdict with "
            "the decode speed to expect. Under a minute on the demo. Exit status 1 when a check "
            "fails: attach the --json report to an issue."
        ),
    )
    parser.add_argument(
        "model",
        nargs="?",
        default="demo",
        help="checkpoint directory, Hugging Face repo id, or demo (the default)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="one JSON object to attach to an issue (no paths of your home folder in it)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a shorter slot-write stress run (32 steps instead of 200); every check still runs",
    )


def run(args: argparse.Namespace) -> int:
    from platformdirs import user_cache_path

    from edge0_tui.model_source import check_model, resolve_model
    from edge0_tui.system_memory import read_system_memory
    from engine.measure.doctor import DoctorConfig, MachineMemory, report_dict, run_doctor

    check_model(args.model)

    def on_progress(what: str, done: float, total: float | None) -> None:
        if sys.stderr.isatty():
            print(f"\r\x1b[2Kedge0: {what}", end="", file=sys.stderr, flush=True)

    source = resolve_model(args.model, user_cache_path("edge0"), on_progress)
    panel = read_system_memory()
    memory = MachineMemory(
        panel.total_bytes, panel.used_bytes, panel.file_cache_bytes, panel.source
    )
    config = DoctorConfig(source.path, source.name, quick=args.quick)
    started = time.perf_counter()
    if not args.json:
        print(f"edge0 doctor: {home_as_tilde(source.name)} on {platform.platform()}", flush=True)
    checks = run_doctor(
        config, memory, lambda c: None if args.json else print(c.line(), flush=True)
    )
    seconds = time.perf_counter() - started
    keep_speed(checks, source.name)
    if args.json:
        header = {
            "edge0": edge0_version(),
            "model": source.name,
            "platform": platform.platform(),
            "python": platform.python_version(),
            "quick": args.quick,
            "seconds": round(seconds, 1),
        }
        print(json.dumps(without_home(report_dict(checks, header))))
    else:
        print_stderr(f"edge0 doctor: {seconds:.0f} s")
    return 1 if any(c.status == "FAIL" for c in checks) else 0


def keep_speed(checks: list, model: str) -> None:
    """Keep the run's disk and compute figures for `edge0 info --memory`'s speed estimate (a
    warning on stderr, not a failed doctor, when they cannot be kept)."""
    from platformdirs import user_data_path

    from edge0_tui.commands import options
    from edge0_tui.machine_speed import save_speed
    from engine import Edge0Error
    from engine.measure.speed_estimate import machine_speed

    speed = machine_speed(checks)
    if speed is None:
        return
    try:
        save_speed(options.data_dir() or user_data_path("edge0"), speed, home_as_tilde(model))
    except Edge0Error as e:
        print_stderr(f"edge0 doctor: the speed figures were not kept: {e}")


def home_as_tilde(text: str) -> str:
    """`text` with the user's home folder written ~ (a report pasted into an issue)."""
    home = str(Path.home())
    return text.replace(home, "~") if len(home) > 1 else text


def without_home(value: object) -> object:
    """Every string in a JSON value with the home folder written ~."""
    if isinstance(value, str):
        return home_as_tilde(value)
    if isinstance(value, dict):
        return {home_as_tilde(str(k)): without_home(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [without_home(v) for v in value]
    return value
