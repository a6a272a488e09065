"""Shared fixtures: small synthetic checkpoints in mlx-lm format, built once per test session."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from engine.train.synth import FAMILIES, write_synthetic_checkpoint


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """`checkpoint_dir(family, preset)` -> path of a synthetic checkpoint, written on first use."""
    root = tmp_path_factory.mktemp("checkpoints")
    built: dict[tuple[str, str], Path] = {}

    def get(family: str = "qwen3_moe", preset: str = "tiny") -> Path:
        key = (family, preset)
        if key not in built:
            built[key] = write_synthetic_checkpoint(root / f"{family}-{preset}", family, preset)
        return built[key]

    return get


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(autouse=True)
def private_data_dir(tmp_path_factory, monkeypatch):
    """No test reads or writes the real user data folder (trained adapters, chats): the engine's
    default and the CLI's EDGE0_DATA_DIR (also seen by subprocesses) point to a temp folder."""
    import engine.adapters.locations as locations

    data = tmp_path_factory.mktemp("edge0-data")
    monkeypatch.setattr(locations, "default_data_dir", lambda: data)
    monkeypatch.setenv("EDGE0_DATA_DIR", str(data))
    # Kept settings too: the app never reads or writes the real user config folder.
    monkeypatch.setenv("EDGE0_CONFIG_DIR", str(tmp_path_factory.mktemp("edge0-config")))
    return data


@pytest.fixture(autouse=True)
def cores_given_back():
    """An engine pins its reader threads to a core of their own and every other thread to the
    rest until it closes (engine/experts/reader_core.py). A test that leaves an engine open must
    not leave the rest of the run, and the processes it starts, on fewer cores."""
    import os

    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    yield
    if before is not None and os.sched_getaffinity(0) != before:
        from engine.experts.reader_core import unpin_all_threads

        unpin_all_threads(before)


@contextlib.contextmanager
def file_lock(path: Path):
    """Held by one process of the run at a time (pytest-xdist's workers are processes)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def kept_between_runs(config: pytest.Config, tmp_path_factory, name: str) -> Path:
    """A folder kept from one run to the next (pytest's cache folder), or, where the cache is
    off (`-p no:cacheprovider`), one shared by this run's workers only."""
    cache = getattr(config, "cache", None)
    if cache is not None:
        return cache.mkdir(name)
    folder = run_folder(tmp_path_factory) / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def run_folder(tmp_path_factory) -> Path:
    """The temp folder of the whole run: with pytest-xdist each worker has a base temp folder of
    its own inside the run's; without it the base temp folder is the run's."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def tool_calling_checkpoint(request, tmp_path_factory) -> Path:
    """The tiny checkpoint trained to call a tool (tests/agent_model.py), written once per session
    by a process of its own: `edge0`'s fast BLAS is preloaded there (this one has MLX loaded
    already), which makes the training about four times faster on Linux. The trained weights are
    kept between runs under a hash of their recipe, so only a changed recipe trains again; the
    lock makes a second worker that needs them wait for the first's instead of training too."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("tool-calling") / "tiny-agent"
    weights = kept_between_runs(request.config, tmp_path_factory, "edge0-agent-weights")
    tests = Path(__file__).parent
    script = (
        "from engine import preload_fast_blas; preload_fast_blas()\n"
        "import sys; from pathlib import Path; import agent_model\n"
        "print(agent_model.write_agent_checkpoint(Path(sys.argv[1]), weights_cache=Path(sys.argv[2])))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(tests.parent), str(tests)))}
    with file_lock(weights / ".lock"):
        done = subprocess.run(
            [sys.executable, "-c", script, str(out), str(weights)],
            env=env,
            capture_output=True,
            text=True,
        )
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="session")
def profiled_source(checkpoint_dir, tmp_path_factory) -> Path:
    """The tiny checkpoint with random K=2 prerouter and LoRA files, written once per session
    (tests that break it take a copy: `adapters.copy_model`)."""
    import shutil

    from adapters import write_random_profile

    model = tmp_path_factory.mktemp("profiled") / "qwen3_moe-tiny"
    shutil.copytree(checkpoint_dir("qwen3_moe"), model)
    write_random_profile(model, 2)
    return model


# The modules that take longest, longest first. `make test` hands whole modules to its workers
# (`--dist loadfile` in pyproject.toml: a module's fixtures, its server or its trained model, are
# built once, on one worker) in collection order, so these start at once and the two workers end
# together instead of one module running alone at the end. `--quick` leaves them out.
RUN_FIRST = (
    "test_server_agents.py",  # trains its model where the weights were not kept
    "test_prerouter.py",
    "test_expert_parallel.py",  # two processes a case, one sum per MoE layer
    "test_parity.py",
    "test_bench.py",
    "test_tui_model_picker.py",
    "test_tui_fit.py",
    "test_tui_app.py",
    "test_tui_keys.py",
    "test_tui_heat.py",
    "test_train_lora_distill.py",
    "test_lookahead.py",
    "test_host_reads.py",
    "test_streamed_student.py",
    "test_doctor.py",
    "test_train_heads_self_text.py",
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--quick",
        action="store_true",
        help="leave out the longest modules (conftest.RUN_FIRST): a check while editing "
        "(`make test-quick`); `make test` runs the whole suite",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return RUN_FIRST.index(name) if name in RUN_FIRST else len(RUN_FIRST)

    if config.getoption("--quick"):
        config.hook.pytest_deselected(items=[i for i in items if i.path.name in RUN_FIRST])
        items[:] = [i for i in items if i.path.name not in RUN_FIRST]
    items.sort(key=rank)  # stable: each module's tests keep their order
