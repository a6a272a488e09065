"""Allocation bombs: inputs a few MB on disk that took GBs of memory or disk. Each is refused up
front against what the input can need, with one `edge0: error:` line naming the file or value:

- a safetensors file (shard, prerouter, LoRA) with a hundred thousand empty tensors, or a prerouter
  whose `owners` metadata is a list of a hundred thousand layers (a million tensors took 8 GB);
- `synth --from M --expert-width 2147483648` (12 GB of memory and 37 GB written before it was
  killed), and any width whose checkpoint does not fit the free disk space;
- `--text` read whole though only 16 x max-tokens characters are used (a sparse GB took 2 GB).

The bombs themselves are built small, and a command that could run away on a broken tree runs in a
process with its memory and file size limited.
"""

from __future__ import annotations

import json
import resource
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

from adapters import write_random_profile
from cli_runner import REPO, run_cli
from test_bad_inputs import assert_refused

import engine.train.wall as wall
from edge0_tui.commands.common import read_text

TENSORS = 100_000


def add_empty_tensors(path: Path, names, owners: int = 0) -> None:
    """Add a zero-size tensor per name to a safetensors header (a few MB for 100k names); with
    `owners`, make the `owners` metadata a list of that many layers."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    for name in names:
        header[name] = {"dtype": "F16", "shape": [0], "data_offsets": [0, 0]}
    if owners:
        header["__metadata__"]["owners"] = json.dumps(list(range(owners)))
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])


BOMBS = {
    "shard": (
        "model.safetensors",
        lambda p: add_empty_tensors(p, (f"z{i}" for i in range(TENSORS))),
    ),
    "prerouter": (
        "prerouter_k2.safetensors",
        lambda p: add_empty_tensors(p, (f"layers.9{i}.x.weight" for i in range(TENSORS))),
    ),
    "lora": (
        "lora_k2.safetensors",
        lambda p: add_empty_tensors(p, (f"m{i // 2}.lora_{'AB'[i % 2]}" for i in range(TENSORS))),
    ),
    "owners": ("prerouter_k2.safetensors", lambda p: add_empty_tensors(p, (), owners=TENSORS)),
}

# Runs each bombed model in one process and prints its status and peak memory, MB.
PEAK = textwrap.dedent(
    """
    import resource, sys
    from edge0_tui.cli import main
    for model in sys.argv[1:]:
        status = main(["generate", model, "--prompt", "x", "--max-tokens", "1",
                       "--mode", "prerouter", "--k", "2"])
        print(f"status {status}", file=sys.stderr, flush=True)
    print(f"peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}", file=sys.stderr)
    """
)


def _limited(memory: int, file_size: int):
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))

    return limit


def test_tensor_bombs_are_refused_in_bounded_memory(checkpoint_dir, tmp_path):
    source = tmp_path / "source"
    shutil.copytree(checkpoint_dir("qwen3_moe"), source)
    write_random_profile(source, 2)
    models = []
    for kind, (name, bomb) in BOMBS.items():
        model = tmp_path / kind
        shutil.copytree(source, model)
        bomb(model / name)
        models.append(model)
    out = subprocess.run(
        [sys.executable, "-c", PEAK, *map(str, models)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        preexec_fn=_limited(8 << 30, 64 << 20),
    )
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    results = [lines[i : i + 2] for i in range(0, 2 * len(models), 2)]
    for model, (kind, (name, _)), (error, status) in zip(models, BOMBS.items(), results):
        assert status == "status 2", (kind, out.stderr)
        assert error.startswith(f"edge0: error: {model / name}: "), (kind, error)
        assert (
            "more than this file can need" in error
            or "too long" in error
            or ("larger than this file can need" in error)
        ), (kind, error)
    peak = int(lines[-1].split()[1])
    assert peak < 400, out.stderr  # MB; an intact model takes about 150 here, the bombs took GBs


def test_expert_width_above_the_dimension_limit(checkpoint_dir, tmp_path):
    """A process of its own, limited: before, this width wrote until it was killed."""
    out = subprocess.run(
        [sys.executable, "-m", "edge0_tui.cli", "synth", str(tmp_path / "wide"), "--from",
         str(checkpoint_dir("qwen3_moe")), "--expert-width", "2147483648"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
        preexec_fn=_limited(8 << 30, 64 << 20),
    )  # fmt: skip
    assert_refused(out, None, "--expert-width 2147483648 is above 2147483647")
    assert not (tmp_path / "wide").exists()


def test_expert_width_beyond_the_free_disk(checkpoint_dir, tmp_path, monkeypatch):
    free = shutil.disk_usage(tmp_path)._replace(free=1 << 20)
    monkeypatch.setattr(wall.shutil, "disk_usage", lambda path: free)
    out_dir = tmp_path / "wide"
    out = run_cli(
        "synth", str(out_dir), "--from", str(checkpoint_dir("qwen3_moe")), "--expert-width", "1024"
    )
    assert_refused(out, out_dir, "--expert-width 1024 makes a checkpoint of", "only 1.00 MiB")
    assert not out_dir.exists()


def test_text_is_read_only_as_far_as_it_is_used(tmp_path):
    sparse = tmp_path / "sparse.txt"
    with open(sparse, "wb") as f:
        f.write(b"hello ")
        f.truncate(256 << 20)  # 256 MB of NULs, no disk
    assert read_text(sparse, max_chars=1000) == "hello " + "\0" * 994


def test_train_heads_reads_only_the_text_it_encodes(checkpoint_dir, tmp_path):
    """The bytes after what --max-tokens encodes are not read, so not decoded either."""
    text = tmp_path / "corpus.txt"
    text.write_bytes(b"the king sleeps and the fool sings. " * 1000 + b"\xff" * 100)
    out = run_cli(
        "train", "heads", str(checkpoint_dir("qwen3_moe")), "--k", "2", "--text", str(text),
        "--max-tokens", "200", "--steps", "1", "--window", "16", "--adapters", str(tmp_path / "a"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
