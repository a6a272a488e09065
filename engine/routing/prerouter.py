"""The prerouter: small trained heads that predict the next layer's routing one token ahead.

The head owned by layer N reads N's MoE input x at token t with this step's and the previous step's
executed top-k one-hots, and predicts layer N+1's router logits at token t+1 (the next MoE
layer's, where dense layers come between, as in Llama-4-Maverick: `next_moe_layer`):

    z = [x; onehot_K(A_t); onehot_K(A_{t-1})]
    u = linear_init(z) + fc2(gelu_erf(fc1(z)))

At decode each head runs as soon as its owner has computed (`RoutingState`); after a prefill chunk
all heads run in one batched flush. The predicted logits go through the consumer layer's own
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
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from ..adapters.metadata import (
    check_adapter_metadata,
    check_finite,
    flat_metadata,
    floating,
    load_arrays,
    metadata_int,
    metadata_list,
    read_adapter_header,
    write_adapter,
)
from ..checkpoint.index import brief
from ..errors import Edge0Error

HEAD_PARTS = ("fc1", "fc2", "linear_init")


def gelu_erf(x: mx.array) -> mx.array:
    """The exact (erf) GELU the heads are trained and served with."""
    return 0.5 * x * (1.0 + mx.erf(x / math.sqrt(2.0)))


def head_forward(fc1: mx.array, fc2: mx.array, linear_init: mx.array, z: mx.array) -> mx.array:
    """`u = linear_init(z) + fc2(gelu_erf(fc1(z)))`: weights `[..., out, in]` (one head, or `n`
    stacked heads with `z` of shape `[n, M, in]`), features `[..., in]` -> logits `[..., E]`."""
    hidden = gelu_erf(z @ fc1.swapaxes(-1, -2))
    return z @ linear_init.swapaxes(-1, -2) + hidden @ fc2.swapaxes(-1, -2)


def multi_hot(routed: mx.array, experts: int, dtype: mx.Dtype) -> mx.array:
    """Expert indices `[..., k]` -> `[..., E]`, one at each routed expert. An index of -1 marks
    "not known" (e.g. the step before a request's first token) and sets nothing."""
    return (routed[..., None] == mx.arange(experts)).any(axis=-2).astype(dtype)


def head_features(
    x: mx.array, routed_now: mx.array, routed_before: mx.array, experts: int
) -> mx.array:
    """The heads' input `z = [x; onehot_K(A_t); onehot_K(A_{t-1})]` in x's dtype: the owner's MoE
    input `[..., H]` and the experts it executed at this token and the one before (`[..., k]`
    indices each) -> `[..., H+2E]`. Serving, the student path and phase-1 training all build
    features here, so a head sees the same input wherever it runs."""
    now = multi_hot(routed_now, experts, x.dtype)
    before = multi_hot(routed_before, experts, x.dtype)
    return mx.concatenate([x, now, before], axis=-1)


def sequence_features(x: mx.array, routed: mx.array, experts: int) -> mx.array:
    """`head_features` at every position of sequences: x `[..., T, H]`, routed `[..., T, k]`;
    A_{t-1} is the previous position's set (none at position 0)."""
    routed = routed.astype(mx.int32)  # top-k indices are unsigned; -1 must fit
    unknown = mx.full(routed[..., :1, :].shape, -1, mx.int32)
    before = mx.concatenate([unknown, routed[..., :-1, :]], axis=-2)
    return head_features(x, routed, before, experts)


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
    # The layer each head predicts (its owner's next MoE layer); owner + 1 unless set.
    consumers: list[int] | None = None
    # The same weights as [n, in, out] for the flush, once prepared for serving.
    _serving: tuple[mx.array, mx.array, mx.array] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.consumers is None:
            self.consumers = [owner + 1 for owner in self.owners]

    def __call__(self, z: mx.array, first: int = 0, end: int | None = None) -> mx.array:
        """Logits `[n, E]` for features `[n, H+2E]`, one row per owner of heads `first:end` (all
        by default; a slice of the stacked weights is a view, not a copy); `[n, rows, E]` for
        features `[n, rows, H+2E]`, each owner's head over several sequences' rows."""
        rows = slice(first, end)
        single = z.ndim == 2
        z = z[:, None, :] if single else z
        if self._serving is None:
            weights = (self.fc1[rows], self.fc2[rows], self.linear_init[rows])
            out = head_forward(*weights, z)
        else:
            fc1_t, fc2_t, linear_init_t = (w[rows] for w in self._serving)
            out = z @ linear_init_t + gelu_erf(z @ fc1_t) @ fc2_t
        return out[:, 0, :] if single else out

    def prepare_for_serving(self, dtype: mx.Dtype) -> PrerouterHeads:
        """Cast, and keep the weights transposed to `[n, in, out]` in memory: the per-step flush is
        a batched vector-matrix product, which the MLX CPU backend runs faster on contiguous
        `[in, out]` weights than through a transposed view (docs/notebook/figures-from-code-comments.md)."""
        self._serving = tuple(
            mx.contiguous(a.astype(dtype).swapaxes(1, 2))
            for a in (self.fc1, self.fc2, self.linear_init)
        )
        mx.eval(self._serving)
        # One copy in memory: the `[n, out, in]` weights other paths read (the student's, a
        # save) are views of the transposed ones. Two copies doubled the heads' memory, which no
        # memory plan counted.
        self.fc1, self.fc2, self.linear_init = (a.swapaxes(1, 2) for a in self._serving)
        return self


def load_prerouter(
    path: Path, num_layers: int, hidden: int, experts: int, fingerprint: str, k: int | None = None
) -> PrerouterHeads:
    """Read and validate a prerouter file against the model it is meant for."""
    # Three tensors a head, one head a layer but the last; files from elsewhere may carry more (a
    # bias a part), which are ignored: up to 8 a layer.
    entries, raw_meta = read_adapter_header(path, 8 * num_layers + 64)
    meta = flat_metadata(raw_meta)
    check_adapter_metadata(meta, "prerouter", fingerprint, path)
    file_k = metadata_int(meta, "K", path)
    if k is not None and file_k is not None and file_k != k:
        raise Edge0Error(f"{path}: metadata says K={file_k} but it was loaded as K={k}")
    for value in (file_k, k):
        if value is not None and not 1 <= value <= experts:
            raise Edge0Error(f"{path}: K={value} is not between 1 and the {experts} experts")

    parts: dict[int, dict[str, str]] = {}
    for name in entries:
        pieces = name.split(".")
        if len(pieces) >= 4 and pieces[0] == "layers" and pieces[-1] == "weight":
            if pieces[-2] in HEAD_PARTS and pieces[1].isascii() and pieces[1].isdigit():
                head = parts.setdefault(int(pieces[1]), {})
                if pieces[-2] in head:
                    raise Edge0Error(
                        f"{path}: two {pieces[-2]} tensors for layer {int(pieces[1])} "
                        f"({head[pieces[-2]]!r} and {name!r})"
                    )
                head[pieces[-2]] = name
    if not parts:
        raise Edge0Error(f"{path}: no prerouter heads (expected layers.N.fc1.weight ...)")
    owners = sorted(parts)
    listed = metadata_list(meta, "owners", path)
    if listed is not None and sorted(listed) != owners:
        raise Edge0Error(
            f"{path}: metadata owners {brief(listed)} do not match the heads {brief(owners)}"
        )
    bad = [n for n in owners if not 0 <= n < num_layers - 1]
    if bad:
        raise Edge0Error(
            f"{path}: owner layers {brief(bad)} are outside 0..{num_layers - 2} (the model has "
            f"{num_layers} layers; the last layer owns no head)"
        )

    width = hidden + 2 * experts
    tensors = load_arrays(path)
    check_finite(path, tensors)
    stacks: dict[str, list[mx.array]] = {p: [] for p in HEAD_PARTS}
    inner = None
    for owner in owners:
        missing = [p for p in HEAD_PARTS if p not in parts[owner]]
        if missing:
            raise Edge0Error(f"{path}: head of layer {owner} lacks {', '.join(missing)}")
        if inner is None:  # the heads' inner width is the file's own: the first fc1 sets it
            first = tensors[parts[owner]["fc1"]].shape
            inner = first[0] if len(first) == 2 else "inner"
        for part, want in (
            ("fc1", (inner, width)),
            ("fc2", (experts, inner)),
            ("linear_init", (experts, width)),
        ):
            name = parts[owner][part]
            array = tensors[name]
            if tuple(array.shape) != want:
                raise Edge0Error(
                    f"{path}: {part} of layer {owner} of shape {list(array.shape)} does not fit "
                    f"this model (expected {list(want)}: hidden {hidden} + 2 x {experts} experts)"
                )
            if not floating(array):
                raise Edge0Error(
                    f"{path}: {part} of layer {owner} is {entries[name].dtype}, not floating point"
                )
            stacks[part].append(array)
    fc1, fc2, linear_init = (mx.stack(stacks[p]) for p in HEAD_PARTS)
    return PrerouterHeads(path, file_k or k or 0, owners, hidden, experts, fc1, fc2, linear_init)


def load_profile_heads(
    path: Path,
    num_layers: int,
    hidden: int,
    experts: int,
    fingerprint: str,
    k: int,
    moe_layers: set[int],
    dtype: mx.Dtype,
) -> PrerouterHeads:
    """A profile's heads, as the engine and the student path both use them: every owner must be a
    MoE layer (its routed experts are the one-hot features); only owners followed by a MoE layer
    are kept (they have a consumer: the next MoE layer); weights in the compute dtype."""
    heads = load_prerouter(path, num_layers, hidden, experts, fingerprint, k=k)
    not_moe = [o for o in heads.owners if o not in moe_layers]
    if not_moe:
        raise Edge0Error(f"{path}: owner layers {not_moe} are not MoE layers of this model")
    owners = [o for o in heads.owners if next_moe_layer(o, moe_layers) is not None]
    if not owners:
        raise Edge0Error(f"{path}: none of its owner layers precedes a MoE layer")
    return keep_owners(heads, owners, moe_layers).prepare_for_serving(dtype)


def next_moe_layer(layer: int, moe_layers) -> int | None:
    """The layer a head owned by `layer` predicts: the next MoE layer. That is layer + 1 where
    every layer is MoE; where dense layers come between (Llama-4-Maverick), the one after them."""
    later = [m for m in moe_layers if m > layer]
    return min(later) if later else None


def keep_owners(heads: PrerouterHeads, owners: list[int], moe_layers=None) -> PrerouterHeads:
    """The same heads restricted to `owners`, each predicting its next layer of `moe_layers`
    (owner + 1 without them)."""
    rows = mx.array([heads.owners.index(o) for o in owners])
    consumers = None
    if moe_layers is not None:
        consumers = [next_moe_layer(o, moe_layers) for o in owners]
    return PrerouterHeads(
        heads.path,
        heads.k,
        list(owners),
        heads.hidden,
        heads.experts,
        heads.fc1[rows],
        heads.fc2[rows],
        heads.linear_init[rows],
        consumers,
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
    write_adapter(path, tensors, metadata)
