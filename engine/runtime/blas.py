"""Which BLAS computes MLX's dense matrix products on Linux, and making it a fast one.

MLX's Linux CPU wheel links its matrix products (`cblas_sgemm`) to a bundled reference BLAS
(`mlx_cpu.libs/libblas-*.so`): single-threaded and many times slower than OpenBLAS for fp32 GEMM
(docs/notebook/figures-from-code-comments.md).
`libmlx.so` binds those symbols when it is loaded, so only a library loaded before it can take
them over: `preload_fast_blas()` re-executes the process once with a fast BLAS in `LD_PRELOAD`. The `edge0`
command calls it first thing (`edge0_tui.cli.entry`) for every command; a process that imported
MLX already (a test calling `cli.main`, a library user) keeps what it has. Child processes (the
bench's arms) inherit the preload through the environment.

The library, first found wins:
1. the `ngsolve-openblas` wheel (a project dependency on Linux x86_64): OpenBLAS 0.3.33 built
   with DYNAMIC_ARCH (it picks its kernels for the CPU it runs on) and the standard `cblas_*` /
   `sgemm_` names. (`scipy-openblas32` prefixes every name with `scipy_`, which a preload cannot
   use; `cmeel-openblas` is built for one CPU, SKYLAKEX, and would fault without AVX-512; Intel's
   `mkl` wheel works but is hundreds of megabytes to download.) It needs `libgfortran.so.5`, which MLX's wheel
   ships under a mangled name: a folder of two links in edge0's cache folder gives it that name
   through `LD_LIBRARY_PATH`;
2. Debian's OpenBLAS (`apt-get install libopenblas0-pthread`), where installed;
3. none: MLX's bundled reference BLAS, as before.
Each candidate is tried on `true` first (a preload whose dependencies are missing would end the
process at start), and `EDGE0_BLAS` marks the re-executed process so that it never loops.

Threads: OpenBLAS spins its worker threads while it waits for work; next to MLX's own compute
thread, the expert readers and the app, more BLAS threads than cores less one made prefill slower
and noisier on the 2-core box (figures in docs/benchmarks.md), so `OPENBLAS_NUM_THREADS` defaults to
the usable cores less one (at least 1), unless it (or `OMP_NUM_THREADS`) is set already.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

# Set in the re-executed process: the preloaded library's path.
GUARD = "EDGE0_BLAS"
DEBIAN_OPENBLAS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
)
WHEEL_PACKAGE = "ngsolve_openblas"
# The bundled reference BLAS as /proc/self/maps names it, and the fast ones edge0 recognises.
_FAST_NAMES = (("libopenblas", "OpenBLAS"), ("libmkl_rt", "MKL"), ("libblis", "BLIS"))


@dataclass(frozen=True)
class BlasInfo:
    name: str  # "OpenBLAS", "MKL", "Accelerate", "reference BLAS"
    fast: bool
    library: str | None  # the mapped file, None for Accelerate
    threads: int | None  # OpenBLAS/MKL threads as configured, None where it does not apply

    def describe(self) -> str:
        if self.name == "Accelerate":
            return "Accelerate"
        if not self.fast:
            return "reference BLAS bundled with MLX (slow: pip install ngsolve-openblas)"
        threads = f", {self.threads} thread{'s' * (self.threads != 1)}" if self.threads else ""
        return f"{self.name}{threads}"

    def as_dict(self) -> dict:
        return asdict(self) | {"text": self.describe()}


def blas_in_use() -> BlasInfo:
    """The BLAS this process computes dense products with: read from its memory map."""
    if sys.platform == "darwin":
        return BlasInfo("Accelerate", True, None, None)
    mapped = []
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        mapped = [line.split(maxsplit=5)[-1].strip() for line in maps if "/" in line]
    for prefix, name in _FAST_NAMES:
        path = next((p for p in mapped if os.path.basename(p).startswith(prefix)), None)
        if path is not None:
            return BlasInfo(name, True, path, _threads(name))
    path = next((p for p in mapped if os.path.basename(p).startswith("libblas")), None)
    return BlasInfo("reference BLAS", False, path, 1 if path else None)


def _threads(name: str) -> int | None:
    var = {"OpenBLAS": "OPENBLAS_NUM_THREADS", "MKL": "MKL_NUM_THREADS"}.get(name)
    for v in (var, "OMP_NUM_THREADS"):
        if v and os.environ.get(v, "").strip().isdigit():
            return int(os.environ[v])
    return None


def default_threads() -> int:
    """BLAS threads: the cores this process may use, less one for MLX's thread and the readers."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, cores - 1)


# -- finding a library -------------------------------------------------------------------------------


def wheel_library() -> Path | None:
    """The OpenBLAS of the `ngsolve-openblas` wheel, found without importing it (its import loads
    the library into this process)."""
    with contextlib.suppress(ImportError, ValueError):
        spec = importlib.util.find_spec(WHEEL_PACKAGE)
        if spec is not None and spec.submodule_search_locations:
            for folder in spec.submodule_search_locations:
                found = sorted(Path(folder).glob("libopenblas*.so*"))
                if found:
                    return found[0]
    return None


def mlx_fortran_runtime() -> list[Path]:
    """MLX's bundled libgfortran and libquadmath (mangled names), which the wheel's OpenBLAS needs."""
    with contextlib.suppress(ImportError, ValueError):
        spec = importlib.util.find_spec("mlx")
        if spec is not None and spec.submodule_search_locations:
            for folder in spec.submodule_search_locations:
                libs = Path(folder).parent / "mlx_cpu.libs"
                found = [
                    *sorted(libs.glob("libgfortran*.so.5*")),
                    *sorted(libs.glob("libquadmath*.so*")),
                ]
                if found:
                    return found
    return []


def fortran_link_dir(cache_dir: Path) -> Path | None:
    """A folder where `libgfortran.so.5` (and the libquadmath it names) link to MLX's copies, so
    that the wheel's OpenBLAS finds them through LD_LIBRARY_PATH; None when they cannot be had."""
    runtime = mlx_fortran_runtime()
    gfortran = next((p for p in runtime if p.name.startswith("libgfortran")), None)
    if gfortran is None:
        return None
    tag = hashlib.sha256(str(gfortran.parent).encode()).hexdigest()[:12]
    folder = cache_dir / "blas-runtime" / tag  # one per MLX install (venv)
    links = {"libgfortran.so.5": gfortran, **{p.name: p for p in runtime if p is not gfortran}}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name, target in links.items():
            link = folder / name
            if not (link.is_symlink() and os.readlink(link) == str(target)):
                tmp = folder / f".{name}.{os.getpid()}"
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
                tmp.symlink_to(target)
                os.replace(
                    tmp, link
                )  # atomic: another edge0 starting at once sees one or the other
    except OSError:
        return None
    return folder


def _cache_dir() -> Path:
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("edge0"))


def candidates(cache_dir: Path | None = None) -> list[tuple[str, dict[str, str]]]:
    """(library, extra environment) for each fast BLAS found, best first."""
    found = []
    wheel = wheel_library()
    if wheel is not None:
        links = fortran_link_dir(cache_dir or _cache_dir())
        if links is not None:
            found.append((str(wheel), {"LD_LIBRARY_PATH": str(links)}))
    for path in DEBIAN_OPENBLAS:
        if Path(path).exists():
            found.append((path, {}))
    return found


def loads(library: str, env: dict[str, str]) -> bool:
    """Whether a process starts with `library` preloaded (its dependencies found)."""
    true = next((p for p in ("/usr/bin/true", "/bin/true") if os.path.exists(p)), None)
    if true is None:
        return False
    try:
        done = subprocess.run(
            [true],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0 and b"cannot be preloaded" not in done.stderr


def preload_environment(environ: dict[str, str] | None = None) -> dict[str, str] | None:
    """The environment to re-execute with (a fast BLAS preloaded), or None: nothing to do (not
    Linux, re-executed already, the library preloaded already, or no fast BLAS to be had)."""
    environ = dict(os.environ if environ is None else environ)
    if not sys.platform.startswith("linux") or GUARD in environ:
        return None
    preloaded = environ.get("LD_PRELOAD", "")
    if any(name in preloaded for name, _ in _FAST_NAMES):
        return None  # the user chose one
    for library, extra in candidates():
        env = dict(environ)
        env["LD_PRELOAD"] = f"{library} {preloaded}".strip()
        if extra.get("LD_LIBRARY_PATH"):
            env["LD_LIBRARY_PATH"] = os.pathsep.join(
                p for p in (extra["LD_LIBRARY_PATH"], environ.get("LD_LIBRARY_PATH")) if p
            )
        if not ("OPENBLAS_NUM_THREADS" in env or "OMP_NUM_THREADS" in env):
            env["OPENBLAS_NUM_THREADS"] = str(default_threads())
        if loads(library, env):
            env[GUARD] = library
            return env
    return None


def preload_fast_blas() -> None:
    """Re-execute this process with a fast BLAS preloaded (once); return where there is nothing
    to do or MLX is loaded already (a re-exec would then lose in-process state)."""
    if "mlx.core" in sys.modules:
        return
    env = preload_environment()
    if env is None:
        return
    for stream in (sys.stdout, sys.stderr):  # None when the descriptor is closed
        with contextlib.suppress(AttributeError, OSError, ValueError):
            stream.flush()
    argv = getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv]
    try:
        os.execve(sys.executable, [sys.executable, *argv[1:]], env)
    except OSError:
        return  # run on with the bundled BLAS


def dense_prefill_rows(config) -> int | None:
    """From how many rows a prefill chunk's routed expert is dequantized and multiplied in fp32
    (`experts.switch_glu.mixed_glu`), or None: today's 4-bit kernels everywhere (the exact setting,
    a GPU, or no fast BLAS in this process, where dense products are no faster)."""
    import mlx.core as mx

    from ..experts.switch_glu import DENSE_MIN_ROWS

    if config.exact_kernels or mx.default_device() != mx.cpu:
        return None
    return DENSE_MIN_ROWS if blas_in_use().fast else None


def prefill_kernels(config) -> str:
    """How prefill multiplies routed experts, in words (`edge0 info`, the app)."""
    rows = dense_prefill_rows(config)
    if rows is not None:
        return (
            f"dense fp32 for experts with {rows}+ tokens in a chunk (more where dequantizing costs "
            "more), 4-bit below and in chunks too short for the average expert to reach it"
        )
    if config.exact_kernels:
        return "4-bit kernels (exact)"
    return "4-bit kernels (no fast BLAS for dense products)"
