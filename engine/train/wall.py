"""A memory wall with real routing: a trained checkpoint whose routed experts are zero-padded wider.

Random-weight checkpoints (`synth.py`) route most tokens to a few experts, so once the pool warms
their loads per step collapse; a trained model spreads its routing like a real one. `pad_experts`
copies a trained mlx-lm checkpoint whose routed experts are affine-quantized and widens every expert
to `width` intermediate units (`moe_intermediate_size`), so each expert is as large as a big model's
(at width 6144 the demo's experts are as large as a 30B model's), while the
model computes the same function:

- gate_proj and up_proj get `width - I` more output rows whose packed weights, scales and biases
  are all zero: they dequantize to exactly 0, so both projections yield 0 there and
  `silu(0) * 0 = 0`;
- down_proj gets the matching input columns as whole quantization groups with scale 0 and bias 0:
  weights of exactly 0, which multiply those zeros.

Everything else (attention, norms, routers, embeddings, tokenizer files) is copied byte for byte.
The tensors are streamed one expert at a time into shards of at most `synth.MAX_SHARD_BYTES`, so the
padded model is never in memory. Adapter files (`prerouter_k*`, `lora_k*`) are copied and re-stamped
with the padded base's fingerprint (see `_restamp`).
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..adapters.metadata import flat_metadata, read_adapter_header
from ..checkpoint.families import family_of
from ..checkpoint.index import (
    DTYPE_SIZES,
    MAX_DIM,
    CheckpointIndex,
    TensorEntry,
    base_fingerprint,
)
from ..config import format_bytes
from ..errors import Edge0Error
from ..runtime.loader import read_config
from .synth import MARKER_FILE, MAX_SHARD_BYTES, natural_key, plan_shards

# A routed expert's stacked tensor: `<block>.switch_mlp.<projection>.<part>`, experts outermost.
EXPERT_TENSOR = re.compile(
    r"^(.*\.switch_mlp)\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases|bias)$"
)
LAYER = re.compile(r"layers\.(\d+)\.")
# Families where moe_intermediate_size sizes the routed experts and nothing else (Bailing's shared
# experts default to it: the padded config pins their width). DeepSeek-V3, GLM-4.5 and ERNIE size
# shared experts as a multiple of it; Mixtral, gpt-oss, Llama-4, MiniMax and OLMoE name the experts'
# width intermediate_size, which Llama-4's shared expert shares.
# The largest padded expert slice written (one is in memory at a time, twice while padded): far
# above any real model's expert, far below a machine's memory.
MAX_EXPERT_SLICE_BYTES = 1 << 30
PADDABLE_FAMILIES = ("qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen2_moe", "bailing_moe")
ADAPTER_PATTERNS = ("prerouter_k*.safetensors", "lora_k*.safetensors")
# What the writer owns in an output directory (stale copies are deleted before a rewrite).
WRITTEN_PATTERNS = ("model*.safetensors", "model.safetensors.index.json", *ADAPTER_PATTERNS)
# Not copied from the source: rewritten here, or a marker of another writer.
NOT_COPIED = ("config.json", "model*.safetensors", "model.safetensors.index.json", MARKER_FILE)
COPY_CHUNK_BYTES = 64 << 20
# Unsigned integers of each element size: any dtype is padded by its bit pattern, and an all-zero
# bit pattern is 0 in every integer and floating dtype.
_UINTS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass(frozen=True)
class WallReport:
    out_dir: Path
    width_before: int
    width_after: int
    expert_bytes_before: int  # all routed-expert tensors
    expert_bytes_after: int
    shards: int
    restamped: tuple[str, ...]  # adapter files now stamped for the padded base
    copied_unchanged: tuple[str, ...]  # adapter files stamped for another base: still refused


@dataclass(frozen=True)
class _Planned:
    """One output tensor: where its bytes come from and how they are padded."""

    entry: TensorEntry
    shape: tuple[int, ...]
    pad_axis: int | None  # axis of one expert's slice to zero-pad; None: copied as is

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.entry.dtype]


def pad_experts(
    model_dir: str | Path,
    out_dir: str | Path,
    width: int,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> WallReport:
    """Write into `out_dir` a copy of `model_dir` whose routed experts have intermediate width
    `width` (zero-padded), computing the same function; return what was written."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config_file = model_dir / "config.json"
    config = read_config(model_dir)  # the engine's checks: regular file, JSON object, sizes
    family = family_of(config, str(config_file))
    if family.name not in PADDABLE_FAMILIES:
        raise Edge0Error(
            f"{config_file}: {family.name}: only families whose routed experts alone are sized by "
            "moe_intermediate_size can be padded (" + ", ".join(PADDABLE_FAMILIES) + "); in others "
            "the field also sizes shared experts or dense layers, or is named otherwise"
        )
    sizes = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    before = sizes.get("moe_intermediate_size")
    if type(before) is not int or before < 1:
        raise Edge0Error(f"{config_file}: no moe_intermediate_size to widen")
    if type(width) is not int or width < before:
        raise Edge0Error(
            f"--expert-width {width} is narrower than the experts' width {before} in {config_file}"
        )
    if width > MAX_DIM:
        raise Edge0Error(f"--expert-width {width} is above {MAX_DIM}, the largest MLX dimension")
    _check_out_dir(model_dir, out_dir)

    index = CheckpointIndex(model_dir)
    index.check_stacked_experts()
    plan = _plan(index, config, before, width, config_file)
    _check_sizes(plan, width, model_dir, out_dir)
    source_fingerprint = _fingerprint(index)

    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in os.listdir(out_dir):
        if any(fnmatch.fnmatch(name, p) for p in WRITTEN_PATTERNS):
            (out_dir / name).unlink()
    written: list[Path] = []  # every file made so far: removed again if the disk fills
    try:
        shards = _write_shards(out_dir, plan, max_shard_bytes, written)
        if family.name == "bailing_moe":  # its shared experts default to moe_intermediate_size
            sizes.setdefault("moe_shared_expert_intermediate_size", before)
        sizes["moe_intermediate_size"] = width
        _write_text(out_dir / "config.json", json.dumps(config, indent=4) + "\n", written)
        padded = CheckpointIndex(out_dir)
        restamped, unchanged = _copy_the_rest(
            model_dir, out_dir, source_fingerprint, padded, written
        )
        marker = {"from": str(model_dir), "expert_width": width}
        _write_text(out_dir / MARKER_FILE, json.dumps(marker) + "\n", written)
    except OSError as e:  # a full disk, a quota, a file-size limit: no half checkpoint is left
        for path in written:
            path.unlink(missing_ok=True)
        if created:
            out_dir.rmdir()
        raise Edge0Error(
            f"{out_dir}: cannot write the padded checkpoint ({e.strerror or e}); what was written "
            "of it is removed"
        ) from None
    return WallReport(
        out_dir,
        before,
        width,
        index.expert_nbytes,
        padded.expert_nbytes,
        shards,
        tuple(restamped),
        tuple(unchanged),
    )


def _write_text(path: Path, text: str, written: list[Path]) -> None:
    written.append(path)
    path.write_text(text)


def _copy_the_rest(
    model_dir: Path, out_dir: Path, source_fingerprint: str, padded: CheckpointIndex, written
) -> tuple[list[str], list[str]]:
    """The source's other files (tokenizer, adapters restamped for the padded base); returns the
    adapter names (restamped, copied unchanged)."""
    fingerprint = _fingerprint(padded)
    restamped, unchanged = [], []
    for name in sorted(os.listdir(model_dir)):
        source = model_dir / name
        if not source.is_file() or any(fnmatch.fnmatch(name, p) for p in NOT_COPIED):
            continue
        written.append(out_dir / name)
        if any(fnmatch.fnmatch(name, p) for p in ADAPTER_PATTERNS):
            done = _restamp(source, out_dir / name, source_fingerprint, fingerprint)
            (restamped if done else unchanged).append(name)
        else:
            shutil.copyfile(source, out_dir / name)
    return restamped, unchanged


def _check_sizes(plan: dict[str, _Planned], width: int, model_dir: Path, out_dir: Path) -> None:
    """Before anything is written: every padded dimension within MLX's limit, one padded expert
    slice within `MAX_EXPERT_SLICE_BYTES`, and the whole output within the free disk space (a
    width of 2^31 once wrote tens of GB and took most of the memory before it was killed)."""
    for name, planned in plan.items():
        if planned.pad_axis is None:
            continue
        if max(planned.shape) > MAX_DIM:
            raise Edge0Error(
                f"--expert-width {width} makes {name} {list(planned.shape)}, above {MAX_DIM}, the "
                "largest MLX dimension"
            )
        if planned.nbytes // planned.shape[0] > MAX_EXPERT_SLICE_BYTES:
            raise Edge0Error(
                f"--expert-width {width} makes one expert's {name} "
                f"{format_bytes(planned.nbytes // planned.shape[0])}, above the "
                f"{format_bytes(MAX_EXPERT_SLICE_BYTES)} an expert may take here"
            )
    needed = sum(p.nbytes for p in plan.values())
    needed += sum(
        f.stat().st_size
        for f in model_dir.iterdir()
        if f.is_file() and not any(fnmatch.fnmatch(f.name, p) for p in NOT_COPIED)
    )
    existing = out_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        free = shutil.disk_usage(existing).free
    except OSError:
        return  # nowhere to ask: the write says what fails
    if existing == out_dir:  # a previous output there is deleted before writing
        free += sum(
            f.stat().st_size
            for f in out_dir.iterdir()
            if f.is_file() and any(fnmatch.fnmatch(f.name, p) for p in WRITTEN_PATTERNS)
        )
    if needed > free:
        raise Edge0Error(
            f"{out_dir}: --expert-width {width} makes a checkpoint of {format_bytes(needed)} but "
            f"only {format_bytes(free)} is free there"
        )


def _check_out_dir(model_dir: Path, out_dir: Path) -> None:
    if out_dir.resolve() == model_dir.resolve():
        raise Edge0Error(f"{out_dir}: the output directory is the source; choose another")
    # Never overwrite what is not ours (the writer deletes stale shards and adapters).
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / MARKER_FILE).exists():
        raise Edge0Error(
            f"{out_dir} exists and is not a synthetic checkpoint; choose an empty directory"
        )


def _plan(
    index: CheckpointIndex, config: dict, before: int, width: int, config_file: Path
) -> dict[str, _Planned]:
    """Every output tensor, in file order; the expert tensors with their padded shapes."""
    quantization = config.get("quantization") or {}
    if quantization.get("mode", "affine") != "affine":
        raise Edge0Error(
            f"{config_file}: experts quantized in mode {quantization['mode']!r}; only affine "
            "quantization (a scale and a bias per group) can be padded with exact zeros"
        )
    plan: dict[str, _Planned] = {}
    found = False
    for name in sorted(index.tensors, key=natural_key):
        entry = index.tensors[name]
        match = EXPERT_TENSOR.match(name)
        if match is None:
            plan[name] = _Planned(entry, entry.shape, None)
            continue
        found = True
        _, projection, part = match.groups()
        if part == "weight" and entry.dtype != "U32":
            raise Edge0Error(
                f"{entry.file}: {name} is {entry.dtype}, not quantized; only quantized routed "
                "experts (mlx-lm convert -q) can be padded"
            )
        shape = list(entry.shape)
        if projection != "down_proj":  # output rows: axis 1 of the stacked tensor
            if len(shape) < 2 or shape[1] != before:
                raise Edge0Error(
                    f"{entry.file}: {name} has shape {shape}, not {before} output rows "
                    "(moe_intermediate_size)"
                )
            shape[1] = width
            plan[name] = _Planned(entry, tuple(shape), 0)
        elif part == "bias":  # down_proj's output bias: the hidden size, unchanged
            plan[name] = _Planned(entry, entry.shape, None)
        else:  # input columns: the packed (weight) or per-group (scales, biases) last axis
            columns = shape[-1]
            if (columns * width) % before:
                raise Edge0Error(
                    f"--expert-width {width} is not a whole number of quantization groups of "
                    f"{name} ({columns} per {before} inputs: use a multiple of "
                    f"{before // math.gcd(columns, before)})"
                )
            shape[-1] = columns * width // before
            plan[name] = _Planned(entry, tuple(shape), len(shape) - 2)
    if not found:
        raise Edge0Error(f"{index.model_dir}: no routed-expert tensors (*.switch_mlp.*) to pad")
    return plan


def _write_shards(
    out_dir: Path, plan: dict[str, _Planned], max_shard_bytes: int, written: list[Path]
) -> int:
    """Write the planned tensors into shards with an index; returns the number of shards. Each
    shard is written under a temporary name and renamed whole (`written` lists both)."""
    shards = plan_shards(plan, max_shard_bytes)
    weight_map = {}
    for i, names in enumerate(shards):
        if len(shards) == 1:
            file_name = "model.safetensors"
        else:
            file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        path, tmp = out_dir / file_name, out_dir / f".{file_name}.tmp"
        written += [tmp, path]
        _write_safetensors(tmp, [(n, plan[n]) for n in names])
        os.replace(tmp, path)
        weight_map.update(dict.fromkeys(names, file_name))
    index = {
        "metadata": {"total_size": sum(p.nbytes for p in plan.values())},
        "weight_map": dict(sorted(weight_map.items())),
    }
    _write_text(
        out_dir / "model.safetensors.index.json", json.dumps(index, indent=4) + "\n", written
    )
    return len(shards)


def _write_safetensors(path: Path, tensors: list[tuple[str, _Planned]]) -> None:
    """A safetensors file written tensor by tensor (one expert's slice in memory at a time)."""
    header: dict = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for name, planned in tensors:
        header[name] = {
            "dtype": planned.entry.dtype,
            "shape": list(planned.shape),
            "data_offsets": [offset, offset + planned.nbytes],
        }
        offset += planned.nbytes
    with open(path, "wb") as out:
        out.write(_header_bytes(header))
        for name, planned in tensors:
            written = 0
            for chunk in _chunks(planned):
                out.write(chunk)
                written += len(chunk)
            if written != planned.nbytes:  # a bug here must never make a silently shifted file
                raise RuntimeError(f"{name}: wrote {written} bytes, planned {planned.nbytes}")


def _header_bytes(header: dict) -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writers do
    return struct.pack("<Q", len(raw)) + raw


def _chunks(planned: _Planned):
    entry = planned.entry
    with open(entry.file, "rb") as f:
        fd = f.fileno()
        if planned.pad_axis is None:
            for start in range(0, entry.nbytes, COPY_CHUNK_BYTES):
                yield _pread(fd, entry.offset + start, min(COPY_CHUNK_BYTES, entry.nbytes - start))
            return
        experts = entry.shape[0]
        expert_bytes = entry.nbytes // experts
        itemsize = DTYPE_SIZES[entry.dtype]
        pad = [(0, 0)] * (len(entry.shape) - 1)
        pad[planned.pad_axis] = (
            0,
            planned.shape[1 + planned.pad_axis] - entry.shape[1 + planned.pad_axis],
        )
        for e in range(experts):
            raw = _pread(fd, entry.offset + e * expert_bytes, expert_bytes)
            values = np.frombuffer(raw, dtype=_UINTS[itemsize]).reshape(entry.shape[1:])
            yield np.pad(values, pad).tobytes()


def _pread(fd: int, offset: int, length: int) -> bytes:
    data = os.pread(fd, length, offset)
    while len(data) < length:
        more = os.pread(fd, length - len(data), offset + len(data))
        if not more:
            raise Edge0Error(f"unexpected end of file reading {length} bytes at {offset}")
        data += more
    return data


def _fingerprint(index: CheckpointIndex) -> str:
    """The base fingerprint the engine computes for this checkpoint: every SwitchGLU's tensors are
    registered as the loader registers them (one MoE layer per `*.switch_mlp` module)."""
    modules: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, entry in index.tensors.items():
        match = EXPERT_TENSOR.match(name)
        if match:
            path, projection, part = match.groups()
            modules.setdefault(path, {})[f"{projection}.{part}"] = entry.shape
    for path, shapes in modules.items():
        layer = LAYER.search(path)
        index.add_moe_layer(
            int(layer.group(1)) if layer else 0, path, shapes["gate_proj.weight"][0], shapes
        )
    return base_fingerprint(index)


def _restamp(source: Path, target: Path, old: str, new: str) -> bool:
    """Copy an adapter file, stamped for the padded base when it was stamped for the source.

    Sound because the padded model computes the same function as the source: the same hidden
    states reach every layer (a prerouter head's features), its routers are unchanged (the heads'
    targets) and so are the attention and shared-expert projections a LoRA adapts; the padded units
    add exact zeros. Only the bytes of the header change: its `base_fingerprint` metadata. A file
    stamped for another base is copied unchanged, so it is refused here as it is there.
    """
    _, metadata = read_adapter_header(source)
    if flat_metadata(metadata).get("base_fingerprint") != old:
        shutil.copyfile(source, target)
        return False
    with open(source, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        # A flat key wins over the reference's nested JSON form in `flat_metadata`.
        header.setdefault("__metadata__", {})["base_fingerprint"] = new
        with open(target, "wb") as out:
            out.write(_header_bytes(header))
            shutil.copyfileobj(f, out, COPY_CHUNK_BYTES)
    return True
