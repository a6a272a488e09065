"""The fast BLAS: found in the installed wheel, preloaded by re-executing the `edge0` command once,
shown by `edge0 info`; never a re-exec inside a process that runs `main` (tests) or imported MLX."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import engine
import engine.runtime.blas as blas

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "assets" / "demo"
WHEEL = blas.wheel_library()
needs_linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux preload")
needs_wheel = pytest.mark.skipif(WHEEL is None, reason="the ngsolve-openblas wheel (x86_64 Linux)")


def _edge0(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "edge0_tui.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (blas.GUARD, "LD_PRELOAD")}
    env.pop("OPENBLAS_NUM_THREADS", None)
    return env | extra


def test_every_command_preloads_first(monkeypatch, tmp_path):
    from edge0_tui import cli

    calls = []
    monkeypatch.setattr(engine, "preload_fast_blas", lambda: calls.append(1))
    monkeypatch.setattr(sys, "argv", ["edge0", "info", str(tmp_path / "no-model")])
    assert cli.entry() == 2 and calls == [1]  # preloaded, then the missing model is reported
    monkeypatch.setattr(sys, "argv", ["edge0", "train", "corpus", str(tmp_path / "x" / "y")])
    calls.clear()
    cli.entry()
    assert calls == [1]


def test_main_in_process_never_re_executes(monkeypatch, capsys):
    """Tests call `cli.main` in-process: it must not replace the test runner's process."""
    from edge0_tui import cli

    def no_exec(*args):
        raise AssertionError("re-executed")

    monkeypatch.setattr(os, "execve", no_exec)
    monkeypatch.delenv(blas.GUARD, raising=False)
    assert cli.main(["info", str(DEMO), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["blas"]["text"] and isinstance(info["blas"]["fast"], bool)
    assert info["prefill_kernels"]
    blas.preload_fast_blas()  # MLX is imported here: returns, whatever the environment


def test_nothing_to_do_leaves_the_environment():
    assert blas.preload_environment({blas.GUARD: "/x.so"}) is None  # re-executed already
    assert blas.preload_environment({"LD_PRELOAD": "/opt/libopenblas.so.0"}) is None  # chosen


@needs_linux
def test_a_library_that_cannot_load_is_skipped(tmp_path, monkeypatch):
    broken = tmp_path / "libopenblas.so.0"
    broken.write_bytes(b"not an ELF file")
    env = _clean_env(LD_PRELOAD=str(broken))
    assert not blas.loads(str(broken), env)
    monkeypatch.setattr(blas, "candidates", lambda cache_dir=None: [(str(broken), {})])
    assert blas.preload_environment(_clean_env()) is None


@needs_linux
@needs_wheel
def test_the_wheel_is_preloaded_with_its_fortran_runtime(tmp_path, monkeypatch):
    monkeypatch.setattr(blas, "_cache_dir", lambda: tmp_path)
    env = blas.preload_environment(_clean_env())
    assert env is not None
    assert env["LD_PRELOAD"].split()[0] == str(WHEEL) and env[blas.GUARD] == str(WHEEL)
    links = Path(env["LD_LIBRARY_PATH"].split(os.pathsep)[0])
    assert (links / "libgfortran.so.5").resolve().exists() and links.is_relative_to(tmp_path)
    assert env["OPENBLAS_NUM_THREADS"] == str(blas.default_threads())
    kept = blas.preload_environment(_clean_env(OPENBLAS_NUM_THREADS="3"))
    assert kept["OPENBLAS_NUM_THREADS"] == "3"  # the user's choice stands


@needs_linux
@needs_wheel
def test_the_command_runs_with_the_fast_blas_and_says_so():
    done = _edge0("info", str(DEMO), "--json", env=_clean_env())
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["blas"]["name"] == "OpenBLAS" and info["blas"]["fast"]
    assert info["blas"]["library"] == str(WHEEL)
    assert "dense fp32" in info["prefill_kernels"]
    text = _edge0("info", str(DEMO), env=_clean_env())
    assert "BLAS: OpenBLAS" in text.stdout
    # The guard set by hand keeps MLX's own BLAS (and is how a re-executed process knows).
    bundled = _edge0("info", str(DEMO), "--json", env=_clean_env(**{blas.GUARD: "off"}))
    info = json.loads(bundled.stdout)
    assert not info["blas"]["fast"] and "4-bit" in info["prefill_kernels"]
    exact = _edge0("generate", str(DEMO), "--prompt", "hi", "--max-tokens", "2", "--exact")
    assert exact.returncode == 0, exact.stderr


def test_this_process_reports_a_blas():
    info = blas.blas_in_use()
    assert info.describe()
    if sys.platform.startswith("linux"):
        assert info.library is None or Path(info.library).exists()
