"""What every adapter file (prerouter heads, LoRA) shares: its safetensors metadata and loading.

Our metadata is flat string pairs (`kind`, `K`, `base_fingerprint`, ...); the reference
implementation's is one `__metadata__` key holding a JSON string. Both are read through
`flat_metadata`. An adapter trained for another base model is refused by its fingerprint.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

import mlx.core as mx

from ..checkpoint.index import brief, parse_json, read_safetensors
from ..errors import Edge0Error


def flat_metadata(raw: dict) -> dict:
    """Metadata as a flat dict, unwrapping the reference's `{"__metadata__": "<json>"}` form."""
    meta = dict(raw)
    nested = meta.pop("__metadata__", None)
    if isinstance(nested, str):
        try:
            inner = parse_json(nested)
        except ValueError:
            inner = None
        if isinstance(inner, dict):
            meta = {**{k: v for k, v in inner.items()}, **meta}
    return meta


def metadata_int(meta: dict, key: str, path: Path) -> int | None:
    value = meta.get(key)
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        raise Edge0Error(f"{path}: metadata {key}={brief(value)} is not an integer") from None


# The most tensors any adapter file may hold: a LoRA on 16 linear layers of each of 512 layers
# (a reader that knows the model asks for less: `load_prerouter`).
ADAPTER_MAX_TENSORS = 2 * 16 * 512
# The longest metadata list (`owners`) read: 512 layers of up to 6 digits and a separator.
MAX_LIST_CHARS = 8 * 512


def read_adapter_header(path: Path, max_tensors: int = ADAPTER_MAX_TENSORS):
    """`read_safetensors` for an adapter file: its tensors bounded (and so its header, before it
    is parsed) by what an adapter can hold."""
    return read_safetensors(path, max_tensors)


def metadata_list(meta: dict, key: str, path: Path) -> list[int] | None:
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, str) and len(value) > MAX_LIST_CHARS:
        raise Edge0Error(
            f"{path}: metadata {key} is {len(value)} characters, too long for a list of layers "
            f"(at most {MAX_LIST_CHARS})"
        )
    try:
        items = parse_json(value) if isinstance(value, str) else value
        if not isinstance(items, list):
            raise TypeError(key)
        return [int(v) for v in items]
    except (TypeError, ValueError, OverflowError):
        raise Edge0Error(f"{path}: metadata {key}={brief(value)} is not a list of layers") from None


def check_adapter_metadata(meta: dict, kind: str, fingerprint: str, path: Path) -> None:
    """Refuse an adapter file of another kind, or one trained for another base model."""
    if meta.get("kind", kind) != kind:
        raise Edge0Error(f"{path}: not a {kind} file (kind={brief(meta.get('kind'))})")
    if meta.get("base_fingerprint") not in (None, fingerprint):
        raise Edge0Error(
            f"{path}: trained for another base model (fingerprint "
            f"{brief(meta['base_fingerprint'])}, this model is {fingerprint!r})"
        )


def load_arrays(path: Path) -> dict[str, mx.array]:
    """`mx.load` of a file `read_safetensors` accepted, any failure an Edge0Error naming the file."""
    try:
        return mx.load(str(path))
    except (RuntimeError, ValueError, OSError) as e:
        raise Edge0Error(f"{path}: cannot load ({e})") from None


def floating(array: mx.array) -> bool:
    return mx.issubdtype(array.dtype, mx.floating)


def nonfinite_tensors(arrays: dict[str, mx.array]) -> list[str]:
    """Names of the floating-point arrays that hold NaN or infinity, in one evaluation."""
    # An empty array holds no value to be NaN (and a million of them made a graph of GBs).
    names = [name for name, array in arrays.items() if floating(array) and array.size]
    if not names:
        return []
    flags = mx.stack([mx.isfinite(arrays[name]).all() for name in names])
    return [name for name, finite in zip(names, flags.tolist()) if not finite]


def check_finite(path: Path, arrays: dict[str, mx.array]) -> None:
    """Refuse an adapter file with NaN or infinite weights: they would turn every reply into
    garbage that nothing downstream flags."""
    bad = nonfinite_tensors(arrays)
    if bad:
        raise Edge0Error(f"{path}: tensor {bad[0]!r} holds NaN or infinite values")


def write_adapter(path: Path, tensors: dict[str, mx.array], metadata: dict[str, str]) -> None:
    """Write an adapter file whole or not at all: every adapter save goes through here.

    The file is written under a temporary name in the same folder (a dot name no adapter search
    matches), synced, checked as the loader will check it (a header that reads back, no NaN or
    infinite weight, so a diverged run never replaces a good adapter), then renamed over `path`.
    A full disk, a file-size limit or a kill leaves the previous file as it was and no half file
    where the engine loads adapters; a failure is an Edge0Error naming `path`."""
    path = Path(path)
    bad = nonfinite_tensors(tensors)
    if bad:
        raise Edge0Error(
            f"{path}: not written: tensor {bad[0]!r} holds NaN or infinite values (training "
            "diverged: try a lower --lr); the previous file, if any, is kept"
        )
    _remove_stale_temps(path)
    # mx.save_safetensors adds `.safetensors` to a name that lacks it.
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp.safetensors")
    try:
        _write_safetensors(tmp, tensors, metadata)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        read_adapter_header(tmp)  # what was written reads back (a short write would not)
        os.replace(tmp, path)
        _sync_folder(path.parent)
    except (OSError, RuntimeError, ValueError, Edge0Error) as e:
        tmp.unlink(missing_ok=True)
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise Edge0Error(
            f"{path}: cannot write the adapter ({reason}); the previous file, if any, is kept"
        ) from None
    except BaseException:  # Ctrl-C: no temporary file left behind either
        tmp.unlink(missing_ok=True)
        raise


def _remove_stale_temps(path: Path) -> None:
    """Temporary files of an earlier write of `path` whose process is gone (killed mid-write):
    ours by their name, `.NAME.PID-HEX.tmp.safetensors`, and removed, never another's."""
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(\d+)-[0-9a-f]+\.tmp\.safetensors")
    try:
        names = os.listdir(path.parent)
    except OSError:
        return
    for name in names:
        match = pattern.fullmatch(name)
        if match and not _process_alive(int(match.group(1))):
            try:
                (path.parent / name).unlink()
            except OSError:
                pass


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # none such (a PID too large for any)
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _write_safetensors(path: Path, tensors: dict[str, mx.array], metadata: dict[str, str]) -> None:
    mx.save_safetensors(str(path), tensors, metadata=metadata)


def _sync_folder(folder: Path) -> None:
    """The rename made durable (where a folder can be opened and synced)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# The tensor names of each kind of adapter file, for files that do not say their kind.
_ADAPTER_TENSORS = {
    "lora": re.compile(r".+\.lora_[AB]"),
    "prerouter": re.compile(r"layers\.\d+\.(fc1|fc2|linear_init)\.weight"),
}


def check_adapter_out(path: Path, kind: str, model_dir: Path) -> None:
    """Refuse an output path (`train ... --out`) that would overwrite what is not an adapter file
    of `kind`: a file in the model folder other than a `{kind}_*.safetensors` one (the model's own
    weights, config or tokenizer), or an existing file elsewhere that is not such an adapter.
    `--force` skips this check."""
    path = Path(path)
    force = "; use --force to write it anyway"
    try:
        inside = (path.parent.resolve() / path.name).is_relative_to(Path(model_dir).resolve())
    except (OSError, RuntimeError):
        inside = False
    if inside and not re.fullmatch(rf"{kind}_.*\.safetensors", path.name):
        raise Edge0Error(
            f"{path}: in the model folder and not named {kind}_*.safetensors: refusing to write "
            f"the {kind} adapter over the model's own files{force}"
        )
    if not os.path.lexists(path):
        return
    if not path.is_file():
        raise Edge0Error(f"{path}: exists and is not a file: refusing to write the {kind} adapter")
    if not _is_adapter(path, kind):
        raise Edge0Error(
            f"{path}: exists and is not a {kind} adapter file: refusing to overwrite it{force}"
        )


def _is_adapter(path: Path, kind: str) -> bool:
    try:
        entries, raw = read_adapter_header(path)
    except Edge0Error:
        return False
    said = flat_metadata(raw).get("kind")
    if said is not None:
        return said == kind
    return bool(entries) and all(_ADAPTER_TENSORS[kind].fullmatch(n) for n in entries)
