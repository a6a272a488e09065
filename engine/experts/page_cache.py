"""What of a file sits in the OS page cache, and how to evict it.

`FileResidency` maps a file once with PROT_READ (touching no page, so causing no fault) and asks
`mincore` which pages of any byte range are resident. This is how edge0 tells cold reads (from the
disk) from warm ones (from RAM), and how much of a checkpoint the OS is caching.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
from pathlib import Path

PAGE_SIZE = mmap.PAGESIZE

# The C library (mincore, mmap; the store also asks it for malloc_trim where it is glibc).
LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
LIBC.mmap.restype = ctypes.c_void_p
LIBC.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value
# mincore sets bit 0 of a page's byte when it is resident; the other bits are reserved.
_LOW_BIT = bytes(b & 1 for b in range(256))


class FileResidency:
    """Answers "how many bytes of [offset, offset+length) are in the page cache?" for one file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.size = os.path.getsize(self.path)
        self._addr = None
        if self.size == 0:
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            addr = LIBC.mmap(None, self.size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        finally:
            os.close(fd)
        if addr in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap failed for {self.path}")
        self._addr = addr

    def resident_bytes(self, offset: int, length: int) -> int:
        """Bytes of the range whose pages are resident (partial edge pages count their overlap).

        Safe from any thread: each call has its own page vector (reader threads ask at once, and
        ctypes releases the GIL during `mincore`)."""
        if self._addr is None or length <= 0:
            return 0
        first = offset // PAGE_SIZE
        last = (offset + length - 1) // PAGE_SIZE
        npages = last - first + 1
        start = first * PAGE_SIZE
        span = min(npages * PAGE_SIZE, self.size - start)
        vector = (ctypes.c_ubyte * npages)()
        if LIBC.mincore(self._addr + start, span, vector) != 0:
            raise OSError(ctypes.get_errno(), f"mincore failed for {self.path}")
        pages = bytes(vector).translate(_LOW_BIT)  # 1 per resident page, 0 otherwise
        resident = pages.count(1) * PAGE_SIZE
        # The range rarely starts or ends on a page boundary: count only its part of the edge pages.
        if pages[0]:
            resident -= offset - start
        if pages[-1]:
            resident -= (last + 1) * PAGE_SIZE - (offset + length)
        return resident

    def close(self) -> None:
        if self._addr is not None:
            LIBC.munmap(self._addr, self.size)
            self._addr = None

    def __del__(self) -> None:
        self.close()


def evict_file(path: str | Path) -> None:
    """Drop a file's pages from the page cache (fsync first: dirty pages are not dropped)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        elif sys.platform == "darwin":  # macOS: F_NOCACHE stops caching, purge needs root
            raise OSError("evicting one file's pages is not supported on macOS; run `sudo purge`")
    finally:
        os.close(fd)
