"""Counting the host's waits on the device from outside the engine.

The engine counts its own reads (`engine.host_reads`); this census checks that count without
trusting it. While active it wraps `mx.eval`, `mx.synchronize`, `mx.array.item`, `.tolist` and
`.__array__`, and `np.array` / `np.asarray`, and counts on one thread (the engine's):
- every `mx.eval` and `mx.synchronize`;
- every `item`, `tolist` or NumPy conversion of an array that no `mx.eval` on that thread was
  given, i.e. one that may not be evaluated yet (a conversion of an evaluated array is free).
Each count keeps the caller's file and line, so a report says where the waits are.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

_ENGINE_ROOT = str(Path(__file__).resolve().parents[1])
# Frames that wait on behalf of another: the census itself, and the engine's counted place.
_NOT_ASKERS = ("host_read_census.py", "host_reads.py")


class HostReadCensus:
    def __init__(self, thread: threading.Thread | None = None) -> None:
        self.thread_id = (thread or threading.current_thread()).ident
        self.count = 0
        self.where: Counter[str] = Counter()  # "file.py:line" of the engine code that waited
        # id -> a weak reference to an array given to `mx.eval` (arrays compare elementwise, so
        # no set of them; the reference tells a reused id from the array itself).
        self._evaluated: dict[int, weakref.ref] = {}

    def take(self) -> int:
        """The waits since the last call."""
        count, self.count = self.count, 0
        return count

    def _mine(self) -> bool:
        return threading.get_ident() == self.thread_id

    def _counted(self) -> None:
        self.count += 1
        self.where[_engine_caller()] += 1

    def _on_eval(self, arrays) -> None:
        if not self._mine():
            return
        for _, value in tree_flatten(list(arrays)):
            if isinstance(value, mx.array):
                self._evaluated[id(value)] = weakref.ref(value)
        self._counted()

    def _on_read(self, array) -> None:
        if not self._mine() or not isinstance(array, mx.array):
            return
        known = self._evaluated.get(id(array))
        if known is None or known() is not array:
            self._counted()


def _engine_caller() -> str:
    """The innermost frame in the engine's own code (not this file): where the wait was asked."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_ENGINE_ROOT) and not name.endswith(_NOT_ASKERS):
            return f"{Path(name).relative_to(_ENGINE_ROOT)}:{frame.f_lineno}"
        frame = frame.f_back
    return "outside the engine"


@contextmanager
def census(thread: threading.Thread | None = None):
    """Count host waits on `thread` (default: the calling one) while the block runs."""
    counter = HostReadCensus(thread)
    originals = {
        "eval": mx.eval,
        "synchronize": mx.synchronize,
        "item": mx.array.item,
        "tolist": mx.array.tolist,
        "__array__": mx.array.__array__,
        "np.array": np.array,
        "np.asarray": np.asarray,
    }

    def eval_(*args):
        counter._on_eval(args)
        return originals["eval"](*args)

    def synchronize(*args, **kwargs):
        if counter._mine():
            counter._counted()
        return originals["synchronize"](*args, **kwargs)

    def method(name):
        def read(self, *args, **kwargs):
            counter._on_read(self)
            return originals[name](self, *args, **kwargs)

        return read

    def conversion(name):
        def convert(obj, *args, **kwargs):
            counter._on_read(obj)
            return originals[name](obj, *args, **kwargs)

        return convert

    mx.eval, mx.synchronize = eval_, synchronize
    mx.array.item, mx.array.tolist = method("item"), method("tolist")
    mx.array.__array__ = method("__array__")
    np.array, np.asarray = conversion("np.array"), conversion("np.asarray")
    try:
        yield counter
    finally:
        mx.eval, mx.synchronize = originals["eval"], originals["synchronize"]
        mx.array.item, mx.array.tolist = originals["item"], originals["tolist"]
        mx.array.__array__ = originals["__array__"]
        np.array, np.asarray = originals["np.array"], originals["np.asarray"]
