"""The prerouter: small trained heads that predict the next layer's routing one token ahead.

The head owned by layer N reads N's MoE input x at token t with this step's and the previous step's
executed top-k one-hots, and predicts layer N+1's router logits at token t+1:

    z = [x; onehot_K(A_t); onehot_K(A_{t-1})]
    u = linear_init(z) + fc2(gelu_erf(fc1(z)))

All heads run in one batched flush per step. The predicted logits go through the consumer layer's own
routing function (`routing.route`), and at decode the consumer routes by them: the prediction *is*
the routing, so the experts read ahead are exactly the experts used.

File format (the reference implementation's, read as published): per owner N,
`layers.N.fc1.weight [512, H+2E]`, `layers.N.fc2.weight [E, 512]`, `layers.N.linear_init.weight
[E, H+2E]`, fp16, no biases; nested names such as `layers.N.mlp.prerouter.fc1.weight` are accepted.
Metadata: ours is flat (`kind`, `K`, `owners`, `start_layer`, `hidden`, `experts`,
`base_fingerprint`); the reference's is one `__metadata__` key holding a JSON string.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from .checkpoint_index import read_safetensors
from .errors import Edge0Error

HEAD_PARTS = ("fc1", "fc2", "linear_init")


def flat_metadata(raw: dict) -> dict:
    """Metadata as a flat dict, unwrapping the reference's `{"__metadata__": "<json>"}` form."""
    meta = dict(raw)
    nested = meta.pop("__metadata__", None)
    if isinstance(nested, str):
        try:
            inner = json.loads(nested)
        except json.JSONDecodeError:
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
    except (TypeError, ValueError):
        raise Edge0Error(f"{path}: metadata {key}={value!r} is not an integer") from None


def metadata_list(meta: dict, key: str, path: Path) -> list[int] | None:
    value = meta.get(key)
    if value is None:
        return None
    try:
        items = json.loads(value) if isinstance(value, str) else value
        return [int(v) for v in items]
    except (TypeError, ValueError, json.JSONDecodeError):
        raise Edge0Error(f"{path}: metadata {key}={value!r} is not a list of layers") from None


@dataclass
class PrerouterHeads:
    """The heads of one prerouter file, stacked for one batched evaluation."""

    path: Path | None
    k: int
    owners: list[int]
    hidden: int
    experts: int
    fc1: mx.array  # [n, 512, H+2E]
    fc2: mx.array  # [n, E, 512]
    linear_init: mx.array  # [n, E, H+2E]

    def __call__(self, z: mx.array) -> mx.array:
        """Logits `[n, E]` for features `[n, H+2E]`, one row per owner."""
        z = z[:, None, :]
        h = z @ self.fc1.swapaxes(1, 2)
        h = 0.5 * h * (1.0 + mx.erf(h / math.sqrt(2.0)))  # exact (erf) GELU, as trained
        u = z @ self.linear_init.swapaxes(1, 2) + h @ self.fc2.swapaxes(1, 2)
        return u[:, 0, :]

    def astype(self, dtype: mx.Dtype) -> PrerouterHeads:
        self.fc1, self.fc2, self.linear_init = (
            a.astype(dtype) for a in (self.fc1, self.fc2, self.linear_init)
        )
        return self


def load_prerouter(
    path: Path, num_layers: int, hidden: int, experts: int, fingerprint: str, k: int | None = None
) -> PrerouterHeads:
    """Read and validate a prerouter file against the model it is meant for."""
    entries, raw_meta = read_safetensors(path)
    meta = flat_metadata(raw_meta)
    if meta.get("kind", "prerouter") != "prerouter":
        raise Edge0Error(f"{path}: not a prerouter file (kind={meta.get('kind')!r})")
    if meta.get("base_fingerprint") not in (None, fingerprint):
        raise Edge0Error(
            f"{path}: trained for another base model (fingerprint {meta['base_fingerprint']}, "
            f"this model is {fingerprint})"
        )
    file_k = metadata_int(meta, "K", path)
    if k is not None and file_k is not None and file_k != k:
        raise Edge0Error(f"{path}: metadata says K={file_k} but it was loaded as K={k}")

    parts: dict[int, dict[str, str]] = {}
    for name in entries:
        pieces = name.split(".")
        if len(pieces) >= 4 and pieces[0] == "layers" and pieces[-1] == "weight":
            if pieces[-2] in HEAD_PARTS and pieces[1].isdigit():
                parts.setdefault(int(pieces[1]), {})[pieces[-2]] = name
    if not parts:
        raise Edge0Error(f"{path}: no prerouter heads (expected layers.N.fc1.weight ...)")
    owners = sorted(parts)
    listed = metadata_list(meta, "owners", path)
    if listed is not None and sorted(listed) != owners:
        raise Edge0Error(f"{path}: metadata owners {listed} do not match the heads {owners}")
    bad = [n for n in owners if not 0 <= n < num_layers - 1]
    if bad:
        raise Edge0Error(
            f"{path}: owner layers {bad} are outside 0..{num_layers - 2} (the model has "
            f"{num_layers} layers; the last layer owns no head)"
        )

    width = hidden + 2 * experts
    tensors = mx.load(str(path))
    stacks: dict[str, list[mx.array]] = {p: [] for p in HEAD_PARTS}
    for owner in owners:
        missing = [p for p in HEAD_PARTS if p not in parts[owner]]
        if missing:
            raise Edge0Error(f"{path}: head of layer {owner} lacks {', '.join(missing)}")
        for part in HEAD_PARTS:
            stacks[part].append(tensors[parts[owner][part]])
    fc1, fc2, linear_init = (mx.stack(stacks[p]) for p in HEAD_PARTS)
    inner = fc1.shape[1]
    for name, array, want in (
        ("fc1", fc1, (inner, width)),
        ("fc2", fc2, (experts, inner)),
        ("linear_init", linear_init, (experts, width)),
    ):
        if tuple(array.shape[1:]) != want:
            raise Edge0Error(
                f"{path}: {name} of shape {list(array.shape[1:])} does not fit this model "
                f"(expected {list(want)}: hidden {hidden} + 2 x {experts} experts)"
            )
    return PrerouterHeads(path, file_k or k or 0, owners, hidden, experts, fc1, fc2, linear_init)


def keep_owners(heads: PrerouterHeads, owners: list[int]) -> PrerouterHeads:
    """The same heads restricted to `owners` (e.g. those whose next layer is a MoE layer)."""
    rows = mx.array([heads.owners.index(o) for o in owners])
    return PrerouterHeads(
        heads.path,
        heads.k,
        list(owners),
        heads.hidden,
        heads.experts,
        heads.fc1[rows],
        heads.fc2[rows],
        heads.linear_init[rows],
    )


def save_prerouter(path: Path, heads: PrerouterHeads, start_layer: int, fingerprint: str) -> None:
    tensors = {}
    for i, owner in enumerate(heads.owners):
        tensors[f"layers.{owner}.fc1.weight"] = heads.fc1[i].astype(mx.float16)
        tensors[f"layers.{owner}.fc2.weight"] = heads.fc2[i].astype(mx.float16)
        tensors[f"layers.{owner}.linear_init.weight"] = heads.linear_init[i].astype(mx.float16)
    metadata = {
        "kind": "prerouter",
        "K": str(heads.k),
        "owners": json.dumps(heads.owners),
        "start_layer": str(start_layer),
        "hidden": str(heads.hidden),
        "experts": str(heads.experts),
        "base_fingerprint": fingerprint,
        "format_version": "1",
    }
    mx.save_safetensors(str(path), tensors, metadata=metadata)


def onehot(routed: np.ndarray | None, experts: int) -> np.ndarray:
    """Multi-hot of one token's routed experts (zeros when unknown)."""
    vector = np.zeros(experts, dtype=np.float32)
    if routed is not None:
        vector[np.asarray(routed).reshape(-1)] = 1.0
    return vector
