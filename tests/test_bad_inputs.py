"""Bad user input through the real CLI: exit code 2, one `edge0: error:` line naming the file and the
problem, no traceback, and the user's files left as they were.

Each case copies the tiny checkpoint (with random K=2 adapters for the adapter cases), breaks the
copy, and runs `edge0` on it: in this process, seen as a subprocess would see it (`cli_runner`);
one `train` case runs as the `edge0` command does (`edge0_tui.cli.entry`), in a process of its own.
"""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import pytest
from adapters import copy_model
from cli_runner import run_cli, run_process

SHARD = "model.safetensors"
INDEX = "model.safetensors.index.json"
PREROUTER = "prerouter_k2.safetensors"
LORA = "lora_k2.safetensors"
EXPERT_WEIGHT = "model.layers.0.mlp.switch_mlp.gate_proj.weight"


def snapshot(model: Path) -> dict[str, str]:
    return {
        str(p.relative_to(model)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(model.rglob("*"))
        if p.is_file()
    }


def assert_refused(out: subprocess.CompletedProcess, where: Path | None, *problem: str) -> str:
    """Exit 2, stderr exactly one `edge0: error:` line naming `where` (a file or directory; None
    where no file is at fault) and each `problem` part."""
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == 2, (out.returncode, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edge0: error: "), out.stderr
    assert where is None or str(where) in lines[0], lines[0]
    for part in problem:
        assert part in lines[0], lines[0]
    return lines[0]


# -- ways to break a copy ---------------------------------------------------------------------------


def edit_header(path: Path, edit: Callable[[dict], None]) -> None:
    """Rewrite a safetensors header in place, keeping the data bytes (offsets are data-relative)."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])


def edit_config(model: Path, **changes) -> None:
    config = json.loads((model / "config.json").read_text())
    config.update(changes)
    (model / "config.json").write_text(json.dumps(config))


def edit_adapter(path: Path, tensors=None, metadata=None) -> None:
    """Re-save an adapter file with its tensors and/or metadata changed by the given functions."""
    arrays, meta = mx.load(str(path), return_metadata=True)
    arrays = tensors(dict(arrays)) if tensors else arrays
    meta = metadata(dict(meta)) if metadata else meta
    mx.save_safetensors(str(path), arrays, metadata=meta)


def rename_tensors(old: str, new: str):
    return lambda arrays: {k.replace(old, new): v for k, v in arrays.items()}


def retarget_lora(module: str):
    """Move the LoRA of `model.layers.0.self_attn.q_proj` onto `module`."""
    old = "model.layers.0.self_attn.q_proj"
    return lambda model: edit_adapter(model / LORA, rename_tensors(old, module))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def point_index_at_missing_shard(model: Path) -> None:
    index = json.loads((model / INDEX).read_text())
    index["weight_map"]["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (model / INDEX).write_text(json.dumps(index))


def store_experts_per_expert(model: Path) -> None:
    def edit(header):
        for name in [n for n in header if n.endswith(".switch_mlp.gate_proj.weight")]:
            header[name.replace("switch_mlp.gate_proj", "experts.0.gate_proj")] = header.pop(name)

    edit_header(model / SHARD, edit)


def set_entry(name: str, **fields):
    return lambda model: edit_header(model / SHARD, lambda h: h[name].update(fields))


def overlap(header: dict) -> None:
    header["lm_head.scales"]["data_offsets"] = list(header["lm_head.biases"]["data_offsets"])


def garbage_header(model: Path) -> None:
    data = bytearray((model / SHARD).read_bytes())
    data[8:40] = b"\xff" * 32
    (model / SHARD).write_bytes(bytes(data))


def widen_first_head(arrays: dict) -> dict:
    name = sorted(k for k in arrays if k.endswith("fc1.weight"))[0]
    arrays[name] = mx.zeros((arrays[name].shape[0], arrays[name].shape[1] + 8), mx.float16)
    return arrays


def widen_first_lora(arrays: dict) -> dict:
    name = sorted(k for k in arrays if k.endswith("lora_A"))[0]
    arrays[name] = mx.zeros((arrays[name].shape[0], arrays[name].shape[1] + 64), mx.float16)
    return arrays


def move_head_outside(model: Path) -> None:
    edit_adapter(
        model / PREROUTER,
        rename_tensors("layers.2.", "layers.7."),
        lambda m: {**m, "owners": json.dumps([0, 1, 7])},
    )


def rename_profile(model: Path) -> None:
    (model / PREROUTER).rename(model / "prerouter_k3.safetensors")
    (model / LORA).rename(model / "lora_k3.safetensors")


def other_fingerprint(meta: dict) -> dict:
    return {**meta, "base_fingerprint": "0123456789abcdef"}


@dataclass(frozen=True)
class Case:
    id: str
    breaks: Callable[[Path], None]
    where: str  # the file the message must name, relative to the model ("" is the directory)
    problem: tuple[str, ...]  # parts of the message that say what is wrong
    adapters: bool = False  # the copy has K=2 adapters and runs in prerouter mode
    command: str = "generate"


CASES = [
    Case("missing config", lambda m: (m / "config.json").unlink(), "config.json", ("missing",)),
    Case(
        "missing config (info)",
        lambda m: (m / "config.json").unlink(),
        "config.json",
        ("missing",),
        command="info",
    ),
    Case(
        "invalid JSON config",
        lambda m: (m / "config.json").write_text('{"model_type": '),
        "config.json",
        ("invalid JSON",),
    ),
    Case(
        "config not an object",
        lambda m: (m / "config.json").write_text("[1, 2]"),
        "config.json",
        ("expected a JSON object",),
    ),
    Case(
        "config nested too deeply",
        lambda m: (m / "config.json").write_text("[" * 100_000),
        "config.json",
        ("nested too deeply",),
    ),
    Case(
        "unsupported family",
        lambda m: edit_config(m, model_type="llama"),
        "config.json",
        ("'llama' is not supported", "qwen3_moe"),
    ),
    Case(
        "context not a number",
        lambda m: edit_config(m, max_position_embeddings="lots"),
        "config.json",
        ("max_position_embeddings='lots'",),
    ),
    Case(
        "top-k above the experts",
        lambda m: edit_config(m, num_experts_per_tok=99),
        "config.json",
        ("num_experts_per_tok", "16 routed experts"),
    ),
    Case("missing tokenizer", lambda m: (m / "tokenizer.json").unlink(), "", ("no tokenizer",)),
    Case(
        "broken tokenizer",
        lambda m: (m / "tokenizer.json").write_text("{nope"),
        "",
        ("cannot load the tokenizer",),
    ),
    Case(
        "missing shard and index",
        lambda m: [(m / n).unlink() for n in (SHARD, INDEX)],
        "",
        ("no model*.safetensors",),
    ),
    Case(
        "missing shard",
        lambda m: (m / SHARD).unlink(),
        SHARD,
        ("shard listed in the index is missing",),
    ),
    Case(
        "index names a missing shard",
        point_index_at_missing_shard,
        "model-00002-of-00002.safetensors",
        ("shard listed in the index is missing",),
    ),
    Case(
        "index not JSON", lambda m: (m / INDEX).write_bytes(b"\xff\xfe"), INDEX, ("invalid JSON",)
    ),
    Case(
        "index names a path",
        lambda m: (m / INDEX).write_text('{"weight_map": {"a": "../x.safetensors"}}'),
        INDEX,
        ("not a shard file in this directory",),
    ),
    Case("truncated shard", lambda m: truncate(m / SHARD), SHARD, ("truncated download",)),
    Case(
        "absurd header length",
        lambda m: (m / SHARD).write_bytes(
            struct.pack("<Q", 1 << 60) + (m / SHARD).read_bytes()[8:]
        ),
        SHARD,
        ("corrupt safetensors header", "declares 1152921504606846976 header bytes"),
    ),
    Case("header not JSON", garbage_header, SHARD, ("corrupt safetensors header", "invalid JSON")),
    Case(
        "offsets out of range",
        set_entry("lm_head.weight", data_offsets=[10**9, 10**9 + 32768]),
        SHARD,
        ("'lm_head.weight' ends at byte", "truncated download"),
    ),
    Case(
        "negative offsets",
        set_entry("lm_head.weight", data_offsets=[-8, 32760]),
        SHARD,
        ("'lm_head.weight' has invalid data_offsets",),
    ),
    Case(
        "overlapping tensors",
        lambda m: edit_header(m / SHARD, overlap),
        SHARD,
        ("'lm_head.biases' and 'lm_head.scales' overlap",),
    ),
    Case(
        "offsets disagree with shape",
        set_entry("lm_head.weight", shape=[1024, 9]),
        SHARD,
        ("'lm_head.weight' is 32768 bytes on disk", "needs 36864"),
    ),
    Case(
        "unknown dtype",
        set_entry("lm_head.weight", dtype="F8_E9"),
        SHARD,
        ("unsupported dtype 'F8_E9'",),
    ),
    Case(
        "non-integer shape",
        set_entry("lm_head.weight", shape=[1024, "8"]),
        SHARD,
        ("'lm_head.weight' has an invalid shape",),
    ),
    Case(
        "expert dtype not as config",
        set_entry(EXPERT_WEIGHT, dtype="F32"),
        SHARD,
        (f"{EXPERT_WEIGHT!r} is F32 but must be U32",),
    ),
    Case(
        "dense dtype not as config",
        set_entry("model.embed_tokens.weight", dtype="I32"),
        SHARD,
        ("'model.embed_tokens.weight' is I32 but must be U32",),
    ),
    Case(
        "expert shape not as config",
        set_entry(EXPERT_WEIGHT, shape=[8, 128, 8]),
        "",
        ("does not match config.json", "(16, 64, 8)", EXPERT_WEIGHT),
    ),
    Case(
        "dense shape not as config",
        set_entry("model.embed_tokens.weight", shape=[512, 16]),
        "",
        ("does not match config.json", "model.embed_tokens.weight"),
    ),
    Case(
        "experts stored per expert",
        store_experts_per_expert,
        SHARD,
        ("holds one routed expert", "python -m mlx_lm convert"),
    ),
    # Adapters (prerouter mode, K=2).
    Case(
        "prerouter for another model",
        lambda m: edit_adapter(m / PREROUTER, metadata=other_fingerprint),
        PREROUTER,
        ("trained for another base model",),
        adapters=True,
    ),
    Case(
        "LoRA for another model",
        lambda m: edit_adapter(m / LORA, metadata=other_fingerprint),
        LORA,
        ("trained for another base model",),
        adapters=True,
    ),
    Case(
        "prerouter shape for another model",
        lambda m: edit_adapter(m / PREROUTER, widen_first_head),
        PREROUTER,
        ("fc1 of layer 0 of shape [32, 104] does not fit this model",),
        adapters=True,
    ),
    Case(
        "LoRA shape for another model",
        lambda m: edit_adapter(m / LORA, widen_first_lora),
        LORA,
        ("is 64->64 but the adapter is 128->64",),
        adapters=True,
    ),
    Case(
        "head owners outside the layers",
        move_head_outside,
        PREROUTER,
        ("owner layers [7] are outside 0..2",),
        adapters=True,
    ),
    Case(
        "K in metadata contradicts the name",
        rename_profile,
        "prerouter_k3.safetensors",
        ("the file name says K=3 but its metadata says K=2",),
        adapters=True,
    ),
    Case(
        "LoRA target does not exist",
        retarget_lora("model.layers.0.self_attn.zz_proj"),
        LORA,
        ("target 'model.layers.0.self_attn.zz_proj' does not exist",),
        adapters=True,
    ),
    Case(
        "LoRA target past the last layer",
        retarget_lora("model.layers.99.self_attn.q_proj"),
        LORA,
        ("target 'model.layers.99.self_attn.q_proj' does not exist",),
        adapters=True,
    ),
    Case(
        "LoRA target not a linear layer",
        retarget_lora("model.layers.0.self_attn.q_norm"),
        LORA,
        ("is not a linear layer (RMSNorm)",),
        adapters=True,
    ),
    Case(
        "LoRA tensor with a bad name",
        lambda m: edit_adapter(m / LORA, rename_tensors("q_proj.lora_A", "q_proj.lora_C")),
        LORA,
        ("unexpected tensor", "lora_C"),
        adapters=True,
    ),
    Case(
        "truncated prerouter",
        lambda m: truncate(m / PREROUTER),
        PREROUTER,
        ("truncated download",),
        adapters=True,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_clear_line(case, checkpoint_dir, profiled_source, tmp_path):
    model = copy_model(profiled_source if case.adapters else checkpoint_dir("qwen3_moe"), tmp_path)
    case.breaks(model)
    before = snapshot(model)
    args = [case.command, str(model)]
    if case.command == "generate":
        args += ["--prompt", "x", "--max-tokens", "2"]
        args += ["--mode", "prerouter", "--k", "2"] if case.adapters else []
    out = run_cli(*args)
    where = model / case.where if case.where else model
    assert_refused(out, where, *case.problem)
    assert snapshot(model) == before  # nothing the user had was changed or removed


def test_intact_copies_run(checkpoint_dir, profiled_source, tmp_path):
    """The breakages above are what fails: the unbroken copies generate."""
    model = copy_model(profiled_source, tmp_path)
    args = ["--prompt", "x", "--max-tokens", "2", "--json"]
    for extra in ([], ["--mode", "prerouter", "--k", "2"]):
        out = run_cli("generate", str(model), *args, *extra)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["k"] == (2 if extra else 4)


def test_expert_cache_below_one_layer_says_the_minimum(checkpoint_dir):
    model = checkpoint_dir("qwen3_moe")
    out = run_cli("generate", str(model), "--prompt", "x", "--expert-cache", "1K")
    # The --expert-cache value, not a file, is at fault.
    line = assert_refused(out, model, "expert cache of 1.00 KiB", "the minimum is")
    minimum = int(line.split("(")[-1].split()[0])  # "... the minimum is 30.00 KiB (30720 bytes)"
    out = run_cli(
        "generate", str(model), "--prompt", "x", "--max-tokens", "1", "--expert-cache", str(minimum)
    )
    assert out.returncode == 0, out.stderr


def test_prompt_longer_than_the_context(checkpoint_dir, tmp_path):
    model = copy_model(checkpoint_dir("qwen3_moe"), tmp_path)
    edit_config(model, max_position_embeddings=8)
    out = run_cli("generate", str(model), "--prompt", "x " * 40, "--max-tokens", "2")
    # The prompt is at fault; the limit comes from config.json (which the message does not name).
    assert_refused(out, None, "tokens plus 2 new tokens exceeds the model's context of 8")


@pytest.mark.parametrize("text", ["missing", "latin-1"])
def test_train_heads_text_unreadable(checkpoint_dir, tmp_path, text):
    path = tmp_path / "corpus.txt"
    if text == "latin-1":
        path.write_bytes("café crème\n".encode("latin-1"))
    model = checkpoint_dir("qwen3_moe")
    # One through `entry` in a process of its own (which re-executes itself with a fast BLAS).
    run = run_process if text == "latin-1" else run_cli
    out = run("train", "heads", str(model), "--k", "2", "--text", str(path), "--steps", "1")
    problem = "No such file" if text == "missing" else "can't decode byte 0xe9"
    assert_refused(out, path, "cannot read text", problem)
    assert not list(model.glob("prerouter_k2*"))  # nothing was written next to the model
