"""Where a command will write, checked before the work that produces it.

A training run, a bench or a synth that finds out at the end that its output cannot be written
has wasted the run (and printed a traceback). These checks run first: an output file is not a
folder and its folder can take a new file; an output folder is a folder (or can be made) and
takes a new file; a file that will be filled has its bytes reserved on disk, so a full disk is
an error at the start, not a SIGBUS in a memory-mapped write.

Writability is tested by making (and removing) a file, not with `os.access`: root passes every
permission check but not a read-only mount, and ACLs or quotas are only seen by trying.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

from ..config import format_bytes
from ..errors import Edge0Error

PROBE_PREFIX = ".edge0-probe-"


def check_output_file(path: Path, what: str = "the output") -> None:
    """Refuse an output file path that cannot be written: a folder, or in a folder that cannot
    take a new file (read-only, not a folder, not permitted). A missing folder is fine when the
    nearest existing one above it can take it (the command makes it)."""
    path = Path(path)
    if path.is_dir():
        raise Edge0Error(f"{path}: a directory: cannot write {what} there (name a file)")
    _check_can_create(path.parent, path, what)


def check_output_folder(folder: Path, what: str = "the output") -> None:
    """Refuse an output folder that is a file (or under one), or cannot take a new file."""
    folder = Path(folder)
    if os.path.lexists(folder) and not folder.is_dir():
        raise Edge0Error(f"{folder}: not a directory: cannot write {what} there")
    _check_can_create(folder, folder, what)


def _check_can_create(folder: Path, named: Path, what: str) -> None:
    existing = _nearest_existing(folder)
    if not existing.is_dir():
        raise Edge0Error(f"{named}: cannot write {what} ({existing} is not a directory)")
    try:
        fd, probe = tempfile.mkstemp(prefix=PROBE_PREFIX, dir=existing)
    except OSError as e:
        reason = e.strerror or str(e)
        where = "" if existing == Path(os.path.abspath(named)) else f" ({existing})"
        raise Edge0Error(f"{named}: cannot write {what}{where}: {reason}") from None
    os.close(fd)
    os.unlink(probe)


def _nearest_existing(folder: Path) -> Path:
    """`folder`, or the nearest folder above it that exists (what `mkdir -p` would start from)."""
    folder = Path(os.path.abspath(folder)) if not folder.is_absolute() else folder
    while not os.path.lexists(folder) and folder != folder.parent:
        folder = folder.parent
    return folder


def check_free_space(folder: Path, needed: int, what: str) -> None:
    """Refuse when the file system of `folder` has fewer than `needed` bytes free."""
    try:
        free = shutil.disk_usage(_nearest_existing(Path(folder))).free
    except OSError:
        return  # no figure to check against: the write itself will say
    if needed > free:
        raise Edge0Error(
            f"{folder}: not enough disk space for {what}: needs {format_bytes(needed)}, "
            f"{format_bytes(free)} free"
        )


def reserve(path: Path, size: int, what: str) -> None:
    """Allocate `size` bytes of the existing file `path` on disk now. A sparse file that is
    memory-mapped and then written on a full disk kills the process with SIGBUS (no error, no
    message); with its blocks reserved, the full disk is an Edge0Error here instead."""
    allocate = getattr(os, "posix_fallocate", None)
    if allocate is None:  # macOS: no fallocate; the caller's free-space check is what there is
        return
    fd = os.open(path, os.O_RDWR)
    try:
        allocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system without it: checked free
            return
        raise Edge0Error(
            f"{path}: cannot reserve {format_bytes(size)} for {what} ({e.strerror})"
        ) from None
    finally:
        os.close(fd)
