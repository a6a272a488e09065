"""Giving freed buffers back to the operating system."""

from __future__ import annotations

import mlx.core as mx

from .page_cache import LIBC


def release_freed_memory() -> None:
    """Hand freed buffers back to the OS: MLX's buffer cache, then glibc's heap, which keeps what
    reader threads freed in their arenas (after a prompt read as whole layers, most of the
    process's resident size can be such freed buffers). Other C libraries (macOS, musl) have no
    `malloc_trim`."""
    mx.clear_cache()
    if hasattr(LIBC, "malloc_trim"):
        LIBC.malloc_trim(0)


# mallopt's parameter number for the mmap threshold (<malloc.h>).
_M_MMAP_THRESHOLD = -3


def return_large_frees_to_os(threshold_bytes: int = 1 << 20) -> bool:
    """Make glibc serve every allocation of `threshold_bytes` or more with its own mmap, so that
    freeing it gives the memory back to the OS at once. By default glibc raises its mmap
    threshold to the size of each such block freed (up to 32 MiB): after the first expert-sized
    buffer is freed, later ones come from the arenas of the threads that made them, which keep
    what is freed. A process that reads whole layers on several reader threads then grows by
    layers of freed buffers between `malloc_trim`s, outside MLX's count and outside any plan.
    Setting the threshold explicitly turns that adjustment off. Process-wide; False where the C
    library has no `mallopt` (macOS, musl), whose allocators return large blocks themselves."""
    mallopt = getattr(LIBC, "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold_bytes))
