"""The chat app's parts that need no UI: chat database, memory figures, model sources, CLI hookup."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from edge0_tui import cli
from edge0_tui.chat_store import ChatMessage, ChatStore, chat_title
from edge0_tui.live_metrics import LiveMetrics
from edge0_tui.model_source import DEMO, download_from_hub, resolve_model
from edge0_tui.system_memory import SystemMemory, cgroup_memory, read_linux_memory
from edge0_tui.widgets.memory_bar import MemoryBreakdown, bar_cells
from engine.errors import Edge0Error
from engine.runtime.metrics import StepMetrics

GIB = 1 << 30

# -- chat database -------------------------------------------------------------------------------


def test_chat_store_round_trip_and_order(tmp_path):
    store = ChatStore(tmp_path)
    older = store.create_chat("older", "m")
    newer = store.create_chat("newer", "m")
    store.add_message(older, ChatMessage("user", "hi"))
    store.add_message(older, ChatMessage("assistant", "partial", "cancelled"))
    store.close()

    store = ChatStore(tmp_path)  # what a restarted app sees
    assert [c.title for c in store.chats()] == ["older", "newer"]  # last written first
    assert [c.message_count for c in store.chats()] == [2, 0]
    assert store.messages(older) == [
        ChatMessage("user", "hi"),
        ChatMessage("assistant", "partial", "cancelled"),
    ]
    store.delete_chat(older)
    assert [c.id for c in store.chats()] == [newer]
    assert store.messages(older) == []  # messages go with their chat
    store.close()

    raw = sqlite3.connect(tmp_path / "chats.sqlite3")
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert raw.execute("PRAGMA user_version").fetchone()[0] == 1
    raw.close()


def test_chat_store_rolls_back_a_failed_message(tmp_path):
    store = ChatStore(tmp_path)
    chat = store.create_chat("t", "m")
    with pytest.raises(sqlite3.IntegrityError):
        store.add_message(chat, ChatMessage("robot", "not a role"))
    assert store.messages(chat) == [] and store.chats()[0].message_count == 0
    store.add_message(chat, ChatMessage("user", "still works"))
    assert len(store.messages(chat)) == 1
    store.close()


def test_chat_store_in_an_unusable_directory_is_a_one_line_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(Edge0Error, match="cannot open the chat database"):
        ChatStore(tmp_path / "file")


def test_chat_title():
    assert chat_title("  What is K?\nmore lines") == "What is K?"
    assert chat_title("x" * 100, width=10) == "x" * 9 + "…"
    assert chat_title("   ") == "New chat"


# -- memory --------------------------------------------------------------------------------------


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_limit_is_the_tightest_ancestor(tmp_path):
    root = tmp_path / "cgroup"
    leaf = root / "user.slice" / "app"
    _write(leaf / "memory.max", "max\n")  # the process's own cgroup: unlimited
    _write(root / "user.slice" / "memory.max", f"{8 * GIB}\n")
    _write(root / "user.slice" / "memory.current", f"{3 * GIB}\n")
    _write(root / "user.slice" / "memory.stat", f"anon 100\ninactive_file {GIB}\n")
    found = cgroup_memory("0::/user.slice/app\n", root)
    assert found.limit_bytes == 8 * GIB and found.version == 2
    assert found.used_bytes == 2 * GIB  # usage less inactive file pages


def test_cgroup_v1_unlimited_is_no_limit(tmp_path):
    root = tmp_path / "cgroup"
    _write(root / "memory" / "docker" / "abc" / "memory.limit_in_bytes", "9223372036854771712\n")
    text = "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n"
    assert cgroup_memory(text, root) is None
    _write(root / "memory" / "docker" / "abc" / "memory.limit_in_bytes", f"{2 * GIB}\n")
    _write(root / "memory" / "docker" / "abc" / "memory.usage_in_bytes", f"{GIB}\n")
    found = cgroup_memory(text, root)
    assert (found.limit_bytes, found.used_bytes, found.version) == (2 * GIB, GIB, 1)


def test_system_memory_total_is_the_cgroup_limit_when_lower(tmp_path):
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    _write(
        proc / "meminfo",
        "MemTotal: 16777216 kB\nMemFree: 1048576 kB\nMemAvailable: 10485760 kB\n"
        "Cached: 7340032 kB\nActive(file): 2097152 kB\nInactive(file): 4194304 kB\n",
    )
    _write(proc / "self" / "cgroup", "0::/\n")
    # The file cache is the file LRU (6 GiB), not "Cached" (7 GiB, shmem included).
    assert read_linux_memory(proc, root) == SystemMemory(16 * GIB, 6 * GIB, "RAM", 6 * GIB, GIB)
    _write(root / "memory.max", f"{4 * GIB}\n")
    _write(root / "memory.current", f"{GIB}\n")
    assert read_linux_memory(proc, root) == SystemMemory(
        4 * GIB, GIB, "cgroup v2 limit", None, 3 * GIB
    )
    _write(root / "memory.stat", f"anon 1\nactive_file {GIB // 4}\ninactive_file {GIB // 4}\n")
    assert read_linux_memory(proc, root) == SystemMemory(
        4 * GIB, 3 * GIB // 4, "cgroup v2 limit", GIB // 2, 3 * GIB
    )


def test_system_memory_without_file_lru_uses_cached(tmp_path):
    _write(
        tmp_path / "meminfo", "MemTotal: 8388608 kB\nMemAvailable: 4194304 kB\nCached: 1048576 kB\n"
    )
    memory = read_linux_memory(tmp_path, tmp_path / "cgroup")
    assert (memory.used_bytes, memory.file_cache_bytes, memory.free_bytes) == (4 * GIB, GIB, None)


def _step(**figures) -> StepMetrics:
    defaults = dict(
        phase="decode",
        tokens=1,
        wall_ms=10.0,
        blocked_ms=0.0,
        loads=0,
        hits=0,
        mib_read=0.0,
        mib_per_load=0.0,
        cold_fraction=0.0,
        ms_per_load=0.0,
        whole_layer_reads=0,
        whole_layer_mib=0.0,
        transient_peak_mib=0.0,
        expert_pool_mib=0.0,
        mlx_active_bytes=0,
        mlx_cache_bytes=0,
        mlx_peak_bytes=0,
        rss_bytes=0,
        page_cache_expert_bytes=0,
    )
    return StepMetrics(**{**defaults, **figures})


def test_memory_breakdown_is_edge0s_memory_by_reclaimability():
    step = _step(
        mlx_active_bytes=2 * GIB,
        mlx_cache_bytes=GIB,
        page_cache_expert_bytes=3 * GIB,
        rss_bytes=4 * GIB,
    )
    metrics = LiveMetrics(last_step=step)
    breakdown = MemoryBreakdown.of(metrics, SystemMemory(16 * GIB, 7 * GIB, "RAM"))
    # MLX's 3 GiB are part of the 4 GiB RSS: 1 GiB is the rest of the process.
    assert {s.name: s.nbytes for s in breakdown.segments} == {
        "MLX, not reclaimable": 3 * GIB,
        "checkpoint, reclaimable": 3 * GIB,
        "rest of edge0": GIB,
    }
    assert breakdown.own_bytes == 7 * GIB
    assert breakdown.system.total_bytes == 16 * GIB  # the machine is text, not a bar segment


def test_bar_cells_are_proportional_and_fill_the_width():
    assert bar_cells([1, 1, 2], 8) == [2, 2, 4]
    cells = bar_cells([3, 1, 0, 5, 7], 41)
    assert sum(cells) == 41 and cells[2] == 0
    assert bar_cells([0, 0], 10) == [0, 0]


def test_live_metrics_figures():
    steps = tuple(
        _step(blocked_ms=b, loads=n, mib_read=m, cold_fraction=c)
        for b, n, m, c in [(2.0, 4, 1.0, 1.0), (4.0, 6, 3.0, 0.0)]
    )
    metrics = LiveMetrics(recent_steps=steps, recent_token_ms=(10.0, 40.0))
    assert metrics.tok_per_s == pytest.approx(2 / 0.050)  # 2 tokens in 50 ms
    assert metrics.tok_per_s_history == [100.0, 25.0]
    assert metrics.blocked_ms == 3.0 and metrics.loads_per_step == 5.0
    assert metrics.mib_per_step == 2.0
    assert metrics.cold_fraction == pytest.approx(0.25)  # 1 cold MiB of 4 read
    assert LiveMetrics().tok_per_s == 0.0 and LiveMetrics().cold_fraction == 0.0


# -- model sources -------------------------------------------------------------------------------


def _no_progress(what: str, done: float, total: float | None) -> None:
    pass


def test_demo_is_the_bundled_model():
    from edge0_tui.model_source import BUNDLED_DEMO

    source = resolve_model(DEMO, Path("/nonexistent-cache"), _no_progress)
    assert source.path == BUNDLED_DEMO and (source.path / "model.safetensors").exists()
    assert "Shakespeare" in source.notice


def test_demo_stand_in_is_written_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr("edge0_tui.model_source.BUNDLED_DEMO", tmp_path / "not-installed")
    written = []

    def fake_write(path, family, preset):
        written.append((Path(path).name, family, preset))
        _write(Path(path) / "config.json", "{}")
        return Path(path)

    monkeypatch.setattr("engine.train.synth.write_synthetic_checkpoint", fake_write)
    first = resolve_model(DEMO, tmp_path, _no_progress)
    second = resolve_model(DEMO, tmp_path, _no_progress)
    assert written == [("synthetic-qwen3_moe-small", "qwen3_moe", "small")]
    assert first.path == second.path == tmp_path / "synthetic-qwen3_moe-small"
    assert "random-weight" in first.notice


def test_local_directory_is_used_as_is(tmp_path):
    source = resolve_model(str(tmp_path), tmp_path / "cache", _no_progress)
    assert source.path == tmp_path and source.notice is None


def test_hub_model_offline_uses_the_cached_copy_or_says_why_not(tmp_path):
    with pytest.raises(Edge0Error, match="org/model: offline, and no complete copy is cached"):
        download_from_hub("org/model", _no_progress, cache_dir=tmp_path, offline=True)
    repo = tmp_path / "models--org--model"
    _write(repo / "refs" / "main", "abc123")
    _write(repo / "snapshots" / "abc123" / "config.json", "{}")
    found = download_from_hub("org/model", _no_progress, cache_dir=tmp_path, offline=True)
    assert found == repo / "snapshots" / "abc123"


# -- CLI hookup ----------------------------------------------------------------------------------


@pytest.fixture
def launched(monkeypatch) -> list:
    """Edge0App instances that `edge0` would have run."""
    from edge0_tui.app import Edge0App

    apps = []
    monkeypatch.setattr(Edge0App, "run", lambda self: apps.append(self))
    return apps


def test_edge0_without_arguments_opens_the_demo_chat(launched, tmp_path, monkeypatch):
    monkeypatch.setattr("edge0_tui.app.user_data_path", lambda name: tmp_path / name)
    monkeypatch.delenv("EDGE0_DATA_DIR")  # set for every test (conftest): here, the default
    assert cli.main([]) == 0
    (app,) = launched
    assert app.session.model == "demo"
    assert app.session.engine_config.expert_cache_bytes == 4 << 20  # small: the wall shows
    assert app.store.path == tmp_path / "edge0" / "chats.sqlite3"


def test_the_demo_chat_has_a_page_cache_budget_and_others_none(launched, checkpoint_dir):
    assert cli.main(["chat"]) == 0
    assert launched[-1].session.engine_config.page_cache_bytes == 4 << 20  # the wall, visible
    assert cli.main(["chat", "demo", "--page-cache", "off"]) == 0
    assert launched[-1].session.engine_config.page_cache_bytes is None
    assert cli.main(["chat", str(checkpoint_dir()), "--page-cache", "2M"]) == 0
    assert launched[-1].session.engine_config.page_cache_bytes == 2 << 20
    assert cli.main(["chat", str(checkpoint_dir())]) == 0
    assert launched[-1].session.engine_config.page_cache_bytes is None


def test_edge0_chat_passes_its_options(launched, checkpoint_dir, tmp_path):
    model = str(checkpoint_dir())
    args = ["chat", model, "--expert-cache", "2M", "--data-dir", str(tmp_path / "d")]
    assert cli.main(args) == 0
    (app,) = launched
    assert app.session.model == model
    assert app.session.engine_config.expert_cache_bytes == 2 << 20
    assert app.store.path == tmp_path / "d" / "chats.sqlite3"


def test_generate_never_imports_textual(checkpoint_dir):
    code = (
        "import sys; from edge0_tui.cli import main; "
        f"main(['generate', {str(checkpoint_dir())!r}, '--prompt', 'x', '--max-tokens', '1', "
        "'--json']); print('textual' in sys.modules, file=sys.stderr)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip().endswith("False")


@pytest.mark.parametrize(
    "model, message",
    [
        ("{tmp}", "config.json: missing (not an mlx-lm checkpoint directory?)"),
        ("{tmp}/nothing/here", "no such local directory"),
        ("nobody/no-such-model", "offline, and no complete copy is cached"),
    ],
)
def test_edge0_chat_on_a_model_that_cannot_open_fails_before_the_app(
    launched, tmp_path, monkeypatch, capsys, model, message
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    assert cli.main(["chat", model.format(tmp=tmp_path)]) == 2
    assert not launched  # the app never started
    err = capsys.readouterr().err
    assert err.startswith("edge0: error: ") and message in err and err.count("\n") == 1


@pytest.mark.parametrize("width", [None, 120, 80, 60, 40])
def test_the_status_line_fits_and_keeps_k_mode_and_state(width):
    from edge0_tui.widgets.status_line import Status

    status = Status(
        model="/home/someone/models/Qwen3-30B-A3B-Instruct-2507-4bit",
        state="writing…",
        k=4,
        pending_k=8,
        mode="prerouter",
        context_tokens=1234,
        peak_memory_bytes=3 << 30,
    )
    line = status.line(width)
    assert width is None or len(line) <= width
    assert "K 4 → 8" in line and "prerouter" in line and "writing…" in line, line
    if width is None:
        assert "peak MLX" in line and "context 1234" in line
    if width == 60:
        assert "…" in line and line.split("  │  ")[0].endswith("4bit")  # the name's end tells
