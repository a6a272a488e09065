"""Unmerged recovery LoRA: a parallel low-rank delta on the frozen 4-bit base.

    y = base(x) + (alpha / r) * (x A^T) B^T

The base layer (usually a `QuantizedLinear`) is never merged, dequantized or requantized: merging
then requantizing to 4 bits erases most of the adapter's effect (the paper measured how little
survives, `measure/evaluate.py`). Targets are attention, linear-attention and
shared-expert projections; routed experts are never adapted, since they are streamed.

File format: `<module path>.lora_A [r, in]` and `<module path>.lora_B [out, r]` (no `.weight`),
metadata `r` and `alpha` (flat, or inside the reference's nested `__metadata__` JSON).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..errors import Edge0Error
from .metadata import (
    check_adapter_metadata,
    check_finite,
    flat_metadata,
    floating,
    load_arrays,
    metadata_int,
    read_adapter_header,
    write_adapter,
)

# The reference's published adapters use r=16, alpha=32; a file that records no alpha is read so.
DEFAULT_ALPHA_PER_RANK = 2.0
# The largest scale (alpha / r) a LoRA file may carry. Published adapters use 0.5 to 4 and even
# aggressive ones stay under 100; alpha=-1e30 ran and turned every reply into garbage unflagged.
MAX_LORA_SCALE = 1024.0


class LoRALinear(nn.Module):
    """A linear layer plus a low-rank delta; the base is kept as it is."""

    def __init__(self, base: nn.Module, lora_a: mx.array, lora_b: mx.array, scale: float) -> None:
        super().__init__()
        self.base = base
        self.lora_a = lora_a
        self.lora_b = lora_b
        self.scale = scale

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        delta = (x.astype(self.lora_a.dtype) @ self.lora_a.T) @ self.lora_b.T
        return y + (self.scale * delta).astype(y.dtype)


def linear_dims(module: nn.Module) -> tuple[int, int]:
    """(in, out) of a Linear or QuantizedLinear."""
    if isinstance(module, nn.QuantizedLinear):
        return module.scales.shape[-1] * module.group_size, module.weight.shape[0]
    if isinstance(module, nn.Linear):
        return module.weight.shape[1], module.weight.shape[0]
    raise TypeError(type(module).__name__)


@dataclass
class LoRAAdapter:
    path: Path
    r: int
    alpha: float
    k: int | None
    weights: dict[str, tuple[mx.array, mx.array]]  # module path -> (A, B)

    @property
    def scale(self) -> float:
        return self.alpha / self.r


def load_lora(path: Path, fingerprint: str) -> LoRAAdapter:
    entries, raw_meta = read_adapter_header(path)
    meta = flat_metadata(raw_meta)
    check_adapter_metadata(meta, "lora", fingerprint, path)
    modules: dict[str, dict[str, str]] = {}
    for name in entries:
        module, _, part = name.rpartition(".")
        if part not in ("lora_A", "lora_B") or not module:
            raise Edge0Error(
                f"{path}: unexpected tensor {name!r} (expected <module>.lora_A/lora_B)"
            )
        modules.setdefault(module, {})[part] = name
    if not modules:
        raise Edge0Error(f"{path}: no LoRA tensors")
    tensors = load_arrays(path)
    check_finite(path, tensors)
    weights = {}
    ranks = set()
    for module, parts in modules.items():
        if set(parts) != {"lora_A", "lora_B"}:
            raise Edge0Error(f"{path}: {module} needs both lora_A and lora_B")
        a, b = tensors[parts["lora_A"]], tensors[parts["lora_B"]]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1] or a.shape[0] == 0:
            raise Edge0Error(
                f"{path}: {module} has lora_A {list(a.shape)}, lora_B {list(b.shape)} "
                "(expected [r, in] and [out, r], r >= 1)"
            )
        if not (floating(a) and floating(b)):
            dtypes = f"{entries[parts['lora_A']].dtype}/{entries[parts['lora_B']].dtype}"
            raise Edge0Error(f"{path}: {module} is {dtypes}, not floating point")
        ranks.add(a.shape[0])
        weights[module] = (a, b)
    if len(ranks) != 1:
        raise Edge0Error(f"{path}: modules disagree on the rank ({sorted(ranks)})")
    r = ranks.pop()
    meta_r = metadata_int(meta, "r", path)
    if meta_r not in (None, r):
        raise Edge0Error(f"{path}: metadata r={meta_r} but the tensors have rank {r}")
    try:
        alpha = float(meta.get("alpha", DEFAULT_ALPHA_PER_RANK * r))
        if not math.isfinite(alpha):
            raise ValueError(alpha)
    except (TypeError, ValueError, OverflowError):
        raise Edge0Error(f"{path}: metadata alpha={meta.get('alpha')!r} is not a number") from None
    check_scale(path, alpha, r)
    return LoRAAdapter(path, r, alpha, metadata_int(meta, "K", path), weights)


def _resolve(model: nn.Module, module_path: str) -> tuple[nn.Module, str, nn.Module]:
    """(parent, attribute, module) for a dotted path; list children are indexed by number."""
    parent: object = model
    parts = module_path.split(".")
    for part in parts[:-1]:
        if isinstance(parent, list):
            index = int(part) if part.isascii() and part.isdigit() else len(parent)
            parent = parent[index] if index < len(parent) else None
        else:
            parent = getattr(parent, part, None)
        if parent is None:
            raise KeyError(module_path)
    module = getattr(parent, parts[-1], None)
    if module is None:
        raise KeyError(module_path)
    return parent, parts[-1], module


class AppliedLoRA:
    """LoRA deltas installed on a model; `remove()` puts the bases back (for K hot-swaps)."""

    def __init__(self, model: nn.Module, adapter: LoRAAdapter, dtype: mx.Dtype | None) -> None:
        self._installed: list[tuple[nn.Module, str, nn.Module]] = []
        plan = []
        for module_path, (a, b) in adapter.weights.items():
            if "switch_mlp" in module_path or ".experts." in module_path:
                raise Edge0Error(
                    f"{adapter.path}: {module_path} is a routed expert; LoRA never adapts those"
                )
            try:
                parent, attribute, base = _resolve(model, module_path)
            except KeyError:
                raise Edge0Error(
                    f"{adapter.path}: target {module_path!r} does not exist in this model"
                ) from None
            try:
                dims = linear_dims(base)
            except TypeError:
                raise Edge0Error(
                    f"{adapter.path}: target {module_path!r} is not a linear layer "
                    f"({type(base).__name__})"
                ) from None
            if (a.shape[1], b.shape[0]) != dims:
                raise Edge0Error(
                    f"{adapter.path}: {module_path} is {dims[0]}->{dims[1]} but the adapter is "
                    f"{a.shape[1]}->{b.shape[0]}"
                )
            if dtype is not None:
                a, b = a.astype(dtype), b.astype(dtype)
            plan.append((parent, attribute, base, a, b))
        for parent, attribute, base, a, b in plan:  # all checked: install atomically
            setattr(parent, attribute, LoRALinear(base, a, b, adapter.scale))
            self._installed.append((parent, attribute, base))
        mx.eval([(a, b) for *_, a, b in plan])
        # The weights as installed (in `dtype`): the file's, kept beside them, were a second
        # copy that no memory plan counts.
        installed = {path: (a, b) for path, (*_, a, b) in zip(adapter.weights, plan)}
        self.adapter = replace(adapter, weights=installed)

    def remove(self) -> None:
        for parent, attribute, base in self._installed:
            setattr(parent, attribute, base)
        self._installed.clear()


def check_scale(path: Path, alpha: float, r: int) -> None:
    """Refuse a LoRA whose scale (alpha / r) is not above 0 and at most `MAX_LORA_SCALE`."""
    scale = alpha / r
    if not 0 < scale <= MAX_LORA_SCALE:
        raise Edge0Error(
            f"{path}: metadata alpha={alpha:g} with rank {r} scales the LoRA by {scale:g}; "
            f"a LoRA's scale (alpha / r) is above 0 and at most {MAX_LORA_SCALE:g}"
        )


def save_lora(
    path: Path,
    weights: dict[str, tuple[mx.array, mx.array]],
    r: int,
    alpha: float,
    k: int,
    fingerprint: str,
) -> None:
    check_scale(path, alpha, r)
    tensors = {}
    for module, (a, b) in weights.items():
        tensors[f"{module}.lora_A"] = a.astype(mx.float16)
        tensors[f"{module}.lora_B"] = b.astype(mx.float16)
    metadata = {
        "kind": "lora",
        "K": str(k),
        "r": str(r),
        "alpha": str(alpha),
        "base_fingerprint": fingerprint,
        "format_version": "1",
    }
    write_adapter(path, tensors, metadata)
