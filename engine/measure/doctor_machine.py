"""The doctor's machine checks: backend (MLX, device, BLAS, threads, the temp folder) and memory
(the plan, the panel's counters, Metal's working set)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

from ..config import EngineConfig, format_bytes
from ..experts.reader_core import reader_cores
from ..runtime.blas import blas_in_use
from ..runtime.generation import Engine
from ..runtime.metrics import metal_wired_limit_bytes, process_rss_bytes
from .doctor_checks import Check, MachineMemory, fail, ok, skipped

# The process's RSS read two ways may differ by this share (they are read a moment apart).
RSS_AGREEMENT = 0.10
# The BLAS symbol MLX's dense products call.
GEMM_SYMBOL = "cblas_sgemm"
# What the checks write to the temp folder (the synthetic checkpoints, MLX's compiled kernels),
# with room to spare: a folder with less free is a full disk to them.
TEMP_BYTES_NEEDED = 64 << 20
# The variables C++'s `std::filesystem::temp_directory_path` reads, in its order (MLX compiles
# kernels into that folder on the CPU); with none set it is /tmp.
TEMP_VARIABLES = ("TMPDIR", "TMP", "TEMP", "TEMPDIR")


# -- backend ---------------------------------------------------------------------------------------


def backend_checks() -> list[Check]:
    return [check_device(), check_blas(), check_threads()]


def _gpu_backends() -> dict[str, bool]:
    def available(module: str) -> bool:
        try:
            return bool(getattr(mx, module).is_available())
        except (AttributeError, RuntimeError):
            return False

    return {"Metal": available("metal"), "CUDA": available("cuda")}


def check_device(device: mx.Device | None = None, gpus: dict[str, bool] | None = None) -> Check:
    """MLX's version and the device it computes on: a GPU wherever MLX has one here. (`device`
    and `gpus`: what MLX reports, unless given: tests give a GPU left unused.)"""
    device = device or mx.default_device()
    gpus = gpus if gpus is not None else _gpu_backends()
    have = [name for name, yes in gpus.items() if yes]
    on = "GPU" if device.type == mx.DeviceType.gpu else "CPU"
    detail = f"MLX {mx.__version__}, computing on the {on} ({', '.join(have) or 'no GPU backend'})"
    figures = {"mlx": mx.__version__, "device": str(device), **gpus}
    if have and on == "CPU":
        return fail(
            "backend", "device", f"{detail}: a GPU is there but MLX does not use it", **figures
        )
    return ok("backend", "device", detail, **figures)


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def gemm_library() -> str | None:
    """The file whose `cblas_sgemm` MLX's calls bind to, by the dynamic linker's rule: the global
    scope first (the program, LD_PRELOAD, libraries loaded RTLD_GLOBAL), then MLX's library and
    its own dependencies. None when it cannot be told (no MLX library found, no symbol)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        address = _symbol(ctypes.CDLL(None), GEMM_SYMBOL)
        if address is None and (mlx_library := _mlx_library()) is not None:
            loaded = ctypes.CDLL(mlx_library, mode=getattr(os, "RTLD_NOLOAD", 0))
            address = _symbol(loaded, GEMM_SYMBOL)
    except OSError:  # MLX's library not loaded under that name
        return None
    if address is None:
        return None
    info = _DlInfo()
    libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    if not libc.dladdr(ctypes.c_void_p(address), ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.fsdecode(info.dli_fname)


def _symbol(library: ctypes.CDLL, name: str) -> int | None:
    try:
        return ctypes.cast(getattr(library, name), ctypes.c_void_p).value
    except AttributeError:
        return None


def _mlx_library() -> str | None:
    """MLX's own shared library as this process mapped it."""
    folder = Path(mx.__file__).parent
    for name in ("lib/libmlx.so", "lib/libmlx.dylib"):
        if (folder / name).exists():
            return str(folder / name)
    return None


def temp_folder() -> tuple[str, str]:
    """The folder MLX's compiled kernels go to, and what names it (a variable, or the default)."""
    for name in TEMP_VARIABLES:
        value = os.environ.get(name)
        if value is not None:
            return value, name
    return "/tmp", "the default"


def free_bytes(folder: str) -> int | None:
    """The bytes free on `folder`'s file system; None when it cannot be told."""
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def check_temp_folder(folder: str, named_by: str) -> Check:
    """The temp folder is a folder, takes a file and has room for what the checks write. Run
    before them: without it they fail inside MLX, which would blame the engine for this."""
    title, where = "temp folder", f"{folder or repr(folder)} ({named_by})"
    if not os.path.isdir(folder):
        what = "not a directory" if os.path.exists(folder) else "no such directory"
        return fail("backend", title, f"{where}: {what}; set TMPDIR to a folder you can write")
    try:
        fd, probe = tempfile.mkstemp(prefix=".edge0-doctor-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return fail("backend", title, f"{where}: cannot write a file there ({e.strerror or e})")
    free = free_bytes(folder)
    if free is not None and free < TEMP_BYTES_NEEDED:
        return fail(
            "backend",
            title,
            f"{where}: {format_bytes(free)} free, the checks write up to "
            f"{format_bytes(TEMP_BYTES_NEEDED)}; free some space, or set TMPDIR to another disk",
            free_bytes=free,
        )
    room = "free space unknown" if free is None else f"{format_bytes(free)} free"
    return ok("backend", title, f"{where}: writable, {room}", free_bytes=free)


def check_blas(resolved: str | None = None) -> Check:
    """The BLAS in use, by the symbol MLX's products resolve to (not only a library mapped):
    it must be the one `blas_in_use` reports. `resolved`: the library found (tests give one)."""
    blas = blas_in_use()
    resolved = resolved if resolved is not None else gemm_library()
    figures = {
        "blas": blas.name,
        "fast": blas.fast,
        "resolved": Path(resolved).name if resolved else None,
    }
    if resolved is None:
        return skipped(
            "backend", "BLAS", f"{blas.describe()}; {GEMM_SYMBOL} could not be resolved here"
        )
    detail = f"{blas.describe()}; {GEMM_SYMBOL} resolves to {Path(resolved).name}"
    mapped = blas.library
    agrees = (
        "Accelerate" in resolved or "vecLib" in resolved
        if blas.name == "Accelerate"
        else mapped is not None and os.path.realpath(mapped) == os.path.realpath(resolved)
    )
    if not agrees:
        return fail(
            "backend", "BLAS", f"{detail}, not the {blas.name} edge0 reports ({mapped})", **figures
        )
    return ok("backend", "BLAS", detail, **figures)


def check_threads() -> Check:
    """The thread layout: reader threads, and in prerouter mode the core they have to themselves."""
    threads = EngineConfig().reader_threads
    cores = reader_cores()
    if cores is None:
        why = (
            "a GPU computes"
            if mx.default_device().type == mx.DeviceType.gpu
            else (
                "no thread affinity on this platform"
                if not hasattr(os, "sched_setaffinity")
                else "fewer than two cores"
            )
        )
        layout = f"not pinned ({why})"
    else:
        compute, reader = cores
        layout = f"prerouter pins them to core {sorted(reader)}, compute to cores {sorted(compute)}"
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return ok(
        "backend",
        "threads",
        f"{threads} expert reader threads, {usable} usable cores; {layout}",
        reader_threads=threads,
        cores=usable,
    )


# -- memory ----------------------------------------------------------------------------------------


def check_memory_plan(model_dir: Path, machine: MachineMemory) -> Check:
    """The plan of a run with chat's defaults (prefetch, the expert cache the plan leaves) fits,
    and what it may hold is no more than the machine the panel reads."""
    config = EngineConfig(mode="prefetch", expert_cache_auto=True, refuse_over_plan=False)
    with Engine(model_dir, config) as engine:
        plan = engine.memory_plan
    figures = {"total_bytes": plan.total_bytes, "limit_bytes": plan.limit_bytes}
    limit = plan.limit_bytes
    detail = (
        f"{format_bytes(plan.total_bytes)} planned (expert cache {format_bytes(plan.expert_cache_bytes)}) "
        f"of {format_bytes(limit or 0)} ({plan.limit_source}); the panel reads "
        f"{format_bytes(machine.total_bytes)} ({machine.source})"
    )
    if limit is None:
        return skipped("memory", "memory plan", "the machine's memory is unknown here", **figures)
    if not plan.fits:
        return fail("memory", "memory plan", f"{detail}: it does not fit", **figures)
    if limit > machine.total_bytes * (1 + RSS_AGREEMENT):
        return fail(
            "memory", "memory plan", f"{detail}: the plan counts on more than there is", **figures
        )
    return ok("memory", "memory plan", detail, **figures)


def process_rss_two_ways() -> dict[str, int | None]:
    """This process's RSS from the source the engine reports (/proc/self/statm on Linux,
    proc_pidinfo on macOS) and from another one (/proc/self/status's VmRSS; `ps` on macOS)."""
    second = None
    try:
        with open("/proc/self/status") as f:
            line = next((line for line in f if line.startswith("VmRSS:")), None)
        second = int(line.split()[1]) * 1024 if line else None
    except OSError:
        if sys.platform == "darwin":
            try:
                out = subprocess.run(
                    ["/bin/ps", "-o", "rss=", "-p", str(os.getpid())],
                    capture_output=True,
                    text=True,
                    timeout=5,
                ).stdout
                second = int(out.strip()) * 1024  # ps prints KiB
            except (OSError, ValueError, subprocess.SubprocessError):
                second = None
    return {"engine": process_rss_bytes(), "second source": second}


def check_memory_counters(machine: MachineMemory, rss: dict[str, int | None]) -> Check:
    """The memory panel's counters read once make sense: used <= total, page cache >= 0, and
    the process's RSS from two sources within RSS_AGREEMENT of each other."""
    title = "memory counters"
    problems = []
    used, cache, total = machine.used_bytes, machine.page_cache_bytes, machine.total_bytes
    if total <= 0:
        problems.append(f"total {total}")
    if used is not None and not 0 <= used <= total:
        problems.append(f"used {format_bytes(used)} of {format_bytes(total)}")
    if cache is not None and cache < 0:
        problems.append(f"page cache {cache}")
    engine, second = rss["engine"], rss["second source"]
    if second is not None and abs(engine - second) > RSS_AGREEMENT * max(engine, second):
        problems.append(f"RSS {format_bytes(engine)} vs {format_bytes(second)}")
    shown = lambda n: "unknown" if n is None else format_bytes(n)  # noqa: E731
    detail = (
        f"total {shown(total)} ({machine.source}), used {shown(used)}, page cache {shown(cache)}; "
        f"RSS {shown(engine)}, {shown(second)} by a second source"
    )
    if problems:
        return fail("memory", title, f"{detail}: wrong: {', '.join(problems)}")
    if second is None:
        return skipped("memory", title, f"{detail}; no second source for the RSS here")
    return ok("memory", title, detail)


def check_metal_memory(plan_bytes: int | None, working_set: int | None = None) -> Check:
    """macOS: the plan against the GPU's recommended working set (what Metal lets MLX wire), and
    the wired limit the system is set to (`iogpu.wired_limit_mb`, 0: macOS's default)."""
    title = "Metal working set"
    working_set = working_set if working_set is not None else metal_wired_limit_bytes()
    if working_set is None:
        return skipped("memory", title, "no Metal here: the plan above is the limit")
    wired = _sysctl("iogpu.wired_limit_mb")
    wired_text = {None: "unknown", 0: "macOS's default"}.get(wired, f"{wired} MiB")
    detail = f"recommended working set {format_bytes(working_set)}, wired limit {wired_text}"
    if plan_bytes is not None and plan_bytes > working_set:
        return fail(
            "memory",
            title,
            f"{detail}, below the plan's {format_bytes(plan_bytes)}: lower --expert-cache",
        )
    return ok("memory", title, detail, working_set_bytes=working_set, wired_limit_mb=wired)


def _sysctl(name: str) -> int | None:
    """A numeric sysctl (macOS); None where it cannot be read."""
    try:
        out = subprocess.run(
            ["/usr/sbin/sysctl", "-n", name], capture_output=True, text=True, timeout=5
        ).stdout
        return int(out.strip())
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
