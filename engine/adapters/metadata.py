"""What every adapter file (prerouter heads, LoRA) shares: its safetensors metadata and loading.

Our metadata is flat string pairs (`kind`, `K`, `base_fingerprint`, ...); the reference
implementation's is one `__metadata__` key holding a JSON string. Both are read through
`flat_metadata`. An adapter trained for another base model is refused by its fingerprint.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from ..checkpoint.index import brief, parse_json
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


def metadata_list(meta: dict, key: str, path: Path) -> list[int] | None:
    value = meta.get(key)
    if value is None:
        return None
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
    names = [name for name, array in arrays.items() if floating(array)]
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
