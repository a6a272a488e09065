"""A disk of a set bandwidth, simulated in the reader threads: `--read-limit BW --read-limit-by pacing`.

The kernel's read throttle (measure/read_limit.py) works in time slices and lets a reader that was
idle burst above its limit: an arm that reads in bursts between computing (on-demand) gets more
bandwidth from it than one that reads steadily under compute (prerouter): on the real-routing
wall the two arms were measured on what were in effect different disks (docs/notebook/2026-12-reads-under-compute.md, "The
read limit, paced"). A laptop SSD has no such credit. The pacer models one
device that transfers cold bytes at `bytes_per_s`, one transfer after another: a read cannot
finish before the device has moved its cold bytes after every earlier read's. Bytes served from
the page cache are not paced (they come from RAM). It runs on any OS and needs no privileges.
"""

from __future__ import annotations

import threading
import time


class ReadPacer:
    def __init__(self, bytes_per_s: int) -> None:
        if bytes_per_s <= 0:
            raise ValueError(f"a read bandwidth must be positive, not {bytes_per_s}")
        self.bytes_per_s = bytes_per_s
        self._lock = threading.Lock()
        self._device_free_at = 0.0  # perf_counter time when the device is done with earlier reads

    def pace(self, cold_bytes: int, began: float) -> None:
        """Hold a read that began at `began` (perf_counter) until the device would have moved its
        `cold_bytes`; a read that already took longer is not held."""
        if cold_bytes <= 0:
            return
        with self._lock:
            start = max(began, self._device_free_at)
            self._device_free_at = done = start + cold_bytes / self.bytes_per_s
        wait = done - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
