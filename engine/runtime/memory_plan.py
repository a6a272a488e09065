"""The memory plan: what a run will hold at its peak, computed before any weight is read.

    total = runtime + resident weights + expert cache + prefill transient + KV cache + working

- runtime: this process as planning finds it (Python, MLX, mlx-lm, the tokenizer, the model's
  structure with no weights read): measured, not estimated.
- resident weights: every tensor that is not a routed expert (attention, norms, routers, shared
  experts, embeddings), floating ones in the compute dtype.
- expert cache: the slot banks at the routing width K (at least one routed set a layer).
- prefill transient: the most a prefill chunk holds beyond the above: with whole-layer reads
  (only where two layers fit the plan and the expert cache's own size), a layer's experts and the
  next layer's read; the 4-bit kernels' activations (bounded in blocks:
  `GATHER_ACTIVATION_BYTES`); the dense path's fp32 copies; a chunk's attention scores.
- KV cache: keys and values of every layer at the context the run allows.
- working: a chunk's hidden states and the logits.

The total is held against what the machine leaves: MemAvailable, lowered to what the tightest
memory cgroup leaves (`linux_memory.available_memory_bytes`), plus what this process already
holds. Where whole-layer reads do not fit, prefill goes through the expert cache instead
(`EngineConfig.whole_layer_prefill`); where nothing fits, the run is refused before it loads.
On a Mac the limit comes from `vm_stat` and Metal's recommended working set, and the plan's resident
weights and expert cache are wired (`wire_for_plan`).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx

from ..checkpoint.families import MoESite
from ..checkpoint.index import CheckpointIndex, TensorEntry
from ..config import EngineConfig, format_bytes
from ..errors import Edge0Error
from ..experts.pool import ExpertPool
from ..experts.store import expert_layout
from ..experts.switch_glu import DENSE_EVAL_BYTES, GATHER_ACTIVATION_BYTES
from .linux_memory import cgroup_memory, read_meminfo
from .macos_memory import MacMemoryCounters, available_bytes, read_mac_counters
from .metrics import metal_wired_limit_bytes, process_rss_bytes

# The context a run allows when the model's own is longer: the KV cache is planned for it.
DEFAULT_CONTEXT_TOKENS = 8192


@dataclass(frozen=True)
class MemoryPlan:
    runtime_bytes: int
    resident_bytes: int
    expert_cache_bytes: int
    prefill_bytes: int
    kv_cache_bytes: int
    working_bytes: int
    whole_layer_prefill: bool
    context_tokens: int
    k: int
    # What the run may hold in all (None: unknown), and where that figure comes from.
    limit_bytes: int | None
    limit_source: str
    # What the engine's caller holds beside it, planned with the rest: a training step's layer
    # inputs and logits (`EngineConfig.held_bytes`).
    held_bytes: int = 0
    # The largest K profile's heads and LoRA once loaded (a K or mode switch may load any).
    adapter_bytes: int = 0
    kv_sequences: int = 1  # sequences' KV caches at the context counted (`kv_copies`)

    @property
    def total_bytes(self) -> int:
        return (
            self.runtime_bytes
            + self.resident_bytes
            + self.expert_cache_bytes
            + self.prefill_bytes
            + self.kv_cache_bytes
            + self.working_bytes
            + self.held_bytes
            + self.adapter_bytes
        )

    @property
    def fits(self) -> bool:
        return self.limit_bytes is None or self.total_bytes <= self.limit_bytes

    def terms(self) -> list[tuple[str, int]]:
        prefill = "prefill (whole layers)" if self.whole_layer_prefill else "prefill (via cache)"
        terms = [
            ("runtime", self.runtime_bytes),
            ("resident weights", self.resident_bytes),
            (f"expert cache (K={self.k})", self.expert_cache_bytes),
            (prefill, self.prefill_bytes),
            (self._kv_term(), self.kv_cache_bytes),
            ("working", self.working_bytes),
        ]
        if self.adapter_bytes:
            terms.append(("adapters (largest K profile)", self.adapter_bytes))
        if self.held_bytes:
            terms.append(("training step", self.held_bytes))
        return terms

    def _kv_term(self) -> str:
        if self.kv_sequences == 1:
            return f"KV cache ({self.context_tokens:,} tokens)"
        return f"KV cache ({self.kv_sequences} x {self.context_tokens:,} tokens, a batch)"

    def as_dict(self) -> dict:
        """For `--json` reports: every term in bytes, the total and the limit."""
        return {
            "runtime_bytes": self.runtime_bytes,
            "resident_bytes": self.resident_bytes,
            "expert_cache_bytes": self.expert_cache_bytes,
            "prefill_bytes": self.prefill_bytes,
            "kv_cache_bytes": self.kv_cache_bytes,
            "working_bytes": self.working_bytes,
            "held_bytes": self.held_bytes,
            "adapter_bytes": self.adapter_bytes,
            "total_bytes": self.total_bytes,
            "limit_bytes": self.limit_bytes,
            "limit_source": self.limit_source,
            "fits": self.fits,
            "whole_layer_prefill": self.whole_layer_prefill,
            "context_tokens": self.context_tokens,
            "k": self.k,
        }

    def line(self) -> str:
        """One line for a command's start."""
        limit = (
            f" of {format_bytes(self.limit_bytes)} ({self.limit_source})"
            if self.limit_bytes is not None
            else ""
        )
        parts = ", ".join(f"{name} {format_bytes(n)}" for name, n in self.terms())
        return f"memory plan: {format_bytes(self.total_bytes)}{limit}: {parts}"

    def table(self) -> str:
        """Every term on its line, the total, and what the machine leaves (`edge0 info --memory`)."""
        rows = [f"  {name:<28} {format_bytes(n):>12}" for name, n in self.terms()]
        rows.append(f"  {'total':<28} {format_bytes(self.total_bytes):>12}")
        if self.limit_bytes is not None:
            verdict = "fits" if self.fits else "does NOT fit"
            rows.append(
                f"  {'available':<28} {format_bytes(self.limit_bytes):>12}  "
                f"({self.limit_source}): {verdict}"
            )
        return "\n".join(rows)

    def refusal(self, model: str, min_expert_cache_bytes: int) -> str:
        """What to lower, and by how much, when the plan does not fit."""
        over = self.total_bytes - (self.limit_bytes or 0)
        head = (
            f"{model}: the memory plan needs {format_bytes(self.total_bytes)} but "
            f"{format_bytes(self.limit_bytes or 0)} is available ({self.limit_source}); "
        )
        if self.expert_cache_bytes - over >= min_expert_cache_bytes:
            target = self.expert_cache_bytes - over
            return head + (
                f"lower --expert-cache by {format_bytes(over)} (to {format_bytes(target)} or less)"
                " (`edge0 info MODEL --memory` shows every term)"
            )
        return head + (
            f"even the smallest expert cache ({format_bytes(min_expert_cache_bytes)}, one routed "
            "set a layer) leaves it over: use a lower K, or a machine with more memory "
            "(`edge0 info MODEL --memory` shows every term)"
        )


class PlanRefused(Edge0Error):
    """A load refused because its plan does not fit, with the plan and the smallest expert cache
    it could have: a caller with a knob of its own (a training step's rows) can find what fits."""

    def __init__(self, message: str, plan: MemoryPlan, smallest_cache_bytes: int) -> None:
        super().__init__(message)
        self.plan, self.smallest_cache_bytes = plan, smallest_cache_bytes


def memory_limit(
    proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")
) -> tuple[int | None, str]:
    """What this process may hold in all, and where the figure comes from: what it holds now
    plus what the machine leaves (Linux: MemAvailable, at most its memory cgroup's limit, the
    tightest of its ancestors'; macOS: free, file-backed and purgeable pages from `vm_stat`, at
    most Metal's recommended working set); else physical memory."""
    meminfo = read_meminfo(proc / "meminfo")
    if meminfo is not None and "MemAvailable" in meminfo:
        limit, source = process_rss_bytes() + meminfo["MemAvailable"], "MemAvailable"
        try:
            cgroup = cgroup_memory((proc / "self" / "cgroup").read_text(), cgroup_root)
        except OSError:
            cgroup = None
        if cgroup is not None and cgroup.limit_bytes < limit:
            limit, source = cgroup.limit_bytes, f"memory cgroup v{cgroup.version} limit"
        return limit, source
    if sys.platform == "darwin" and (counters := read_mac_counters()) is not None:
        return mac_memory_limit(process_rss_bytes(), counters, metal_wired_limit_bytes())
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical memory"
    except (ValueError, OSError, AttributeError):
        return None, "unknown"


def mac_memory_limit(
    rss_bytes: int, counters: MacMemoryCounters, working_set_bytes: int | None
) -> tuple[int, str]:
    """A Mac's limit: what the process holds plus what `vm_stat` shows available, at most
    Metal's recommended working set (past it MLX's buffers page, and the GPU waits on them)."""
    limit, source = rss_bytes + available_bytes(counters), "vm_stat: free + file-backed + purgeable"
    if working_set_bytes is not None and working_set_bytes < limit:
        limit, source = working_set_bytes, "Metal's recommended working set"
    return limit, source


def wired_bytes_for(plan: MemoryPlan, working_set_bytes: int | None) -> int | None:
    """The Metal wired limit a run asks for: its resident weights and expert cache (the memory
    every step touches, which paging would stall), never more than the recommended working set;
    None without Metal."""
    if working_set_bytes is None:
        return None
    return min(plan.resident_bytes + plan.expert_cache_bytes, working_set_bytes)


def wire_for_plan(plan: MemoryPlan) -> int | None:
    """Wire the plan's resident memory on Metal (`mx.set_wired_limit`); the limit set, or None
    where there is no Metal."""
    wired = wired_bytes_for(plan, metal_wired_limit_bytes())
    if wired is not None:
        mx.set_wired_limit(wired)
    return wired


def kv_bytes_per_token(model_config: dict, itemsize: int) -> int:
    """Keys and values of one token over every layer, from config.json. Models with layers
    that keep no per-token cache (linear attention, sliding windows) are counted as if every
    layer did: an upper bound."""
    text = model_config.get("text_config", model_config)
    layers = int(text.get("num_hidden_layers") or 0)
    heads = int(text.get("num_attention_heads") or 1)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    hidden = int(text.get("hidden_size") or 0)
    head_dim = int(text.get("head_dim") or (hidden // heads if heads else 0))
    if text.get("kv_lora_rank"):  # multi-head latent attention, cached decompressed per head
        k_dim = int(text.get("qk_nope_head_dim", 0)) + int(text.get("qk_rope_head_dim", 0))
        v_dim = int(text.get("v_head_dim", head_dim))
        return layers * heads * (k_dim + v_dim) * itemsize
    return layers * kv_heads * 2 * head_dim * itemsize


@dataclass(frozen=True)
class PlanInputs:
    """The sizes a plan is made of, known before any weight is read."""

    resident_bytes: int
    largest_layer_expert_bytes: int  # one layer's routed experts, as resident
    largest_expert_weights: int  # one expert's weights over its projections (its fp32 copy / 4)
    hidden: int
    vocab: int
    heads: int
    kv_bytes_per_token: int
    itemsize: int  # the compute dtype's
    context_tokens: int
    prefill_chunk: int
    dense_prefill: bool
    sequences: int = 1  # replies decoding together (EngineConfig.max_batch)


def kv_copies(inputs: PlanInputs) -> int:
    """Sequences' KV caches at the planned context that can be alive at once: one reply's; a
    batch's `sequences`, and as many again while a joining or leaving reply makes mlx-lm copy
    the batch caches into new ones (`extend`, `filter`)."""
    return 1 if inputs.sequences == 1 else 2 * inputs.sequences


def plan_memory(
    inputs: PlanInputs,
    expert_cache_bytes: int,
    k: int,
    whole_layer_prefill: bool,
    limit: tuple[int | None, str],
    held_bytes: int = 0,
    adapter_bytes: int = 0,
) -> MemoryPlan:
    chunk = min(inputs.prefill_chunk, inputs.context_tokens)
    prefill = GATHER_ACTIVATION_BYTES
    if whole_layer_prefill:
        prefill += 2 * inputs.largest_layer_expert_bytes
    if inputs.dense_prefill:  # a group of fp32 copies evaluated together, and the next expert's
        prefill += DENSE_EVAL_BYTES + 4 * inputs.largest_expert_weights
    # Attention scores of a chunk against the context (the CPU's attention materialises them).
    prefill += chunk * inputs.context_tokens * inputs.heads * 4
    working = 8 * chunk * inputs.hidden * inputs.itemsize + 4 * inputs.vocab * 4
    limit_bytes, source = limit
    return MemoryPlan(
        runtime_bytes=process_rss_bytes(),  # this process as planning finds it
        resident_bytes=inputs.resident_bytes,
        expert_cache_bytes=expert_cache_bytes,
        prefill_bytes=prefill,
        kv_cache_bytes=inputs.kv_bytes_per_token * inputs.context_tokens * kv_copies(inputs),
        working_bytes=working,
        whole_layer_prefill=whole_layer_prefill,
        context_tokens=inputs.context_tokens,
        k=k,
        limit_bytes=limit_bytes,
        limit_source=source,
        held_bytes=held_bytes,
        adapter_bytes=adapter_bytes,
        kv_sequences=kv_copies(inputs),
    )


def without_whole_layers(plan: MemoryPlan, inputs: PlanInputs) -> MemoryPlan:
    """The same plan with prefill through the expert cache."""
    if not plan.whole_layer_prefill:
        return plan
    return replace(
        plan,
        prefill_bytes=plan.prefill_bytes - 2 * inputs.largest_layer_expert_bytes,
        whole_layer_prefill=False,
    )


def context_tokens(model_config: dict) -> int:
    """The context a run allows: the model's, at most `DEFAULT_CONTEXT_TOKENS`."""
    text = model_config.get("text_config", model_config)
    native = model_config.get("max_position_embeddings") or text.get("max_position_embeddings")
    return min(int(native or DEFAULT_CONTEXT_TOKENS), DEFAULT_CONTEXT_TOKENS)


def expert_cache_auto(plan: MemoryPlan, page_cache_share: float = 0.25) -> int:
    """`--expert-cache auto`: what the plan leaves once every other term is counted, less a share
    kept for the OS page cache (a larger expert cache can be slower when it starves the page
    cache the reads come through). Meaningful only where the limit is known."""
    if plan.limit_bytes is None:
        return plan.expert_cache_bytes
    others = plan.total_bytes - plan.expert_cache_bytes
    return max(0, math.floor((plan.limit_bytes - others) * (1 - page_cache_share)))


def _resident_nbytes(entry: TensorEntry, float_dtype: mx.Dtype | None) -> int:
    """A tensor's bytes once in memory: floating ones in the compute dtype."""
    if float_dtype is not None and entry.dtype in ("BF16", "F16", "F32"):
        return math.prod(entry.shape) * float_dtype.size
    return entry.nbytes


def plan_load(
    index: CheckpointIndex,
    model_config: dict,
    config: EngineConfig,
    float_dtype: mx.Dtype | None,
    k: int,
    largest_expert_weights: int,
    dense_prefill: bool,
    adapter_bytes: int = 0,
) -> tuple[MemoryPlan, EngineConfig, Callable[[int], MemoryPlan]]:
    """The plan of a load about to read its weights (the routed experts registered in `index`),
    the config the run keeps it with (`--expert-cache auto` resolved, whole-layer prefill off
    where it does not fit), and the same plan at another K (a K switch grows the banks to one
    routed set of the new K). Raises Edge0Error, naming what to lower, where nothing fits."""
    expert_names = {t.entry.name for layer in index.layers.values() for t in layer.tensors}
    streamed = config.mode != "resident"
    resident = sum(
        _resident_nbytes(entry, float_dtype)
        for name, entry in index.tensors.items()
        if not (streamed and name in expert_names)
    )
    layers = sorted(index.layers)
    layouts = {n: expert_layout(index, n, float_dtype) for n in layers}
    experts = {n: index.layers[n].num_experts for n in layers}
    text = model_config.get("text_config", model_config)
    itemsize = (float_dtype or mx.bfloat16).size
    context = min(config.context_tokens or DEFAULT_CONTEXT_TOKENS, context_tokens(model_config))
    inputs = PlanInputs(
        resident_bytes=resident,
        largest_layer_expert_bytes=max(
            sum(p.nbytes for p in layouts[n]) * experts[n] for n in layers
        ),
        largest_expert_weights=largest_expert_weights,
        hidden=int(text.get("hidden_size") or 0),
        vocab=int(text.get("vocab_size") or 0),
        heads=int(text.get("num_attention_heads") or 1),
        kv_bytes_per_token=kv_bytes_per_token(model_config, itemsize),
        itemsize=itemsize,
        context_tokens=context,
        prefill_chunk=config.prefill_chunk,
        dense_prefill=dense_prefill,
        sequences=config.max_batch,
    )

    def cache_bytes(budget: int, routed: int = k) -> int:
        return ExpertPool(layouts, experts, budget).planned_bytes(routed) if streamed else 0

    whole = streamed and config.whole_layer_prefill is not False
    plan = plan_memory(
        inputs,
        cache_bytes(config.expert_cache_bytes),
        k,
        whole,
        memory_limit(),
        config.held_bytes,
        adapter_bytes if streamed else 0,  # resident mode loads no heads nor LoRA
    )
    if streamed and config.expert_cache_auto:
        routed_set = k * max(sum(p.nbytes for p in layout) for layout in layouts.values())
        budget = max(expert_cache_auto(without_whole_layers(plan, inputs)), routed_set)
        config = replace(config, expert_cache_bytes=budget, expert_cache_auto=False)
        plan = replace(plan, expert_cache_bytes=cache_bytes(budget))
    # Whole layers only where the plan holds them and they are no larger than the expert cache
    # the run was given: --expert-cache bounds a run's expert bytes, prefill's included.
    # (`whole_layer_prefill` True asks for them wherever the plan holds them.)
    cache_bound = config.whole_layer_prefill is None
    too_large = cache_bound and 2 * inputs.largest_layer_expert_bytes > plan.expert_cache_bytes
    if plan.whole_layer_prefill and (not plan.fits or too_large):
        plan = without_whole_layers(plan, inputs)
    if streamed:
        config = replace(config, whole_layer_prefill=plan.whole_layer_prefill)
    if not plan.fits and config.refuse_over_plan:
        smallest = cache_bytes(0) if streamed else 0
        raise PlanRefused(plan.refusal(str(index.model_dir), smallest), plan, smallest)

    def plan_at(other_k: int) -> MemoryPlan:
        return replace(
            plan, k=other_k, expert_cache_bytes=cache_bytes(config.expert_cache_bytes, other_k)
        )

    return plan, config, plan_at


def largest_expert_weights(sites: list[MoESite]) -> int:
    """One routed expert's weights over its three projections, the largest of any layer."""
    largest = 0
    for site in sites:
        weights = 0
        for name in ("gate_proj", "up_proj", "down_proj"):
            projection = getattr(site.switch, name)
            out_dims, stored = projection["weight"].shape[-2:]
            bits = getattr(projection, "bits", None)  # packed into uint32 words when quantized
            weights += out_dims * (stored * 32 // bits if bits else stored)
        largest = max(largest, weights)
    return largest
