"""The speed figures `edge0 doctor` measured on this machine, kept for `edge0 info --memory`'s
estimate of a model's decode speed (`engine.measure.speed_estimate`).

One small JSON file in edge0's data folder (`machine_speed.json`): the disk's cold read
bandwidth, the compute rate, the date and the machine they were measured on, and the model the
doctor ran. Each doctor run replaces it. Like every file, it is read as hostile: one that is not
this shape is no figures (the estimate then says to run the doctor), never a traceback.
"""

from __future__ import annotations

import datetime
import math
import platform
from dataclasses import dataclass
from pathlib import Path

from engine import Edge0Error, read_json_file, write_json_file
from engine.measure.speed_estimate import MachineSpeed

from .sanitize import escape_controls

FILE_NAME = "machine_speed.json"
MAX_FILE_BYTES = 64 << 10


@dataclass(frozen=True)
class MeasuredSpeed:
    speed: MachineSpeed
    date: str  # ISO date of the doctor run
    machine: str  # the host's name, as the doctor run found it
    model: str  # the model the doctor ran


def this_machine() -> str:
    return platform.node() or "this machine"


def save_speed(folder: Path, speed: MachineSpeed, model: str) -> Path:
    """Keep `speed` (from a doctor run of `model`) in `folder`; Edge0Error when it cannot."""
    path = folder / FILE_NAME
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise Edge0Error(f"{folder}: cannot create it ({e.strerror or e})") from None
    record = {
        "date": datetime.date.today().isoformat(),
        "machine": this_machine(),
        "model": model,
        "disk_bytes_per_s": speed.disk_bytes_per_s,
        "compute_bytes_per_s": speed.compute_bytes_per_s,
    }
    write_json_file(path, record, MAX_FILE_BYTES, "the doctor's speed figures")
    return path


def load_speed(folder: Path) -> MeasuredSpeed | None:
    """The figures kept in `folder`; None when the doctor has not run. Edge0Error naming the
    file when it is not what `save_speed` writes."""
    path = folder / FILE_NAME
    if not path.exists():
        return None
    record = read_json_file(path, max_bytes=MAX_FILE_BYTES)
    rates = [record.get(key) if isinstance(record, dict) else None for key in _RATES]
    if not all(_positive(rate) for rate in rates):
        raise Edge0Error(f"{path}: not the doctor's speed figures")
    texts = [
        escape_controls(str(record.get(key, "?"))[:100], keep_newlines=False)
        for key in ("date", "machine", "model")
    ]
    return MeasuredSpeed(MachineSpeed(*rates), *texts)


_RATES = ("disk_bytes_per_s", "compute_bytes_per_s")


def _positive(value: object) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and value > 0
