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
