"""Hostile and broken inputs, round 3 (issue 33): training and bench outputs checked before the
work, synth that leaves no half checkpoint, adapter file names and LoRA scales, a low open-file
limit. The contract of test_bad_inputs.py: exit 2, one `edge0: error:` line naming the file and
what is wrong, no traceback, the user's files as they were. Settings and the chat database are in
test_bad_kept_state.py."""

from __future__ import annotations

import ctypes
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from cli_runner import REPO, run_cli
from test_bad_inputs import assert_refused

import engine.checkpoint.outputs as outputs
from engine import Edge0Error
from engine.adapters.lora import save_lora
from engine.adapters.profiles import discover_profiles
from engine.train.run import read_cache

HEADS = ["--k", "2", "--steps", "1", "--max-tokens", "600"]


def phase_args(phase: str) -> list[str]:
    """A quick run of a training phase (LoRA phases: from the README's text)."""
    if phase == "heads":
        return HEADS
    return ["--k", "2", "--steps", "1", "--text", str(REPO / "README.md")]


@pytest.fixture(scope="module")
def trained(checkpoint_dir, tmp_path_factory):
    """The tiny model and an adapter folder with its K=2 heads (a LoRA phase needs them)."""
    model = checkpoint_dir("qwen3_moe")
    folder = tmp_path_factory.mktemp("round3") / "adapters"
    out = run_cli("train", "heads", str(model), *HEADS, "--adapters", str(folder))
    assert out.returncode == 0, out.stderr
    return model, folder


@pytest.fixture
def unwritable(tmp_path) -> Path:
    """A folder no file can be made in: 0555 for a user; as root (who passes permission bits),
    /sys, where even root cannot make a file."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        fd, probe = tempfile.mkstemp(dir=folder)
    except OSError:
        yield folder
    else:
        os.close(fd)
        os.unlink(probe)
        try:
            fd, probe = tempfile.mkstemp(dir="/sys")
            os.close(fd)
            os.unlink(probe)
            pytest.skip(reason="no folder here refuses new files")
        except OSError:
            yield Path("/sys")
    folder.chmod(0o755)


# -- 8: training outputs, checked before the work ----------------------------------------------------


def test_out_without_the_suffix_is_written_where_it_says(trained, tmp_path):
    """Was: OUT.safetensors written, 'wrote OUT' said (fixed with the atomic writes)."""
    model, folder = trained
    out = run_cli(
        "train", "heads", str(model), *HEADS, "--adapters", str(folder), "--out",
        str(tmp_path / "OUT"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert f"wrote {tmp_path / 'OUT'}" in out.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["OUT"]


@pytest.mark.parametrize("phase", ["heads", "lora"])
def test_out_that_is_a_directory_is_refused_even_with_force(trained, tmp_path, phase):
    """Was: --out DIR wrote DIR.safetensors; with --force, a rename over a folder failed after
    training. A directory is refused: name a file."""
    model, folder = trained
    out = run_cli(
        "train", phase, str(model), *phase_args(phase), "--adapters", str(folder), "--out",
        str(tmp_path), "--force",
    )  # fmt: skip
    assert_refused(out, tmp_path, "a directory: cannot write", "name a file")


@pytest.mark.parametrize("phase", ["heads", "lora"])
def test_out_in_a_read_only_folder_is_refused_before_training(trained, unwritable, phase):
    """Was: a traceback after the whole run."""
    model, folder = trained
    target = unwritable / f"{'prerouter' if phase == 'heads' else 'lora'}_k2.safetensors"
    out = run_cli(
        "train", phase, str(model), *phase_args(phase), "--adapters", str(folder), "--out",
        str(target),
    )  # fmt: skip
    assert_refused(out, target, "cannot write the")
    assert "collected" not in out.stdout and "wrote" not in out.stdout


@pytest.mark.parametrize("kind", ["file", "read-only"])
def test_out_dir_that_is_a_file_or_read_only_is_refused(trained, tmp_path, unwritable, kind):
    """Was: a traceback (FileExistsError, PermissionError) at the first checkpoint."""
    model, folder = trained
    if kind == "file":
        where = tmp_path / "taken"
        where.write_text("mine")
    else:
        where = unwritable / "state"
    out = run_cli(
        "train", "lora", str(model), *phase_args("lora"), "--adapters", str(folder),
        "--out-dir", str(where),
    )  # fmt: skip
    assert_refused(out, where, "cannot write the training state" if kind != "file" else "not a")
    if kind == "file":
        assert where.read_text() == "mine"


def test_heads_adapters_folder_that_is_a_file_is_refused(checkpoint_dir, tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("mine")
    out = run_cli(
        "train", "heads", str(checkpoint_dir("qwen3_moe")), *HEADS, "--adapters", str(taken)
    )
    assert_refused(out, taken, "not a directory")
    assert taken.read_text() == "mine"


def test_traces_on_a_full_disk_are_one_line(checkpoint_dir, tmp_path, monkeypatch):
    """Was: SIGBUS (exit 135, no message) writing a sparse memory-mapped trace on a full disk.
    (A real 300 KiB tmpfs said the same: 'needs 1.41 MiB, 300.00 KiB free'.)"""
    monkeypatch.setattr(outputs.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1, 1, 1))
    folder = tmp_path / "a"
    out = run_cli(
        "train", "heads", str(checkpoint_dir("qwen3_moe")), *HEADS, "--adapters", str(folder)
    )
    assert_refused(out, folder / "work", "not enough disk space for the traces", "1 B free")
    assert not list((folder / "work").rglob("*.npy"))


def test_reserve_makes_a_full_disk_an_error(tmp_path):
    """The blocks of a trace are allocated before it is mapped: a file-size limit (what a full
    disk does to a write) is an Edge0Error, in a process of its own."""
    script = (
        "import resource, sys; from pathlib import Path\n"
        "from engine.checkpoint.outputs import reserve\n"
        "p = Path(sys.argv[1]); p.write_bytes(b'')\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))\n"
        "try:\n    reserve(p, 1 << 20, 'the traces')\nexcept Exception as e: print(type(e).__name__, e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "x.npy")],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert out.stdout.startswith("Edge0Error ") and "cannot reserve 1.00 MiB" in out.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "heads", "M", "--k", "2", "--adapters", ""], "argument --adapters: empty"),
        (["train", "lora", "M", "--k", "2", "--text", "t", "--out-dir", ""], "argument --out-dir"),
        (["info", "M", "--adapters", ""], "argument --adapters: empty"),
        (["train", "lora", "M", "--k", "2", "--text", "t", "--batch", "-1"], "argument --batch"),
        (["train", "heads", "M", "--k", "2", "--max-tokens", "-5"], "argument --max-tokens: -5"),
        (["train", "heads", "M", "--k", "2", "--steps", "0"], "argument --steps: 0"),
        (["bench", "M", "--read-limit", "0"], "argument --read-limit: 0 must be at least 1"),
        (["synth", "OUT", "--heads", "x"], "argument --heads: 'x' is not a K"),
        (["synth", "OUT", "--heads", "0"], "argument --heads: '0' is not a K"),
    ],
)
def test_bad_argument_is_one_line(capsys, argv, message):
    """--adapters '' was the current folder; bench --read-limit 0 a FAILED arm and exit 0;
    synth --heads x a traceback after the checkpoint was written."""
    with pytest.raises(SystemExit) as e:
        from edge0_tui.cli import main

        main(argv)
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert e.value.code == 2 and len(lines) == 1, captured.err
    assert lines[0].startswith(f"edge0: error: {message}"), lines[0]


# -- 9: synth and bench outputs ----------------------------------------------------------------------

WIDEN = """
import resource, sys
from edge0_tui.cli import main
resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
sys.exit(main(["synth", sys.argv[1], "--from", sys.argv[2], "--expert-width", "256"]))
"""


def test_synth_from_on_a_full_disk_leaves_nothing(checkpoint_dir, tmp_path):
    """Was: a traceback and a partial shard. A file-size limit stands in for the full disk."""
    out_dir = tmp_path / "wide"
    out = subprocess.run(
        [sys.executable, "-c", WIDEN, str(out_dir), str(checkpoint_dir("qwen3_moe"))],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert_refused(out, out_dir, "cannot write the padded checkpoint", "File too large")
    assert not out_dir.exists()


def test_bench_outputs_are_checked_before_the_run(checkpoint_dir, tmp_path, unwritable):
    """Was: a traceback after the whole run (IsADirectoryError, PermissionError)."""
    model = str(checkpoint_dir("qwen3_moe"))
    out = run_cli("bench", model, "--json", str(tmp_path))
    assert_refused(out, tmp_path, "a directory: cannot write the JSON report")
    assert "round" not in out.stderr  # refused before any arm ran
    target = unwritable / "table.md"
    out = run_cli("bench", model, "--markdown", str(target))
    assert_refused(out, target, "cannot write the markdown table")
    taken = tmp_path / "taken"
    taken.write_text("mine")
    out = run_cli("bench", model, "--trace", str(taken))
    assert_refused(out, taken, "not a directory")


def test_bench_write_that_fails_at_the_end_is_one_line():
    """/dev/full passes every check and fails only when written: one line, not a traceback."""
    from edge0_tui.commands.bench import write_output

    if not os.path.exists("/dev/full"):
        pytest.skip(reason="no /dev/full")
    with pytest.raises(Edge0Error, match="^/dev/full: cannot write the JSON report .*space"):
        write_output(Path("/dev/full"), "{}", "the JSON report")


def test_bench_prompt_file_is_read_only_as_far_as_bounded(checkpoint_dir, tmp_path, monkeypatch):
    import edge0_tui.commands.bench as bench

    monkeypatch.setattr(bench, "MAX_PROMPT_CHARS", 10)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("x" * 11)
    out = run_cli("bench", str(checkpoint_dir("qwen3_moe")), "--prompt-file", str(prompt))
    assert_refused(out, prompt, "longer than 10 characters")


# -- 15: messages ------------------------------------------------------------------------------------


def test_eval_max_tokens_below_a_window_says_so(checkpoint_dir):
    """Was: 'the text is too short' whatever the text."""
    out = run_cli(
        "eval", str(checkpoint_dir("qwen3_moe")), "--text", str(REPO / "README.md"),
        "--max-tokens", "50",
    )  # fmt: skip
    assert_refused(out, None, "max_tokens=50 is below one perplexity window of 128 tokens")


# -- 13: adapters -------------------------------------------------------------------------------------


def _copy_heads(folder: Path, target: Path, drop_k: bool = False) -> None:
    arrays, meta = mx.load(str(folder / "prerouter_k2.safetensors"), return_metadata=True)
    if drop_k:
        meta.pop("K", None)
    mx.save_safetensors(str(target), arrays, metadata=meta)


@pytest.mark.parametrize("name", ["prerouter_k0004", "prerouter_k٤", "lora_k04"])
def test_k_in_a_file_name_is_canonical(trained, tmp_path, name):
    """Was: read as K=4 (and not paired with lora_k4)."""
    _, folder = trained
    path = tmp_path / f"{name}.safetensors"
    if name.startswith("lora"):
        save_lora(
            path,
            {"model.layers.0.self_attn.q_proj": (mx.ones((4, 8)), mx.ones((8, 4)))},
            4,
            8.0,
            4,
            "f",
        )
    else:
        _copy_heads(folder, path)
    warnings: list[str] = []
    assert discover_profiles(tmp_path, warnings=warnings) == {}
    assert len(warnings) == 1 and warnings[0].startswith(f"{path}: ignored: K in an adapter")


def test_k_above_the_experts_is_warned_about(trained, tmp_path):
    """Was: prerouter_k99 without K metadata dropped silently."""
    model, folder = trained
    _copy_heads(folder, tmp_path / "prerouter_k99.safetensors", drop_k=True)
    out = run_cli("info", str(model), "--adapters", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert (
        f"edge0: warning: {tmp_path / 'prerouter_k99.safetensors'}: ignored: K=99 is above"
        in out.stderr
    )


def test_lora_alpha_out_of_range_is_refused(tmp_path):
    """Was: alpha=-1e30 loaded without a word."""
    from engine.adapters.lora import load_lora

    path = tmp_path / "lora_k2.safetensors"
    weights = {"model.layers.0.self_attn.q_proj": (mx.ones((4, 8)), mx.ones((8, 4)))}
    with pytest.raises(Edge0Error, match="alpha=-1e\\+30 .*above 0 and at most 1024"):
        save_lora(path, weights, 4, -1e30, 2, "f")
    save_lora(path, weights, 4, 8.0, 2, "f")
    arrays, meta = mx.load(str(path), return_metadata=True)
    mx.save_safetensors(str(path), arrays, metadata={**meta, "alpha": "-1e30"})
    with pytest.raises(Edge0Error, match=f"^{path}: metadata alpha=-1e\\+30"):
        load_lora(path, "f")


def test_stale_temporary_files_neither_confuse_nor_stay(trained, tmp_path):
    """A write killed midway leaves its temporary file: the loader does not take it for a K, and
    the next write of that file removes it (never one of a live process)."""
    _, folder = trained
    _copy_heads(folder, tmp_path / "prerouter_k2.safetensors")
    _copy_heads(folder, tmp_path / "prerouter_k2.tmp.safetensors")  # an older tool's temp name
    stale = tmp_path / ".lora_k2.safetensors.999999999-ab12.tmp.safetensors"
    live = tmp_path / f".lora_k2.safetensors.{os.getpid()}-ab12.tmp.safetensors"
    stale.write_bytes(b"half")
    live.write_bytes(b"half")
    warnings: list[str] = []
    assert sorted(discover_profiles(tmp_path, warnings=warnings)) == [2]
    assert len(warnings) == 1 and "a temporary file" in warnings[0]
    weights = {"model.layers.0.self_attn.q_proj": (mx.ones((4, 8)), mx.ones((8, 4)))}
    save_lora(tmp_path / "lora_k2.safetensors", weights, 4, 8.0, 2, "f")
    assert not stale.exists() and live.exists()


# -- 5 (and the rows cache): a zip bomb -------------------------------------------------------------


def test_rows_cache_zip_bomb_is_refused_before_it_unpacks(tmp_path, monkeypatch):
    import engine.train.run as run

    monkeypatch.setattr(run, "MAX_UNPACK_SLACK", 0)
    path = tmp_path / "rows.npz"
    zeros = np.zeros((256, 1024), np.int32)  # 1 MiB that compresses to ~1 KiB
    np.savez_compressed(path, settings=json.dumps({}), prompts=zeros, continuations=zeros)
    with pytest.raises(Edge0Error, match=f"^{path}: not a rows cache .*zip bomb"):
        read_cache(path, "rows cache", ("settings", "prompts", "continuations"))


def test_rows_cache_whose_header_claims_more_than_it_holds(tmp_path):
    """An .npy header may declare a shape of terabytes over a few bytes: refused, not allocated."""
    import zipfile

    path = tmp_path / "rows.npz"
    with zipfile.ZipFile(path, "w") as z:
        magic = b"\x93NUMPY\x01\x00"
        text = b"{'descr': '<i4', 'fortran_order': False, 'shape': (2000000000, 2), }"
        text = text.ljust(128 - len(magic) - 2 - 1) + b"\n"
        z.writestr("prompts.npy", magic + len(text).to_bytes(2, "little") + text + bytes(16))
    with pytest.raises(Edge0Error, match="says 16000000000 bytes but holds"):
        read_cache(path, "rows cache", ("prompts",))


# -- 16: a low open-file limit ------------------------------------------------------------------------

CAP_SYS_RESOURCE, PR_CAPBSET_DROP = 24, 24


def _low_open_file_limit() -> None:
    """In the child: a hard limit of 256 descriptors, without the privilege to raise it (root
    drops CAP_SYS_RESOURCE from its bounding set, so the exec'd Python has it no more)."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    if os.geteuid() == 0:
        ctypes.CDLL(None, use_errno=True).prctl(PR_CAPBSET_DROP, CAP_SYS_RESOURCE, 0, 0, 0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl and /proc: Linux")
def test_commands_run_under_a_low_open_file_limit(checkpoint_dir):
    """Was: every command that loads a model died importing mlx-lm ('not allowed to raise
    maximum limit')."""
    command = [
        sys.executable, "-m", "edge0_tui.cli", "generate", str(checkpoint_dir("qwen3_moe")),
        "--prompt", "hi", "--max-tokens", "2", "--json",
    ]  # fmt: skip
    out = subprocess.run(
        command, capture_output=True, text=True, cwd=REPO, timeout=120,
        preexec_fn=_low_open_file_limit,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    assert len(json.loads(out.stdout)["tokens"]) == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl and /proc: Linux")
def test_importing_the_engine_changes_no_import_machinery():
    """The cut to mlx-lm's open-file request is made where edge0 starts (the command, the
    engine's own child processes), not as a side effect of `import engine`."""
    probe = (
        "import sys; before = list(sys.meta_path); import engine; "
        "print(sys.meta_path == before); engine.fit_mlx_lm_to_the_open_file_limit(); "
        "engine.fit_mlx_lm_to_the_open_file_limit(); print(len(sys.meta_path) - len(before))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=60,
        preexec_fn=_low_open_file_limit,
    )  # fmt: skip
    assert out.stdout.split() == ["True", "1"], out.stderr  # once, however often it is asked
