"""mlx-lm under a low open-file limit.

mlx_lm.utils, when imported, sets RLIMIT_NOFILE to (2048, 4096); under a hard limit below 4096
(`ulimit -n 256`) that is "not allowed to raise maximum limit" and every command that loads a
model died in the import. What it wants is more descriptors; the most it can have is the hard
limit. Only then, and only while mlx_lm.utils runs, its request is cut to the hard limit.

No MLX import here: this runs before anything imports mlx_lm.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

_MLX_LM_WANTS_HARD = 4096


class _OpenFileLimitFinder(importlib.abc.MetaPathFinder):
    """Finds mlx_lm.utils as usual, and runs it with `resource.setrlimit` cut to the limits."""

    def find_spec(self, name, path, target=None):
        if name != "mlx_lm.utils":
            return None
        sys.meta_path.remove(self)  # once: the real finders locate it
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _WithinLimitLoader(spec.loader)
        return spec


class _WithinLimitLoader(importlib.abc.Loader):
    def __init__(self, loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        import resource

        real = resource.setrlimit

        def within_hard_limit(which: int, limits: tuple[int, int]) -> None:
            try:
                return real(which, limits)
            except ValueError:  # above the hard limit, without the privilege to raise it
                if which != resource.RLIMIT_NOFILE:
                    raise
            _, hard = resource.getrlimit(which)
            soft = limits[0] if hard == resource.RLIM_INFINITY else min(limits[0], hard)
            try:
                real(which, (soft, hard))
            except ValueError:  # a soft limit it cannot have either: keep what there is
                pass

        resource.setrlimit = within_hard_limit
        try:
            self.loader.exec_module(module)
        finally:
            resource.setrlimit = real


def fit_mlx_lm_to_the_open_file_limit() -> None:
    """Where the hard open-file limit is below what mlx_lm.utils asks for, make its request fit
    (once, before mlx_lm.utils is first imported). Every process edge0 starts calls this first:
    the `edge0` command and the engine's own child processes; importing the engine does not."""
    try:
        import resource
    except ImportError:  # not a POSIX system: no such limit
        return
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = hard != resource.RLIM_INFINITY and hard < _MLX_LM_WANTS_HARD
    placed = any(isinstance(finder, _OpenFileLimitFinder) for finder in sys.meta_path)
    if low and "mlx_lm.utils" not in sys.modules and not placed:
        sys.meta_path.insert(0, _OpenFileLimitFinder())
