"""Training outputs lose no user data: an adapter is written whole or not at all (a failure midway
leaves the previous file and no half file), a diverged adapter never replaces a good one, and
`--out` never overwrites the model's files or a file that is not such an adapter (unless
`--force`)."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from cli_runner import REPO, run_cli
from test_bad_inputs import assert_refused, snapshot

import engine.adapters.metadata as metadata
from engine import Edge0Error
from engine.adapters.lora import save_lora

GOOD = "prerouter_k2.safetensors"


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def disk_full_halfway(monkeypatch) -> None:
    """The writer writes half of a file, then fails as a full disk does."""
    real = metadata._write_safetensors

    def save(path, tensors, meta):
        real(path, tensors, meta)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(metadata, "_write_safetensors", save)


def lora_weights(value: float = 0.5) -> dict:
    return {"model.layers.0.self_attn.q_proj": (mx.full((4, 64), value), mx.full((64, 4), value))}


def test_failed_save_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "lora_k2.safetensors"
    save_lora(path, lora_weights(), 4, 8.0, 2, "abc")
    before = digest(path)
    disk_full_halfway(monkeypatch)
    with pytest.raises(Edge0Error, match="cannot write the adapter .*No space left on device"):
        save_lora(path, lora_weights(0.25), 4, 8.0, 2, "abc")
    assert digest(path) == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left


def test_nonfinite_adapter_never_replaces_a_good_one(tmp_path):
    path = tmp_path / "lora_k2.safetensors"
    save_lora(path, lora_weights(), 4, 8.0, 2, "abc")
    before = digest(path)
    with pytest.raises(Edge0Error, match="holds NaN or infinite values .*previous file"):
        save_lora(path, lora_weights(float("nan")), 4, 8.0, 2, "abc")
    # Finite in float32 but infinite once stored as float16: the loader's check is on the file.
    with pytest.raises(Edge0Error, match="holds NaN or infinite values"):
        save_lora(path, lora_weights(1e6), 4, 8.0, 2, "abc")
    assert digest(path) == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_train_heads_disk_full_is_one_line_and_keeps_the_old_heads(
    checkpoint_dir, tmp_path, monkeypatch
):
    """Was: a truncated prerouter file where the engine loads it, a traceback, exit 1."""
    model = checkpoint_dir("qwen3_moe")
    folder = tmp_path / "adapters"
    folder.mkdir()
    (folder / GOOD).write_bytes(b"the previous heads")
    disk_full_halfway(monkeypatch)
    out = run_cli(
        "train", "heads", str(model), "--k", "2", "--steps", "1",
        "--max-tokens", "600", "--adapters", str(folder),
    )  # fmt: skip
    assert_refused(out, folder / GOOD, "cannot write the adapter", "No space left on device")
    assert (folder / GOOD).read_bytes() == b"the previous heads"
    assert sorted(p.name for p in folder.iterdir()) == [GOOD, "work"]


@pytest.mark.parametrize("target", ["model.safetensors", "config.json", "notes.txt", "lora"])
def test_out_that_is_not_such_an_adapter_is_refused(checkpoint_dir, tmp_path, target):
    """Was: `--out MODEL/model.safetensors` overwrote the model's weights."""
    model = tmp_path / "model"
    shutil.copytree(checkpoint_dir("qwen3_moe"), model)
    if target == "notes.txt":
        out_path = tmp_path / "notes.txt"
        out_path.write_text("mine")
    elif target == "lora":  # a LoRA file where heads would go
        out_path = tmp_path / "prerouter_k2.safetensors"
        save_lora(out_path, lora_weights(), 4, 8.0, 2, "abc")
    else:
        out_path = model / target
    before = snapshot(tmp_path)
    out = run_cli("train", "heads", str(model), "--k", "2", "--out", str(out_path))
    assert_refused(out, out_path, "refusing to", "--force")
    assert snapshot(tmp_path) == before


def test_out_with_force_writes(checkpoint_dir, tmp_path):
    out_path = tmp_path / "notes.txt"
    out_path.write_text("mine")
    args = ["train", "heads", str(checkpoint_dir("qwen3_moe")), "--k", "2", "--steps", "1"]
    args += ["--max-tokens", "600", "--adapters", str(tmp_path / "a"), "--out", str(out_path)]
    out = run_cli(*args, "--force")
    assert out.returncode == 0, out.stderr
    assert metadata._is_adapter(out_path, "prerouter")
    out = run_cli(*args)  # now a prerouter file: rewritten without --force
    assert out.returncode == 0, out.stderr


FILE_SIZE_LIMIT = """
import os, resource, sys
from pathlib import Path
import mlx.core as mx
from engine import Edge0Error
from engine.adapters.lora import save_lora
path = Path(sys.argv[1])
weights = lambda n: {"model.layers.0.self_attn.q_proj": (mx.full((4, n), 0.5), mx.full((n, 4), 0.5))}
save_lora(path, weights(64), 4, 8.0, 2, "abc")
good = path.read_bytes()
resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384))
try:
    save_lora(path, weights(4096), 4, 8.0, 2, "abc")
except Edge0Error as e:
    print(e)
print(path.read_bytes() == good, sorted(os.listdir(path.parent)))
"""


def test_file_size_limit_keeps_the_previous_file(tmp_path):
    """A real short write (RLIMIT_FSIZE, in a process of its own): what a full disk does."""
    path = tmp_path / "lora_k2.safetensors"
    out = subprocess.run(
        [sys.executable, "-c", FILE_SIZE_LIMIT, str(path)],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    error, result = out.stdout.strip().splitlines()
    assert error.startswith(f"{path}: cannot write the adapter"), error
    assert result == "True ['lora_k2.safetensors']"
