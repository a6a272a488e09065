"""Where every tensor of a checkpoint lies on disk, and every routed expert's byte ranges.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping tensor names to
dtype, shape and data offsets, then the raw data. Routed-expert tensors are stacked `[E, ...]` with E
outermost, so each expert's slice of each tensor is one contiguous byte range. With the usual
gate/up/down x weight/scales/biases layout that is 9 ranges per expert, scattered over the file
(safetensors sorts keys, so `biases`, `scales` and `weight` of one projection lie far apart).
"""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from ..errors import Edge0Error
from .json_files import parse_json, read_json_file

# Bytes per element of every safetensors dtype MLX loads (it has no F64).
DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
}
# MLX (like the Rust safetensors crate) refuses headers of this many bytes or more; the largest real
# ones are a few MB.
MAX_HEADER_BYTES = 100_000_000
# Header bytes allowed per tensor a file may hold (real entries are 100-200 bytes), plus a fixed
# allowance for `__metadata__`: with a tensor bound, the header is bounded before it is parsed.
HEADER_BYTES_PER_TENSOR = 512
HEADER_BYTES_FIXED = 64 * 1024
# MLX shapes are int32.
MAX_DIM = 2**31 - 1
# A routed expert stored as its own tensor (the Hugging Face layout), e.g. `mlp.experts.7.up_proj`.
PER_EXPERT_NAME = re.compile(r"\.experts\.\d+\.")
INDEX_FILE = "model.safetensors.index.json"
# At most this many shard files a checkpoint: the largest MoE checkpoints come in a few hundred;
# an index (or a Hub listing) naming more is refused before one is opened or asked for.
MAX_SHARDS = 4096
# What mlx-lm and Hugging Face name weight shards (mlx-lm's loader globs exactly this).
SHARD_PATTERN = "model*.safetensors"
# What a path is when it is not a regular file, for error messages.
_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def check_regular_file(path: Path, missing: str = "missing") -> None:
    """Refuse a path that is not a regular file once symlinks are followed, before anything opens
    it: reading a FIFO blocks forever, a device never ends. `missing` is the message for a path
    that does not exist; a symlink loop or a dangling symlink is said as such."""
    mode = _followed_mode(path, missing, "a file")
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")
        raise Edge0Error(f"{path}: {kind}, not a regular file")


def check_directory(path: Path, missing: str = "no such directory") -> None:
    """Refuse a path that is not a directory once symlinks are followed, saying what it is (a
    file, a FIFO, a symlink loop) rather than that it is missing."""
    # ENOTDIR: a file where a folder of the path should be, so the directory is missing.
    mode = _followed_mode(path, missing, "a directory", not_a_folder_is_missing=True)
    if not stat.S_ISDIR(mode):
        kind = next((name for test, name in _FILE_KINDS if test(mode)), "a file")
        raise Edge0Error(f"{path}: {kind}, not a directory")


def _followed_mode(
    path: Path, missing: str, target: str, not_a_folder_is_missing: bool = False
) -> int:
    """`path`'s mode with symlinks followed; a missing path, a dangling symlink (to `target`) or
    a symlink loop is an Edge0Error saying which."""
    try:
        return os.stat(path).st_mode
    except FileNotFoundError:
        if os.path.islink(path):
            raise Edge0Error(f"{path}: a symlink to {target} that does not exist") from None
        raise Edge0Error(f"{path}: {missing}") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Edge0Error(f"{path}: a symlink loop") from None
        if e.errno == errno.ENOTDIR and not_a_folder_is_missing:
            raise Edge0Error(f"{path}: {missing}") from None
        raise Edge0Error(f"{path}: cannot read ({e.strerror or e})") from None


def list_dir(directory: Path) -> list[str]:
    """The names in a directory, sorted. A directory that cannot be listed (no read permission)
    is an Edge0Error naming it; `Path.glob` would quietly find nothing there."""
    try:
        with os.scandir(directory) as entries:
            return sorted(entry.name for entry in entries)
    except OSError as e:
        raise Edge0Error(f"{directory}: cannot list the directory ({e.strerror or e})") from None


@dataclass(frozen=True)
class TensorEntry:
    """One tensor in one shard: absolute byte offset and length in the file."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ExpertTensor:
    """A stacked `[E, ...]` routed-expert tensor, e.g. `gate_proj.weight` of one layer."""

    projection: str  # gate_proj, up_proj, down_proj
    part: str  # weight, scales, biases, bias
    entry: TensorEntry

    @property
    def expert_nbytes(self) -> int:
        return self.entry.nbytes // self.entry.shape[0]

    @property
    def expert_shape(self) -> tuple[int, ...]:
        return self.entry.shape[1:]


@dataclass(frozen=True)
class LayerExperts:
    """All routed-expert tensors of one MoE layer."""

    layer: int
    module_path: str  # e.g. model.layers.3.mlp.switch_mlp
    num_experts: int
    tensors: tuple[ExpertTensor, ...]

    @cached_property  # asked for every expert read
    def expert_nbytes(self) -> int:
        """Bytes on disk of one expert (all its ranges)."""
        return sum(t.expert_nbytes for t in self.tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.entry.nbytes for t in self.tensors)


def read_safetensors_header(path: Path, max_tensors: int | None = None) -> dict[str, TensorEntry]:
    """Parse and validate one shard's header; raise Edge0Error naming the file on any defect."""
    return read_safetensors(path, max_tensors)[0]


def read_safetensors(
    path: Path, max_tensors: int | None = None
) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """Tensor entries and the `__metadata__` dict of a safetensors file, validated.

    Whatever this accepts, `mx.load` loads: the checks are at least as strict as MLX's reader.
    `max_tensors` is what the file may hold for what it is meant to be (the expected layout): a
    header larger than that many entries can take is refused before it is parsed, and one with more
    tensors before anything is built for them. A million empty tensors are a few MB on disk but
    GBs once parsed and loaded.
    """
    path = Path(path)
    check_regular_file(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise Edge0Error(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (header_len,) = struct.unpack("<Q", head)
            if header_len >= MAX_HEADER_BYTES or header_len > size - 8:
                raise Edge0Error(
                    f"{path}: corrupt safetensors header (declares {header_len} header bytes in a "
                    f"{size}-byte file); the file is truncated or not safetensors"
                )
            if max_tensors is not None:
                limit = HEADER_BYTES_FIXED + HEADER_BYTES_PER_TENSOR * max_tensors
                if header_len > limit:
                    raise Edge0Error(
                        f"{path}: safetensors header of {header_len} bytes is larger than this "
                        f"file can need (at most {limit} bytes for {max_tensors} tensors); not "
                        "a file for this model, or built to exhaust memory"
                    )
            raw = f.read(header_len)
    except OSError as e:
        raise Edge0Error(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        header = parse_json(raw, check_surrogates=True)
    except ValueError as e:
        raise Edge0Error(f"{path}: corrupt safetensors header (invalid JSON: {e})") from None
    if not isinstance(header, dict):
        raise Edge0Error(f"{path}: corrupt safetensors header (not a JSON object)")

    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise Edge0Error(
            f"{path}: corrupt safetensors header (__metadata__ is not an object of strings)"
        )
    if max_tensors is not None and len(header) > max_tensors:
        raise Edge0Error(
            f"{path}: holds {len(header)} tensors, more than this file can need (at most "
            f"{max_tensors}); not a file for this model, or built to exhaust memory"
        )
    data_start = 8 + header_len
    entries = {
        name: _parse_entry(path, name, info, data_start, size) for name, info in header.items()
    }
    _check_no_overlap(path, entries)
    return entries, metadata


def _parse_entry(path: Path, name: str, info: object, data_start: int, size: int) -> TensorEntry:
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise Edge0Error(f"{path}: corrupt header entry for tensor {name!r}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise Edge0Error(f"{path}: tensor {name!r} has unsupported dtype {brief(dtype)}")
    if not _is_int_list(shape) or not all(0 <= d <= MAX_DIM for d in shape):
        raise Edge0Error(
            f"{path}: tensor {name!r} has an invalid shape {brief(shape)} (a list of dimensions "
            f"0..{MAX_DIM})"
        )
    if not _is_int_list(offsets) or len(offsets) != 2 or not 0 <= offsets[0] <= offsets[1]:
        raise Edge0Error(
            f"{path}: tensor {name!r} has invalid data_offsets {brief(offsets)} (expected "
            "[begin, end] with 0 <= begin <= end)"
        )
    begin, end = offsets
    shape = tuple(shape)
    nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
    if end - begin != nbytes:
        raise Edge0Error(
            f"{path}: tensor {name!r} is {end - begin} bytes on disk but shape {list(shape)} "
            f"{dtype} needs {nbytes}"
        )
    if data_start + end > size:
        raise Edge0Error(
            f"{path}: tensor {name!r} ends at byte {data_start + end} but the file has {size} bytes "
            "(truncated download?)"
        )
    return TensorEntry(name, path, dtype, shape, data_start + begin, nbytes)


def _is_int_list(value: object) -> bool:
    return isinstance(value, list) and all(type(v) is int for v in value)


def brief(value: object, limit: int = 60) -> str:
    """A JSON value for an error message: its repr, on one line, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_no_overlap(path: Path, entries: dict[str, TensorEntry]) -> None:
    # Empty tensors hold no bytes, so they overlap nothing (wherever their offset points).
    ordered = sorted((e for e in entries.values() if e.nbytes), key=lambda e: e.offset)
    for a, b in zip(ordered, ordered[1:]):
        if a.offset + a.nbytes > b.offset:
            raise Edge0Error(f"{path}: tensors {a.name!r} and {b.name!r} overlap in the file")


def checkpoint_shards(model_dir: Path) -> list[Path]:
    """The shard files of a checkpoint: exactly those the index lists when there is one, else
    model*.safetensors. Every one is a regular file."""
    index_file = model_dir / INDEX_FILE
    if not os.path.lexists(index_file):
        shards = [model_dir / n for n in list_dir(model_dir) if fnmatch.fnmatch(n, SHARD_PATTERN)]
        if not shards:
            raise Edge0Error(f"{model_dir}: no model*.safetensors files")
        for shard in shards:
            check_regular_file(shard)
        return shards
    check_regular_file(index_file)
    index = read_json_file(index_file)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise Edge0Error(f"{index_file}: corrupt index (no weight_map)")
    for name in weight_map.values():
        if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
            raise Edge0Error(
                f"{index_file}: corrupt index (weight_map names {brief(name)}, not a shard "
                "file in this directory)"
            )
    shards = [model_dir / n for n in sorted(set(weight_map.values()))]
    check_shard_count(len(shards), str(index_file))
    for shard in shards:
        check_regular_file(shard, missing="shard listed in the index is missing")
    return shards


def check_shard_count(count: int, where: str) -> None:
    """Refuse more shard files than a checkpoint has (`MAX_SHARDS`)."""
    if count > MAX_SHARDS:
        raise Edge0Error(
            f"{where}: {count:,} shard files listed, more than the {MAX_SHARDS:,} a checkpoint "
            "can have: not a checkpoint edge0 reads"
        )


def unlisted_shards(model_dir: Path, shards: list[Path]) -> list[Path]:
    """Files that look like shards (model*.safetensors) but are not among `shards`: with an index,
    they are never read, and the user should know they are ignored."""
    listed = {shard.name for shard in shards}
    return [
        model_dir / n
        for n in list_dir(model_dir)
        if fnmatch.fnmatch(n, SHARD_PATTERN) and n not in listed
    ]


class CheckpointIndex:
    """Every tensor of a checkpoint directory, and the routed-expert layout of each MoE layer."""

    def __init__(self, model_dir: str | Path, max_tensors: int | None = None) -> None:
        """`max_tensors`: what the checkpoint may hold in all (`max_checkpoint_tensors`)."""
        self.model_dir = Path(model_dir)
        self.shards = checkpoint_shards(self.model_dir)
        self.tensors: dict[str, TensorEntry] = {}
        for shard in self.shards:
            left = None if max_tensors is None else max_tensors - len(self.tensors)
            for name, entry in read_safetensors_header(shard, left).items():
                if name in self.tensors:  # which copy wins would depend on the reading order
                    raise Edge0Error(
                        f"{shard}: tensor {name!r} also appears in {self.tensors[name].file}"
                    )
                self.tensors[name] = entry
        self.layers: dict[int, LayerExperts] = {}
        # Problems that do not stop the checkpoint from running, for the user to see.
        self.warnings: list[str] = []
        if stray := unlisted_shards(self.model_dir, self.shards):
            names = ", ".join(p.name for p in stray)
            verb = "is" if len(stray) == 1 else "are"
            self.warnings.append(
                f"{self.model_dir}: {names} {verb} not listed in {INDEX_FILE} and ignored (only "
                "the shards the index lists are read)"
            )

    def check_stacked_experts(self) -> None:
        """Refuse routed experts stored one tensor per expert (the Hugging Face layout): edge0 reads
        each expert's slice of the stacked `[E, ...]` tensors of the mlx-lm layout."""
        for name, entry in self.tensors.items():
            if PER_EXPERT_NAME.search(name):
                raise Edge0Error(
                    f"{entry.file}: tensor {name!r} holds one routed expert; edge0 needs the "
                    "experts of a layer stacked (mlx-lm layout): convert the checkpoint with "
                    "`python -m mlx_lm convert --hf-path <this dir> --mlx-path <new dir>`"
                )

    def add_moe_layer(
        self, layer: int, module_path: str, num_experts: int, expected: dict[str, tuple[int, ...]]
    ) -> LayerExperts:
        """Register one MoE layer's expert tensors.

        `expected` maps `projection.part` (e.g. `gate_proj.scales`) to the stacked shape the model's
        config implies; each must be present in the checkpoint with that shape.
        """
        tensors = []
        for key, shape in expected.items():
            name = f"{module_path}.{key}"
            entry = self.tensors.get(name)
            if entry is None:
                self.check_stacked_experts()
                raise Edge0Error(f"{self.model_dir}: routed-expert tensor {name!r} is missing")
            if entry.shape != tuple(shape) or entry.shape[0] != num_experts:
                raise Edge0Error(
                    f"{entry.file}: tensor {name!r} has shape {list(entry.shape)} but config.json "
                    f"implies {list(shape)} ({num_experts} experts)"
                )
            projection, part = key.rsplit(".", 1)
            tensors.append(ExpertTensor(projection, part, entry))
        layer_experts = LayerExperts(layer, module_path, num_experts, tuple(tensors))
        self.layers[layer] = layer_experts
        return layer_experts

    def add_moe_layers_by_name(self) -> None:
        """Register every MoE layer's expert tensors from the headers alone, where no model is
        built (`edge0 list`): a stacked `gate_proj.weight` (one matrix an expert) marks a
        layer's routed experts, and every tensor under its module path is theirs, as the loader
        registers them from the built model."""
        modules: dict[str, dict[str, tuple[int, ...]]] = {}  # path -> `projection.part` shapes
        for name, entry in self.tensors.items():
            path = name.rpartition(".")[0].rpartition(".")[0]  # less `projection.part`
            if path:
                modules.setdefault(path, {})[name.removeprefix(f"{path}.")] = tuple(entry.shape)
        for path, parts in modules.items():
            gate = parts.get("gate_proj.weight")
            layer = _layer_number(path)
            if gate is not None and len(gate) == 3 and layer is not None:
                self.add_moe_layer(layer, path, gate[0], parts)

    @property
    def expert_nbytes(self) -> int:
        """Bytes of all routed-expert tensors registered so far."""
        return sum(le.nbytes for le in self.layers.values())

    def expert_file_ranges(self) -> list[tuple[Path, int, int]]:
        """(file, offset, length) of every registered expert tensor, for page-cache sampling."""
        return [
            (t.entry.file, t.entry.offset, t.entry.nbytes)
            for le in self.layers.values()
            for t in le.tensors
        ]


def _layer_number(path: str) -> int | None:
    """The decoder layer a module path is in (`model.layers.3.mlp.switch_mlp` -> 3)."""
    parts = path.split(".")
    for before, number in zip(parts, parts[1:]):
        if before == "layers" and number.isascii() and number.isdigit():
            return int(number)
    return None


def max_checkpoint_tensors(layers: int | None) -> int:
    """The most tensors a checkpoint of `layers` layers may hold: 128 a layer (an mlx-lm 4-bit MoE
    layer has about 40: attention, norms, router, stacked and shared experts, each with scales and
    biases) and 1024 more (embeddings, final norm, head, a vision tower); a config without a usable
    layer count, or with an absurd one, is taken as 512 layers."""
    layers = layers if layers is not None and 1 <= layers <= 512 else 512
    return 128 * layers + 1024


def base_fingerprint(index: CheckpointIndex) -> str:
    """A short hash naming the base model: its config.json and its routed-expert tensor entries.

    Adapters record it, so a file trained for another model (or another quantization) is refused.
    """
    path = index.model_dir / "config.json"
    try:
        config = json.loads(path.read_text())
    except OSError as e:
        raise Edge0Error(f"{path}: cannot read ({e.strerror or e})") from None
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for name in sorted(t.entry.name for le in index.layers.values() for t in le.tensors):
        entry = index.tensors[name]
        digest.update(f"{name}|{entry.dtype}|{list(entry.shape)}\n".encode())
    return digest.hexdigest()[:16]
