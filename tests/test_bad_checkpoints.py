"""Broken checkpoints: the same contract as test_bad_inputs.py (exit status 2, one `edge0: error:`
line naming the file and the problem, no traceback, the user's files unchanged) for config sizes,
files that are not regular files, stray shards, NaN weights, tokenizer files and chat templates;
shards the index does not list, a directory that cannot be listed, and the warning of a reply that
needed the numerical guard.

Commands run in this process, seen as a subprocess would see them (`cli_runner`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import pytest
from adapters import copy_model
from cli_runner import run_cli
from test_bad_inputs import (
    INDEX,
    LORA,
    PREROUTER,
    SHARD,
    assert_refused,
    edit_adapter,
    edit_config,
    snapshot,
)

from engine import Edge0Error, EngineConfig
from engine.checkpoint.index import checkpoint_shards
from engine.runtime import chat_template as template_bound
from engine.runtime.generation import Engine

NORM = "model.norm.weight"
ROUTER_SCALES = "model.layers.1.mlp.gate.scales"
# Nested loops of 10**10 iterations in all: a template that would never finish.
LOOPS = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
HUGE_OUTPUT = "{% for i in range(99999) %}{{ 'abcdefgh' * 1000 }}{% endfor %}"
# One operation each, in C, that no trace function can interrupt: 10 GB of string, a 300 Mbit number.
HUGE_REPEAT = "{{ 'a' * 10**10 }}"
HUGE_POWER = "{{ 10**100000000 }}"


# -- ways to break a copy ---------------------------------------------------------------------------


def set_tensor(name: str, value: float, file: str = SHARD):
    """Set every value of one tensor of a safetensors file (metadata kept)."""

    def edit(model: Path) -> None:
        arrays, meta = mx.load(str(model / file), return_metadata=True)
        arrays[name] = mx.full(arrays[name].shape, value, arrays[name].dtype)
        mx.save_safetensors(str(model / file), arrays, metadata=meta)

    return edit


def poison_first(suffix: str, value: float = float("nan")):
    """Set the first tensor of an adapter file whose name ends with `suffix` to `value`."""

    def edit(arrays: dict) -> dict:
        name = sorted(k for k in arrays if k.endswith(suffix))[0]
        arrays[name] = mx.full(arrays[name].shape, value, arrays[name].dtype)
        return arrays

    return edit


def replace_with_fifo(name: str):
    def edit(model: Path) -> None:
        (model / name).unlink(missing_ok=True)
        os.mkfifo(model / name)

    return edit


def replace_with_link(name: str, target: str):
    def edit(model: Path) -> None:
        (model / name).unlink()
        (model / name).symlink_to(target)

    return edit


def replace_with_directory(name: str):
    def edit(model: Path) -> None:
        (model / name).unlink()
        (model / name).mkdir()

    return edit


def replace_model_with(kind: str):
    """The model directory itself replaced by a file, a FIFO or a symlink loop."""

    def edit(model: Path) -> None:
        shutil.rmtree(model)
        if kind == "file":
            model.write_text("{}")
        elif kind == "FIFO":
            os.mkfifo(model)
        else:
            model.symlink_to(model.name)

    return edit


def duplicate_without_index(model: Path) -> None:
    """No index, and a second shard that holds a tensor the first one has too."""
    (model / INDEX).unlink()
    mx.save_safetensors(str(model / "model-00002.safetensors"), {NORM: mx.zeros((64,))})


def edit_json(name: str, **changes):
    def edit(model: Path) -> None:
        data = json.loads((model / name).read_text())
        data.update(changes)
        (model / name).write_text(json.dumps(data))

    return edit


def chat_template(template: str):
    return edit_json("tokenizer_config.json", chat_template=template)


def edit_text_config(**changes):
    def edit(model: Path) -> None:
        config = json.loads((model / "config.json").read_text())
        config["text_config"].update(changes)
        (model / "config.json").write_text(json.dumps(config))

    return edit


@dataclass(frozen=True)
class Case:
    id: str
    breaks: Callable[[Path], None]
    where: str  # the file the message must name, relative to the model ("" is the directory)
    problem: tuple[str, ...]  # parts of the message that say what is wrong
    adapters: bool = False  # the copy has K=2 adapters and runs in prerouter mode
    command: str = "info"
    family: str = "qwen3_moe"
    chat: bool = False
    # The chat template's time bound for this case, shorter than the product's 5 s so the case
    # that never ends is cut sooner (its message is what is checked, not the bound's length).
    template_seconds: float | None = None


CASES = [
    # 1 and 7: config.json sizes, checked against the tensors before mlx-lm builds anything.
    Case(
        "a hundred million layers",
        lambda m: edit_config(m, num_hidden_layers=100_000_000),
        "config.json",
        ("num_hidden_layers=100000000", "tensors hold 4 layers"),
    ),
    Case(
        "a hundred million layers (generate)",
        lambda m: edit_config(m, num_hidden_layers=100_000_000),
        "config.json",
        ("num_hidden_layers=100000000",),
        command="generate",
    ),
    Case(
        "fewer layers than the weights",
        lambda m: edit_config(m, num_hidden_layers=3),
        "config.json",
        ("num_hidden_layers=3", "tensors hold 4 layers"),
    ),
    Case(
        "hidden size not the norm's",
        lambda m: edit_config(m, hidden_size=65),
        "config.json",
        ("hidden_size=65", f"{NORM!r} has 64 values"),
    ),
    Case(
        "vocabulary not the embedding's",
        lambda m: edit_config(m, vocab_size=1000),
        "config.json",
        ("vocab_size=1000", "'model.embed_tokens.weight' has 1024 rows"),
    ),
    Case(
        "expert count not the router's",
        lambda m: edit_config(m, num_experts=17),
        "config.json",
        ("num_experts=17", "has 16 rows (experts)"),
    ),
    Case(
        "a billion attention heads",
        lambda m: edit_config(m, num_attention_heads=10**9),
        "config.json",
        ("num_attention_heads=1000000000", "larger than any tensor dimension"),
    ),
    Case(
        "a billion key-value heads, written 1e9",
        lambda m: edit_config(m, num_key_value_heads=1e9),
        "config.json",
        ("num_key_value_heads=1000000000.0 is not an integer",),
    ),
    Case(
        "heads times head_dim past every tensor",
        lambda m: edit_config(m, num_attention_heads=200),
        "config.json",
        ("num_attention_heads x head_dim = 6400", "the largest is 1024"),
    ),
    Case(
        "negative vocabulary",
        lambda m: edit_config(m, vocab_size=-5),
        "config.json",
        ("vocab_size=-5 must be at least 1",),
    ),
    Case(
        "layers in text_config",
        edit_text_config(num_hidden_layers=100_000_000),
        "config.json",
        ("text_config.num_hidden_layers=100000000",),
        family="qwen3_5_moe",
    ),
    # 7, the class: config numbers that are no size but that mlx-lm uses as given.
    Case(
        "rope_theta a string",
        lambda m: edit_config(m, rope_theta="x"),
        "config.json",
        ("rope_theta='x' must be a finite number above 0",),
        command="generate",
    ),
    Case(
        "rope_theta zero",
        lambda m: edit_config(m, rope_theta=0),
        "config.json",
        ("rope_theta=0 must be a finite number above 0",),
    ),
    Case(
        "rms_norm_eps null",
        lambda m: edit_config(m, rms_norm_eps=None),
        "config.json",
        ("rms_norm_eps=None must be a finite number above 0",),
    ),
    Case(
        "context length a float",
        lambda m: edit_config(m, max_position_embeddings=4096.0),
        "config.json",
        ("max_position_embeddings=4096.0 is not a positive integer",),
    ),
    # Also: a field transformers validates when it loads the tokenizer names config.json.
    Case(
        "rope_scaling without its factor",
        lambda m: edit_config(m, rope_scaling={"type": "yarn"}),
        "config.json",
        ("transformers refuses it", "'factor'"),
    ),
    Case(
        "eos_token_id a string",
        lambda m: edit_config(m, eos_token_id="x"),
        "config.json",
        ("transformers refuses it", "eos_token_id"),
    ),
    # 3: files that are not regular files are refused by name, before anything opens them.
    Case("shard is a FIFO", replace_with_fifo(SHARD), SHARD, ("a FIFO",), command="generate"),
    Case("config is a FIFO", replace_with_fifo("config.json"), "config.json", ("a FIFO",)),
    Case(
        "tokenizer config is a FIFO",
        replace_with_fifo("tokenizer_config.json"),
        "tokenizer_config.json",
        ("a FIFO",),
    ),
    Case(
        "chat template file is a FIFO",
        replace_with_fifo("chat_template.jinja"),
        "chat_template.jinja",
        ("a FIFO",),
    ),
    Case("index is a FIFO", replace_with_fifo(INDEX), INDEX, ("a FIFO",)),
    Case(
        "shard is a symlink loop",
        replace_with_link(SHARD, SHARD),
        SHARD,
        ("a symlink loop",),
        command="generate",
    ),
    Case(
        "config is a symlink loop",
        replace_with_link("config.json", "config.json"),
        "config.json",
        ("a symlink loop",),
    ),
    Case("index is a symlink loop", replace_with_link(INDEX, INDEX), INDEX, ("a symlink loop",)),
    Case(
        "tokenizer is a dangling symlink",
        replace_with_link("tokenizer.json", "nowhere.json"),
        "tokenizer.json",
        ("a symlink to a file that does not exist",),
    ),
    Case(
        "shard is a device",
        replace_with_link(SHARD, "/dev/zero"),
        SHARD,
        ("a character device",),
    ),
    Case("shard is a directory", replace_with_directory(SHARD), SHARD, ("a directory",)),
    Case("model is a file", replace_model_with("file"), "", ("a file, not a directory",)),
    Case(
        "model is a FIFO",
        replace_model_with("FIFO"),
        "",
        ("a FIFO (named pipe), not a directory",),
        command="generate",
    ),
    Case("model is a symlink loop", replace_model_with("loop"), "", ("a symlink loop",)),
    Case(
        "prerouter is a FIFO",
        replace_with_fifo(PREROUTER),
        PREROUTER,
        ("a FIFO",),
        adapters=True,
        command="generate",
    ),
    # 4: without an index, two shards may not both hold a tensor.
    Case(
        "tensor in two shards without an index",
        duplicate_without_index,
        SHARD,
        (f"{NORM!r} also appears in", "model-00002.safetensors"),
    ),
    # 11: NaN or infinity in a resident small tensor or an adapter file.
    Case("NaN in a norm", set_tensor(NORM, float("nan")), SHARD, (NORM, "NaN or infinite")),
    Case(
        "infinity in a router",
        set_tensor(ROUTER_SCALES, float("inf")),
        SHARD,
        (ROUTER_SCALES, "NaN or infinite"),
        command="generate",
    ),
    Case(
        "NaN in a prerouter head",
        lambda m: edit_adapter(m / PREROUTER, poison_first("fc2.weight")),
        PREROUTER,
        ("fc2.weight", "NaN or infinite"),
        adapters=True,
        command="generate",
    ),
    Case(
        "infinity in a LoRA",
        lambda m: edit_adapter(m / LORA, poison_first("lora_B", float("inf"))),
        LORA,
        ("lora_B", "NaN or infinite"),
        adapters=True,
        command="generate",
    ),
    Case(
        "NaN in the output head's scales",
        set_tensor("lm_head.scales", float("nan")),
        SHARD,
        ("lm_head.scales", "NaN or infinite"),
        command="generate",
    ),
    Case(
        "infinity in the embedding's biases",
        set_tensor("model.embed_tokens.biases", float("inf")),
        SHARD,
        ("model.embed_tokens.biases", "NaN or infinite"),
    ),
    # Tokenizer files: the message names the file and what is wrong with it.
    Case(
        "tokenizer.json without its parts",
        lambda m: (m / "tokenizer.json").write_text("{}"),
        "tokenizer.json",
        ("cannot load the tokenizer", "'model' is missing"),
    ),
    Case(
        "tokenizer.json not UTF-8",
        lambda m: (m / "tokenizer.json").write_bytes(b"\xff\xfe"),
        "tokenizer.json",
        ("cannot load the tokenizer", "invalid JSON"),
    ),
    Case(
        "added_tokens_decoder not an object",
        edit_json("tokenizer_config.json", added_tokens_decoder=5),
        "tokenizer_config.json",
        ("added_tokens_decoder=5 is not a JSON object",),
    ),
    Case(
        "eos_token a number",
        edit_json("tokenizer_config.json", eos_token=5),
        "tokenizer_config.json",
        ("eos_token=5 is not a string",),
    ),
    Case(
        "special token a number in the special tokens map",
        lambda m: (m / "special_tokens_map.json").write_text('{"eos_token": 5}'),
        "special_tokens_map.json",
        ("eos_token=5 is not a string",),
    ),
    Case(
        "special tokens map not an object",
        lambda m: (m / "special_tokens_map.json").write_text("[1]"),
        "special_tokens_map.json",
        ("expected a JSON object",),
    ),
    # 12: a chat template is bounded in time and in output.
    Case(
        "chat template that never ends",
        chat_template(LOOPS),
        "",
        ("the chat template ran for more than",),
        command="generate",
        chat=True,
        template_seconds=1.0,
    ),
    Case(
        "chat template with a huge output",
        chat_template(HUGE_OUTPUT),
        "",
        ("the chat template renders more than",),
        command="generate",
        chat=True,
    ),
    Case(
        "chat template repeating a string 10**10 times",
        chat_template(HUGE_REPEAT),
        "",
        ("the chat template renders more than",),
        command="generate",
        chat=True,
    ),
    Case(
        "chat template computing a huge power",
        chat_template(HUGE_POWER),
        "",
        ("the chat template computes a number of more than",),
        command="generate",
        chat=True,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_clear_line(case, checkpoint_dir, profiled_source, tmp_path, monkeypatch):
    if case.template_seconds is not None:
        monkeypatch.setattr(template_bound, "CHAT_TEMPLATE_SECONDS", case.template_seconds)
    source = profiled_source if case.adapters else checkpoint_dir(case.family)
    model = copy_model(source, tmp_path)
    case.breaks(model)
    before = snapshot(model)
    args = [case.command, str(model)]
    if case.command == "generate":
        args += ["--prompt", "x", "--max-tokens", "2"]
        args += ["--mode", "prerouter", "--k", "2"] if case.adapters else []
        args += ["--chat"] if case.chat else []
    out = run_cli(*args)
    assert_refused(out, model / case.where if case.where else model, *case.problem)
    assert snapshot(model) == before  # nothing the user had was changed or removed


# -- 4: a shard the index does not list is never read, and the user is told -------------------------


@pytest.mark.parametrize("stray", ["valid", "corrupt"])
def test_shard_outside_the_index_is_ignored_with_a_warning(checkpoint_dir, tmp_path, stray):
    model = copy_model(checkpoint_dir("qwen3_moe"), tmp_path)
    args = ["generate", str(model), "--prompt", "hello", "--max-tokens", "6", "--json"]
    clean = run_cli(*args)
    assert clean.returncode == 0, clean.stderr
    extra = model / "model-00002.safetensors"
    if stray == "valid":  # a norm of 5s would change every token
        mx.save_safetensors(str(extra), {NORM: mx.full((64,), 5.0, mx.bfloat16)})
    else:
        extra.write_bytes(b"\x10" + bytes(7) + b"{}")
    out = run_cli(*args)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["tokens"] == json.loads(clean.stdout)["tokens"]
    warning = f"edge0: warning: {model}: model-00002.safetensors is not listed in {INDEX}"
    assert warning in out.stderr
    info = run_cli("info", str(model), "--json")
    assert info.returncode == 0, info.stderr
    assert "model-00002.safetensors is not listed" in json.loads(info.stdout)["warnings"][0]
    assert warning in info.stderr


def test_engine_loads_only_the_listed_shards(checkpoint_dir, tmp_path, monkeypatch):
    """mlx-lm globs model*.safetensors itself: the engine hands it the listed shards only."""
    model = copy_model(checkpoint_dir("qwen3_moe"), tmp_path)
    mx.save_safetensors(str(model / "model-00002.safetensors"), {NORM: mx.zeros((64,))})
    loaded_files = []
    real_load = mx.load

    def spy(path, *args, **kwargs):
        loaded_files.append(os.path.realpath(path))
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(mx, "load", spy)
    with Engine(model, EngineConfig()) as engine:
        assert float(engine.model.model.norm.weight[0]) != 0.0
    assert os.path.realpath(model / "model-00002.safetensors") not in loaded_files


# -- 9: a directory that cannot be listed ----------------------------------------------------------


def _unlistable(monkeypatch, directory: Path) -> None:
    """Make listing `directory` fail as it does for a non-root user with mode 311 (tests run as
    root, which may list anything)."""
    real_scandir = os.scandir

    def scandir(path="."):
        if Path(path) == directory:
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)


@pytest.mark.parametrize("with_index", [True, False])
def test_unlistable_model_directory(checkpoint_dir, tmp_path, monkeypatch, with_index):
    model = copy_model(checkpoint_dir("qwen3_moe"), tmp_path)
    if not with_index:
        (model / INDEX).unlink()
    _unlistable(monkeypatch, model)
    with pytest.raises(Edge0Error, match=f"^{model}: cannot list the directory .Permission denied"):
        Engine(model, EngineConfig())
    if not with_index:  # not "no model*.safetensors files", which would send the user astray
        with pytest.raises(Edge0Error, match="cannot list the directory"):
            checkpoint_shards(model)


# -- 11: a reply that needed the numerical guard says so -------------------------------------------


def test_repaired_reply_warns_on_stderr(checkpoint_dir, tmp_path):
    model = copy_model(checkpoint_dir("qwen3_moe"), tmp_path)
    # Finite (so loading accepts it) but overflowing float32 once multiplied through.
    set_tensor("model.layers.0.post_attention_layernorm.weight", 3e38)(model)
    out = run_cli("generate", str(model), "--prompt", "hello world", "--max-tokens", "2")
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    warning = [line for line in out.stderr.splitlines() if line.startswith("edge0: warning:")]
    assert len(warning) == 1 and "values were repaired" in warning[0], out.stderr


def test_intact_copy_has_no_warning(checkpoint_dir, tmp_path):
    model = copy_model(checkpoint_dir("qwen3_moe"), tmp_path)
    out = run_cli("generate", str(model), "--prompt", "hello world", "--max-tokens", "2")
    assert out.returncode == 0, out.stderr
    assert "warning" not in out.stderr
