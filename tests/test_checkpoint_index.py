"""The checkpoint index finds every expert's bytes, and refuses broken files with a clear error."""

from __future__ import annotations

import json
import shutil
import struct

import mlx.core as mx
import numpy as np
import pytest
from safetensors import deserialize

from engine.checkpoint.index import CheckpointIndex, read_safetensors_header
from engine.config import EngineConfig
from engine.errors import Edge0Error
from engine.experts.reads import ExpertReader, to_mlx
from engine.runtime.generation import Engine


def _library_tensors(index: CheckpointIndex) -> dict[str, np.ndarray]:
    """Every tensor's raw bytes as the `safetensors` library reads them, shaped [rows, bytes/row]."""
    tensors = {}
    for shard in index.shards:
        for name, info in deserialize(shard.read_bytes()):
            raw = np.frombuffer(bytes(info["data"]), dtype=np.uint8)
            tensors[name] = raw.reshape(info["shape"][0], -1) if info["shape"] else raw
    return tensors


def _raw(array: mx.array) -> np.ndarray:
    """The bytes of an MLX array (bf16 included)."""
    return np.frombuffer(memoryview(array.view(mx.uint8).reshape(-1)), dtype=np.uint8)


def _indexed(model_dir) -> CheckpointIndex:
    engine = Engine(model_dir, EngineConfig(mode="on-demand"))
    engine.close()
    return engine.loaded.index


def test_expert_bytes_equal_safetensors_slices(checkpoint_dir, family):
    index = _indexed(checkpoint_dir(family))
    library = _library_tensors(index)
    reader = ExpertReader(index, threads=2)
    try:
        assert index.layers, "no MoE layers registered"
        for layer, layer_experts in index.layers.items():
            assert len(layer_experts.tensors) == 9  # gate/up/down x weight/scales/biases
            for expert in (0, 5, layer_experts.num_experts - 1):
                read = to_mlx(reader.submit_expert(layer, expert).result(), float_dtype=None)
                for tensor in layer_experts.tensors:
                    ours = read[f"{tensor.projection}.{tensor.part}"]
                    assert ours.shape == tensor.expert_shape
                    reference = library[tensor.entry.name][expert]
                    assert np.array_equal(_raw(ours), reference), tensor.entry.name
    finally:
        reader.close()


def test_whole_layer_read_equals_stacked_tensor(checkpoint_dir):
    index = _indexed(checkpoint_dir("qwen3_moe"))
    library = _library_tensors(index)
    reader = ExpertReader(index, threads=2)
    try:
        layer = min(index.layers)
        result = reader.submit_layer(layer).result()
        assert result.nbytes == index.layers[layer].nbytes
        arrays = to_mlx(result, float_dtype=None)
        for tensor in index.layers[layer].tensors:
            ours = arrays[f"{tensor.projection}.{tensor.part}"]
            assert ours.shape == tensor.entry.shape
            assert np.array_equal(_raw(ours), library[tensor.entry.name].reshape(-1))
    finally:
        reader.close()


def _write_raw(path, header: bytes, data: bytes = b"", declared: int | None = None) -> None:
    length = len(header) if declared is None else declared
    path.write_bytes(struct.pack("<Q", length) + header + data)


@pytest.mark.parametrize(
    "case, expect",
    [
        ("short", "shorter than 8 bytes"),
        ("absurd length", "corrupt safetensors header"),
        ("bad json", "invalid JSON"),
        ("not object", "not a JSON object"),
        ("out of range", "truncated download"),
        ("overlap", "overlap"),
        ("size mismatch", "needs"),
        ("bad dtype", "unsupported dtype"),
    ],
)
def test_corrupt_headers_name_the_file(tmp_path, case, expect):
    path = tmp_path / "model.safetensors"
    tensor = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    if case == "short":
        path.write_bytes(b"abc")
    elif case == "absurd length":
        _write_raw(path, b"{}", declared=1 << 60)
    elif case == "bad json":
        _write_raw(path, b"{not json")
    elif case == "not object":
        _write_raw(path, b"[1, 2]")
    elif case == "out of range":
        _write_raw(path, json.dumps({"a": tensor}).encode(), b"\0" * 8)
    elif case == "overlap":
        b = dict(tensor, data_offsets=[8, 24])
        _write_raw(path, json.dumps({"a": tensor, "b": b}).encode(), b"\0" * 24)
    elif case == "size mismatch":
        bad = dict(tensor, shape=[3, 2])
        _write_raw(path, json.dumps({"a": bad}).encode(), b"\0" * 16)
    elif case == "bad dtype":
        bad = dict(tensor, dtype="F8_E9")
        _write_raw(path, json.dumps({"a": bad}).encode(), b"\0" * 16)
    with pytest.raises(Edge0Error, match=expect) as info:
        read_safetensors_header(path)
    assert str(path) in str(info.value)


def test_valid_header_parses(tmp_path):
    path = tmp_path / "model.safetensors"
    header = {
        "__metadata__": {"format": "mlx"},
        "a": {"dtype": "BF16", "shape": [3, 4], "data_offsets": [0, 24]},
    }
    raw = json.dumps(header).encode()
    _write_raw(path, raw, bytes(range(24)))
    entries = read_safetensors_header(path)
    assert list(entries) == ["a"]
    assert entries["a"].offset == 8 + len(raw)
    assert entries["a"].nbytes == 24
    assert np.frombuffer(path.read_bytes()[entries["a"].offset :], dtype=np.uint8)[0] == 0


def test_shape_not_matching_config_is_refused(checkpoint_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint_dir("qwen3_moe"), broken)
    config = json.loads((broken / "config.json").read_text())
    config["moe_intermediate_size"] *= 2
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(Edge0Error, match="does not match config.json"):
        Engine(broken, EngineConfig())


def test_unsupported_family_lists_supported(checkpoint_dir, tmp_path):
    broken = tmp_path / "llama"
    shutil.copytree(checkpoint_dir("qwen3_moe"), broken)
    config = json.loads((broken / "config.json").read_text())
    config["model_type"] = "llama"
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(Edge0Error, match="qwen3_moe, qwen3_next, qwen3_5_moe, bailing_moe"):
        Engine(broken, EngineConfig())


def test_missing_shard_is_named(checkpoint_dir, tmp_path):
    broken = tmp_path / "missing"
    shutil.copytree(checkpoint_dir("qwen3_moe"), broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(Edge0Error, match="missing"):
        Engine(broken, EngineConfig())
