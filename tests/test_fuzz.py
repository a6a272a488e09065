"""Fuzzing the readers of user files: whatever the bytes, they raise `Edge0Error` or succeed.

`read_safetensors` gets random bytes and headers with mutated fields; whatever it accepts, `mx.load`
must load with the same names, dtypes, shapes and metadata (the engine hands accepted files to MLX).
The adapter readers (`load_prerouter`, `load_lora`, `discover_profiles`) get small valid files
written with `mx.save_safetensors`, with names, shapes, dtypes, metadata and bytes mutated.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
from pathlib import Path

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine.adapters.lora import LoRAAdapter, load_lora
from engine.adapters.profiles import discover_profiles
from engine.checkpoint.index import DTYPE_SIZES, read_safetensors
from engine.errors import Edge0Error
from engine.routing.prerouter import PrerouterHeads, load_prerouter

FUZZ = settings(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# Examples per run are half of what the round-2 audit ran (for the suite's time): each kind of
# defect the strategies make is still drawn several times per run (most tens of times), and the
# examples are new on every run (no database). EDGE0_FUZZ_SCALE=2 runs the audit's counts; 10, ...
# a longer hunt.
FUZZ_SCALE = float(os.environ.get("EDGE0_FUZZ_SCALE", "1"))


def examples(n: int) -> int:
    return max(1, round(n * FUZZ_SCALE))


MLX_DTYPES = {
    "BOOL": mx.bool_,
    "U8": mx.uint8,
    "I8": mx.int8,
    "U16": mx.uint16,
    "I16": mx.int16,
    "F16": mx.float16,
    "BF16": mx.bfloat16,
    "U32": mx.uint32,
    "I32": mx.int32,
    "F32": mx.float32,
    "U64": mx.uint64,
    "I64": mx.int64,
}
ODD_DTYPES = ["F64", "C64", "F8_E4M3", "f32", "", "U32 ", "float32"]
# The small model the adapters are for: 4 layers, hidden 8, 4 experts (head input width 16).
LAYERS, HIDDEN, EXPERTS, FINGERPRINT = 4, 8, 4, "0123456789abcdef"
WIDTH = HIDDEN + 2 * EXPERTS


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


# -- safetensors bytes ------------------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
names = st.text(min_size=0, max_size=12) | st.sampled_from(
    ["a\x00b", "__metadata__", "layers.0.fc1.weight", "\ud800", "é", "a.b.c"]
)
big_ints = st.sampled_from([-1, -(2**63), 2**31 - 1, 2**31, 2**32 + 1, 2**63, 2**64, 10**30])
dims = st.integers(min_value=0, max_value=6) | big_ints
bad_shapes = st.one_of(
    st.lists(dims, max_size=4),
    st.lists(st.sampled_from([1.5, "4", True, None, [2]]), min_size=1, max_size=3),
    json_values,
)
bad_offsets = st.one_of(
    st.lists(st.integers(min_value=-10, max_value=200) | big_ints, max_size=3),
    st.tuples(st.sampled_from([0.0, "0", None, True]), st.integers(0, 64)).map(list),
    json_values,
)


def refused(error: Edge0Error, path: Path) -> None:
    """The message is one line naming the file; its kind is counted (--hypothesis-show-statistics)."""
    message = str(error)
    assert str(path) in message and "\n" not in message, message
    kind = re.sub(r"'[^']*'|\[[^\]]*\]|-?\d+", "#", message.split(": ", 1)[1])
    event(f"refused: {kind[:70]}")


def serialize(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def add_key(text: str, member: str) -> str:
    """JSON object text with one more `"key": value` member."""
    return "{" + member + "}" if text == "{}" else text[:-1] + ", " + member + "}"


def split(blob: bytes) -> tuple[dict, bytes]:
    (length,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + length]), blob[8 + length :]


@st.composite
def valid_files(draw) -> tuple[dict, bytes]:
    """A small, valid safetensors file as (header, data), tensors packed in drawn order."""
    header: dict = {}
    data = b""
    for name in draw(st.lists(st.text(max_size=8), max_size=4, unique=True)):
        dtype = draw(st.sampled_from(sorted(MLX_DTYPES)))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        header[name] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [len(data), len(data) + nbytes],
        }
        data += draw(st.binary(min_size=nbytes, max_size=nbytes))
    if draw(st.booleans()):
        header["__metadata__"] = draw(
            st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3)
        )
    return header, data


@st.composite
def mutated_header(draw, header: dict, data: bytes) -> tuple[dict, bytes]:
    """`header` and `data` with one to three field-level defects (or, sometimes, none)."""
    header = json.loads(json.dumps(header))
    for _ in range(draw(st.integers(0, 3))):
        tensors = [n for n in header if n != "__metadata__"]
        kind = draw(
            st.sampled_from(
                [
                    "dtype",
                    "shape",
                    "offsets",
                    "drop key",
                    "entry type",
                    "metadata",
                    "rename",
                    "extra field",
                    "duplicate",
                    "empty tensor",
                    "emptied tensor",
                    "data",
                ]
            )
        )
        name = draw(st.sampled_from(tensors)) if tensors else None
        entry = header.get(name) if isinstance(header.get(name), dict) else None
        if kind == "dtype" and entry is not None:
            entry["dtype"] = draw(st.sampled_from(ODD_DTYPES + sorted(MLX_DTYPES)) | json_values)
        elif kind == "shape" and entry is not None:
            entry["shape"] = draw(bad_shapes)
        elif kind == "offsets" and entry is not None:
            other = header.get(draw(st.sampled_from(tensors)))
            if isinstance(other, dict) and draw(st.booleans()):
                entry["data_offsets"] = other.get("data_offsets")  # overlap, if the sizes agree
            else:
                entry["data_offsets"] = draw(bad_offsets)
        elif kind == "drop key" and entry is not None:
            entry.pop(draw(st.sampled_from(["dtype", "shape", "data_offsets"])), None)
        elif kind == "entry type" and name is not None:
            header[name] = draw(json_values)
        elif kind == "metadata":
            header["__metadata__"] = draw(
                json_values | st.dictionaries(st.text(max_size=4), json_values, max_size=3)
            )
        elif kind == "rename" and name is not None:
            header[draw(names)] = header.pop(name)
        elif kind == "extra field" and entry is not None:
            entry[draw(st.text(max_size=6))] = draw(json_values)
        elif kind == "duplicate" and name is not None:
            header[draw(names)] = json.loads(json.dumps(header[name]))
        elif kind == "empty tensor":
            at = draw(st.integers(0, len(data) + 8))
            header[draw(names)] = {"dtype": "F32", "shape": [0, 3], "data_offsets": [at, at]}
        elif kind == "emptied tensor" and entry is not None:
            at = draw(st.integers(0, len(data)))
            shape = entry.get("shape") if isinstance(entry.get("shape"), list) else [1]
            entry["shape"] = [0 if i == draw(st.integers(0, 3)) else d for i, d in enumerate(shape)]
            entry["data_offsets"] = [at, at]
        elif kind == "data":
            cut = draw(st.integers(0, len(data)))
            data = data[:cut] + draw(st.binary(max_size=16))
    return header, data


@st.composite
def raw_defects(draw, blob: bytes) -> bytes:
    """Defects below the JSON level: the length prefix, the encoding, odd JSON, cut bytes."""
    header, data = split(blob)
    text = json.dumps(header, ensure_ascii=draw(st.booleans()))
    kind = draw(
        st.sampled_from(
            [
                "length",
                "nan",
                "deep",
                "bom",
                "surrogate",
                "duplicate key",
                "utf16",
                "digits",
                "cut json",
                "trailing",
                "flip",
            ]
        )
    )
    if kind == "nan":
        constant = draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999"]))
        text = add_key(text, f'"x": {constant}')
    elif kind == "deep":
        depth = draw(st.sampled_from([10, 900, 5000, 100_000]))
        text = add_key(text, '"x": ' + "[" * depth + "]" * depth)
    elif kind == "surrogate":
        text = add_key(
            text, draw(st.sampled_from(['"\\udc00x": 1', '"\\ud800": {}', '"a": "\\ud800"']))
        )
    elif kind == "duplicate key" and header:
        # JSON objects may repeat a key; Python's reader and MLX's both keep the last one.
        name = draw(st.sampled_from(sorted(header)))
        value = draw(
            st.sampled_from([header[name], {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}])
        )
        text = add_key(text, f"{json.dumps(name)}: {json.dumps(value)}")
    elif kind == "digits":
        text = add_key(text, '"x": ' + "9" * 5000)
    elif kind == "cut json":
        text = text[: draw(st.integers(0, len(text)))]
    elif kind == "trailing":
        text += draw(st.sampled_from(["\x00\x00", " x", "}", "\n\t "]))
    raw = text.encode("utf-16" if kind == "utf16" else "utf-8", errors="surrogatepass")
    if kind == "bom":
        raw = b"\xef\xbb\xbf" + raw
    length = len(raw)
    if kind == "length":
        length = draw(
            st.sampled_from(
                [0, 1, length - 1, length + 1, 99_999_999, 100_000_000, 2**63, 2**64 - 1]
            )
            | st.integers(0, length + 64)
        )
    out = bytearray(struct.pack("<Q", max(0, length) % 2**64) + raw + data)
    if kind == "flip" and out:
        for _ in range(draw(st.integers(1, 4))):
            at = draw(st.integers(0, len(out) - 1))
            out[at] = draw(st.integers(0, 255))
    return bytes(out)


@st.composite
def safetensors_blobs(draw) -> bytes:
    header, data = draw(valid_files())
    if draw(st.booleans()):
        header, data = draw(mutated_header(header, data))
    blob = serialize(header, data)
    if draw(st.integers(0, 3)) == 0:
        blob = draw(raw_defects(blob))
    return blob


def check_parser(path: Path, blob: bytes) -> None:
    path.write_bytes(blob)
    try:
        entries, metadata = read_safetensors(path)
    except Edge0Error as e:
        refused(e, path)
        return
    event("accepted")
    # Accepted: MLX loads the same tensors, and every byte they claim is in the file.
    arrays, mlx_metadata = mx.load(str(path), return_metadata=True)
    assert set(arrays) == set(entries)
    assert mlx_metadata == metadata
    for name, entry in entries.items():
        assert arrays[name].dtype == MLX_DTYPES[entry.dtype]
        assert arrays[name].shape == entry.shape
        assert entry.offset + entry.nbytes <= len(blob)
    mx.eval(list(arrays.values()))


@settings(FUZZ, max_examples=examples(250))
@given(
    blob=st.one_of(
        st.binary(max_size=160),
        st.binary(min_size=8, max_size=8).map(lambda b: b + b"{}"),
        st.binary(max_size=160).map(lambda b: struct.pack("<Q", len(b)) + b),
        json_values.map(lambda v: json.dumps(v).encode()).map(
            lambda b: struct.pack("<Q", len(b)) + b
        ),
    )
)
def test_parser_random_bytes(workdir, blob):
    check_parser(workdir / "random.safetensors", blob)


@settings(FUZZ, max_examples=examples(800))
@given(blob=safetensors_blobs())
def test_parser_mutated_headers(workdir, blob):
    check_parser(workdir / "mutated.safetensors", blob)


# -- adapter files ----------------------------------------------------------------------------------

float_dtypes = st.sampled_from([mx.float16, mx.bfloat16, mx.float32])
odd_dtypes = st.sampled_from([mx.uint32, mx.int8, mx.bool_, mx.float16])
layer_ids = st.sampled_from(
    ["0", "1", "2", "3", "7", "07", "-1", "x", "", "٣", "²", "99999999999999999999"]
)
metadata_values = st.one_of(
    st.text(max_size=8),
    st.sampled_from(["0", "-1", "4", "1e999", "inf", "nan", "[0, 1]", "[", "[1e999]", "9" * 5000]),
    json_values.map(json.dumps),
)


@st.composite
def adapter_metadata(draw, valid: dict) -> dict:
    """`valid` with keys dropped or given odd values, sometimes nested as the reference writes."""
    meta = dict(valid)
    for key in draw(st.lists(st.sampled_from(sorted(valid) + ["hidden", "x"]), max_size=4)):
        if draw(st.booleans()):
            meta[key] = draw(metadata_values)
        else:
            meta.pop(key, None)
    if draw(st.integers(0, 3)) == 0:
        odd = st.sampled_from([math.inf, -math.inf, math.nan, 1e300, [math.inf]])
        nested = draw(
            st.dictionaries(st.sampled_from(sorted(valid)), json_values | odd, max_size=3)
        )
        inner = json.dumps({**meta, **nested}) if draw(st.booleans()) else draw(metadata_values)
        meta = {"__metadata__": inner}
    return meta


@st.composite
def adapter_arrays(draw, valid: dict[str, tuple[int, ...]]) -> dict[str, mx.array]:
    """Zero arrays with the `valid` names and shapes, some renamed, reshaped, retyped or dropped."""
    arrays = {}
    defects = draw(st.booleans())
    for name, shape in valid.items():
        dtype = draw(float_dtypes)
        kind = "keep"
        if defects:
            kind = draw(st.sampled_from(["keep"] * 6 + ["shape", "dtype", "rename", "drop"]))
        if kind == "shape":
            shape = tuple(draw(st.lists(st.integers(0, 20), max_size=3)))
        elif kind == "dtype":
            dtype = draw(odd_dtypes)
        elif kind == "rename":
            pieces = name.split(".")
            at = draw(st.integers(0, len(pieces) - 1))
            pieces[at] = draw(layer_ids | st.sampled_from(["fc3", "lora_C", "weight", "mlp"]))
            name = ".".join(pieces)
        elif kind == "drop":
            continue
        arrays[name] = mx.zeros(shape, dtype)
    for _ in range(draw(st.integers(0, 1))):
        arrays[draw(st.text(min_size=1, max_size=12))] = mx.zeros((2, 2))
    return arrays


def save(path: Path, arrays: dict[str, mx.array], metadata: dict[str, str]) -> None:
    """`mx.save_safetensors`, or the same layout written here when an array is empty (MLX refuses)."""
    if all(a.size for a in arrays.values()):
        mx.save_safetensors(str(path), arrays, metadata=metadata)
        return
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, array in arrays.items():
        dtype = next(k for k, v in MLX_DTYPES.items() if v == array.dtype)
        header[name] = {
            "dtype": dtype,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    path.write_bytes(serialize(header, bytes(offset)))


def write_adapter(path: Path, data, files) -> None:
    """Write a valid-looking adapter file drawn from `files`, then maybe give it header or byte
    defects."""
    arrays, metadata = data.draw(files)
    save(path, arrays, metadata)
    blob = path.read_bytes()
    defect = data.draw(st.integers(0, 5))
    if defect == 0:
        blob = serialize(*data.draw(mutated_header(*split(blob))))
    elif defect == 1:
        blob = data.draw(raw_defects(blob))
    path.write_bytes(blob)


def prerouter_tensors(inner: int, owners=(0, 1, 2)) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for n in owners:
        shapes[f"layers.{n}.fc1.weight"] = (inner, WIDTH)
        shapes[f"layers.{n}.fc2.weight"] = (EXPERTS, inner)
        shapes[f"layers.{n}.linear_init.weight"] = (EXPERTS, WIDTH)
    return shapes


PREROUTER_META = {
    "kind": "prerouter",
    "K": "2",
    "owners": "[0, 1, 2]",
    "base_fingerprint": FINGERPRINT,
}
PREROUTER_FILES = st.tuples(
    st.integers(0, 6).flatmap(lambda inner: adapter_arrays(prerouter_tensors(inner))),
    adapter_metadata(PREROUTER_META),
)


@settings(FUZZ, max_examples=examples(400))
@given(data=st.data(), k=st.sampled_from([None, None, 2, 2, 1, 4, 5]))
def test_load_prerouter(workdir, data, k):
    path = workdir / "prerouter_k2.safetensors"
    write_adapter(path, data, PREROUTER_FILES)
    try:
        heads = load_prerouter(path, LAYERS, HIDDEN, EXPERTS, FINGERPRINT, k=k)
    except Edge0Error as e:
        refused(e, path)
        return
    event("accepted")
    assert isinstance(heads, PrerouterHeads)
    n, inner = len(heads.owners), heads.fc1.shape[1]
    assert all(0 <= o < LAYERS - 1 for o in heads.owners)
    assert heads.fc1.shape == (n, inner, WIDTH)
    assert heads.fc2.shape == (n, EXPERTS, inner)
    assert heads.linear_init.shape == (n, EXPERTS, WIDTH)
    assert 0 <= heads.k <= EXPERTS


LORA_MODULES = ("model.layers.0.self_attn.q_proj", "model.layers.1.attention.dense")
LORA_META = {"kind": "lora", "K": "2", "r": "4", "alpha": "8.0", "base_fingerprint": FINGERPRINT}


def lora_tensors(r: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{m}.{p}": s for m in LORA_MODULES for p, s in (("lora_A", (r, 16)), ("lora_B", (12, r)))
    }


LORA_FILES = st.integers(0, 6).flatmap(
    lambda r: st.tuples(
        adapter_arrays(lora_tensors(r)), adapter_metadata({**LORA_META, "r": str(r)})
    )
)


@settings(FUZZ, max_examples=examples(350))
@given(data=st.data())
def test_load_lora(workdir, data):
    path = workdir / "lora_k2.safetensors"
    write_adapter(path, data, LORA_FILES)
    try:
        adapter = load_lora(path, FINGERPRINT)
    except Edge0Error as e:
        refused(e, path)
        return
    event("accepted")
    assert isinstance(adapter, LoRAAdapter)
    assert adapter.r >= 1 and math.isfinite(adapter.scale)
    for a, b in adapter.weights.values():
        assert a.shape[0] == b.shape[1] == adapter.r


PROFILE_NAMES = [
    "prerouter_k2",
    "prerouter_k02",
    "prerouter_k0",
    "prerouter_k3",
    "prerouter_ref",
    "prerouter_",
    "prerouter_k٣",
    "prerouter_k99999999999999999999",
    "lora_k2",
    "lora_k0",
    "lora_k5",
    "lora_ref",
]


@settings(FUZZ, max_examples=examples(250))
@given(
    data=st.data(),
    files=st.lists(st.sampled_from(PROFILE_NAMES[:1] * 4 + PROFILE_NAMES), max_size=4),
    directory=st.sampled_from([False] * 4 + [True]),
)
def test_discover_profiles(workdir, data, files, directory):
    model_dir = workdir / "profiles"
    shutil.rmtree(model_dir, ignore_errors=True)
    model_dir.mkdir()
    for name in files:
        path = model_dir / f"{name}.safetensors"
        kind = data.draw(st.sampled_from(["prerouter", "lora", "bytes"]))
        if kind == "bytes":
            path.write_bytes(data.draw(st.binary(max_size=64)))
        else:
            write_adapter(path, data, PREROUTER_FILES if kind == "prerouter" else LORA_FILES)
    if directory:  # a directory where a file should be
        (model_dir / "prerouter_k7.safetensors").mkdir(exist_ok=True)
    try:
        profiles = discover_profiles(model_dir)
    except Edge0Error as e:
        refused(e, model_dir)
        return
    event(f"accepted: {len(profiles)} profiles")
    for k, files_k in profiles.items():
        assert k >= 1 and files_k.k == k
        assert files_k.prerouter is not None or files_k.lora is not None
