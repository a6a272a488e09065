"""Configuration dataclasses passed down through the engine, and size parsing.

Every knob is a field here; nothing deep inside the engine reads environment variables.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from .errors import Edge0Error

MODES = ("resident", "on-demand", "prerouter", "prefetch")
# Modes that need prerouter heads: prerouter routes by their predictions. Prefetch reads ahead
# what the lookahead guesses (routing/lookahead.py) and, where a K profile has heads, what they
# predict; the true router routes, so its output is on-demand's.
HEAD_MODES = ("prerouter",)
# Modes whose tokens are resident mode's (every layer routes with its true router); prerouter is
# approximate (its consumer layers route by a prediction).
EXACT_MODES = ("resident", "on-demand", "prefetch")


def mode_label(mode: str, k: int | None = None) -> str:
    """A mode as a user reads it: "prefetch (exact)", "prerouter K=4 (approximate)"."""
    width = f" K={k}" if k is not None else ""
    return f"{mode}{width} ({'exact' if mode in EXACT_MODES else 'approximate'})"


EVICTION_POLICIES = ("lfu-aging", "lru")

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}


def parse_size(text: str | int) -> int:
    """Parse `400K`, `512M`, `2G`, `1.5GiB` or a plain byte count into bytes.

    Single letters are binary (as in `ls -h` and `free`); `KB/MB/GB` are decimal, `KiB/MiB/GiB` binary.
    """
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise Edge0Error(
            f"cannot read size {text!r}: use a number with K, M, G (e.g. 400K, 512M, 1.5GiB)"
        )
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


_DURATION_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def parse_duration(text: str) -> float:
    """Parse `2ms`, `500us`, `0.01s` or `0` into seconds."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or (
        unit not in _DURATION_UNITS and not (unit == "" and float(match.group(1)) == 0)
    ):
        raise Edge0Error(f"cannot read duration {text!r}: use a number with s, ms or us (e.g. 2ms)")
    return float(match.group(1)) * _DURATION_UNITS.get(unit, 0.0)


def format_bytes(n: float) -> str:
    """Human-readable binary size, e.g. `1.50 GiB`."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


@dataclass
class EngineConfig:
    """How the engine runs a checkpoint."""

    mode: str = "on-demand"
    # Byte budget for routed experts resident in MLX memory, across all layers.
    expert_cache_bytes: int = 1024**3
    # The expert cache takes what the memory plan leaves (less a share kept for the page cache);
    # `expert_cache_bytes` is then ignored (runtime/memory_plan.py).
    expert_cache_auto: bool = False
    # Refuse to load, naming the term to lower, when the memory plan does not fit (`edge0 info
    # --memory` shows a plan that does not fit instead).
    refuse_over_plan: bool = True
    # The context the memory plan counts the KV cache and attention for; None: the model's, at
    # most 8,192 tokens. Training sets its window.
    context_tokens: int | None = None
    # Bytes the engine's caller holds beside it (a training step's layer inputs and logits): the
    # memory plan counts them, so `expert_cache_auto` leaves room for them and a plan that cannot
    # hold them is refused before loading.
    held_bytes: int = 0
    eviction: str = "lfu-aging"
    # Threads doing pread for expert loads. Reads are I/O, so more threads than cores helps on SSDs.
    reader_threads: int = 4
    # On Linux CPU compute with 2+ cores, in prerouter mode: the reader threads on the last core,
    # every other thread on the rest, so reads ahead do not take the compute thread's core
    # (experts/reader_core.py).
    reader_core: bool = True
    # Prompt tokens per prefill forward.
    prefill_chunk: int = 512
    # Replies that may decode together (runtime/batch.py): the memory plan counts this many
    # sequences' KV caches at the planned context.
    max_batch: int = 1
    # Today's kernels only (4-bit products everywhere): on-demand token-identical to stock mlx-lm.
    # Otherwise, on the CPU with a fast BLAS, a prefill chunk's routed experts with several rows
    # are dequantized and multiplied in fp32 (GEMM speed; logits within a stated bound,
    # docs/design.md).
    exact_kernels: bool = False
    # A prefill chunk whose routing touches more than this fraction of a layer's experts reads the
    # layer's expert tensors whole (a few large reads) instead of expert by expert.
    whole_layer_fraction: float = 0.5
    # Prefill may read a layer's expert tensors whole, holding that layer and the next one's read
    # outside the expert cache. False: a chunk's experts go through the expert cache's slot bank a
    # bankful at a time (the same values; bounded by the cache). None: the memory plan decides,
    # whole layers where two fit the plan and the expert cache's own size; True: wherever they fit
    # the plan.
    whole_layer_prefill: bool | None = None
    # Compute dtype for floating weights and activations: None picks float32 on CPU (4-bit matmuls with
    # bf16/fp16 activations are far slower there) and keeps the checkpoint's dtype on Metal/CUDA.
    dtype: str | None = None
    # Routing width; None: the model's native K (or, in prerouter mode, the profile closest to it).
    k: int | None = None
    # Prefetch and prerouter modes: guess each next MoE layer's routing from this layer's input
    # and read its experts ahead (routing/lookahead.py). Never changes the output.
    lookahead: bool = True
    # Prefetch mode reads nothing ahead (neither the lookahead's guesses nor a profile's
    # predictions) for experts smaller than this: such an expert is read faster by the layer
    # that needs it than a read handed to a reader thread costs (the demo's experts, without this
    # rule, made prefetch slower than on-demand: docs/notebook/2026-12-exact-lookahead.md). 0
    # reads every guess ahead.
    prefetch_min_expert_bytes: int = 1 << 20
    # Apply the profile's recovery LoRA in prerouter mode.
    lora: bool = True
    # Also run the true router on consumer layers to measure the prediction's recall@K (costs compute).
    shadow_router: bool = False
    # One rank of several (started by `mlx.launch`): this process reads, caches and computes only
    # its share of the routed experts, and the ranks sum each MoE layer's outputs
    # (experts/share.py). Not in resident mode.
    expert_parallel: bool = False
    # Continue a conversation from the last reply's KV cache when the new prompt extends it.
    reuse_prompt_cache: bool = True
    # Repair NaN / overflow in every decoder layer's output (streaming modes; resident stays stock).
    hidden_guard: bool = True
    # Clip hidden states to +-this; None clips only overflow (the dtype's largest finite value).
    hidden_clip: float | None = None
    # At most this many of the checkpoint's expert bytes stay in the OS page cache (the least
    # recently read are dropped; on macOS reads bypass the cache); None: the OS decides. A memory
    # wall on a machine whose RAM holds the whole checkpoint (the demo).
    page_cache_bytes: int | None = None
    # Page-cache residency of the expert tensors is sampled so that it costs at most this share of
    # step time.
    page_cache_sample_share: float = 0.02
    # Adapter folders searched for K profiles before the model directory, in this order (local
    # folders: a front end turns a Hub repo id into its cached folder first).
    adapter_dirs: tuple[Path, ...] = ()
    # edge0's user data folder; None: the platform's (platformdirs.user_data_dir("edge0")). The
    # automatic adapter folder DATA_DIR/adapters/<base fingerprint> is searched after the model
    # directory, and training writes there by default.
    data_dir: Path | None = None
    # Cold bytes per second the reader threads may take from disk, as one simulated device
    # (experts/read_pacing.py; the bench's --read-limit-by pacing); None: the disk's own speed.
    read_pace_bps: int | None = None
    # Each host read of a device array waits this many seconds more before it returns: a model of
    # the GPU queue drain such a read costs on Metal or CUDA (`engine/host_reads.py`; the bench's
    # --sync-cost). 0 on a real run.
    sync_cost_s: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise Edge0Error(f"unknown mode {self.mode!r}: choose one of {', '.join(MODES)}")
        if self.eviction not in EVICTION_POLICIES:
            raise Edge0Error(
                f"unknown eviction policy {self.eviction!r}: choose one of {', '.join(EVICTION_POLICIES)}"
            )
        if not 0.0 < self.whole_layer_fraction <= 1.0:
            raise Edge0Error("whole_layer_fraction must be in (0, 1]")
        if not 0.0 <= self.sync_cost_s <= 1.0:
            raise Edge0Error("sync_cost_s must be between 0 and 1 second")
        if self.read_pace_bps is not None and self.read_pace_bps <= 0:
            raise Edge0Error("read_pace_bps must be positive (None: no pacing)")
        if self.page_cache_bytes is not None and self.page_cache_bytes < 0:
            raise Edge0Error("page_cache_bytes must be 0 or more (None: no budget)")
        if self.page_cache_bytes is not None and self.mode == "resident":
            raise Edge0Error(
                "a page-cache budget needs a streaming mode: resident mode reads every expert "
                "into memory at start"
            )
        if self.prefill_chunk < 1 or self.reader_threads < 1:
            raise Edge0Error("prefill_chunk and reader_threads must be at least 1")
        if not 1 <= self.max_batch <= MAX_BATCH:
            raise Edge0Error(f"max_batch={self.max_batch} must be from 1 to {MAX_BATCH}")


# The most replies one batch decodes together: each is a row of every step's forward, and its KV
# cache a row of the batch's.
MAX_BATCH = 64


class OutputConstraint(Protocol):
    """A grammar compiled for the engine's tokenizer (runtime/constraint.py's `Grammar`): `start`
    gives one reply its matcher, which masks the logits and takes each sampled token."""

    def start(self): ...


# MLX seeds its generator with an unsigned 64-bit integer.
MAX_SEED = 2**64 - 1


@dataclass
class GenerationConfig:
    """How one reply is sampled.

    Every value is checked here, so the CLI, the app and any other front end share one check.
    `max_tokens` is at least 1: a reply always has its first token, which the forward on the last
    prompt token yields (0 is refused rather than silently generating one token anyway).
    `top_k` 0 turns top-k off; the engine also refuses a top_k of the vocabulary size or more.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    # Keep going past the end-of-sequence token (soak tests, fixed-length benchmarks).
    ignore_eos: bool = False
    # Drop tokens less likely than min_p times the likeliest (0 turns it off).
    min_p: float = 0.0
    # Penalties over the last `penalty_context` tokens (prompt and reply), as mlx-lm applies
    # them: repetition divides a seen token's positive logit (multiplies a negative one), 1 is
    # off; presence subtracts once per seen token, frequency once per occurrence, 0 is off.
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_context: int = 20
    # Added to the logits of these token ids before sampling (-100 bans, 100 forces).
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Record each token's log-probability and this many likeliest alternatives (None: none).
    logprobs: int | None = None
    # The grammar the reply must match (runtime/constraint.py: `compile_grammar` builds one for
    # the engine's tokenizer from a JSON schema, a Lark or a GBNF grammar); None: any text.
    constraint: OutputConstraint | None = None
    # Speculative decoding (runtime/speculative.py): the drafter ("lookup": prompt lookup), or
    # None for one token a forward; and the most tokens drafted for one verify step. Greedy
    # tokens are the plain run's; sampled ones keep its distribution.
    draft: str | None = None
    draft_max: int = 8

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, 1, "at least 1")
        _check_int("top_k", self.top_k, 0, "0 (off) or more")
        if self.seed is not None:
            _check_int("seed", self.seed, 0, f"between 0 and {MAX_SEED}", MAX_SEED)
        # `not a >= b` (rather than `a < b`) also refuses NaN, which compares false to everything.
        if not _is_real(self.temperature) or not 0.0 <= self.temperature < math.inf:
            raise Edge0Error(
                f"temperature={self.temperature!r} must be a finite number >= 0 (0 is greedy)"
            )
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise Edge0Error(f"top_p={self.top_p!r} must be in (0, 1] (1 turns it off)")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise Edge0Error(f"min_p={self.min_p!r} must be in [0, 1] (0 turns it off)")
        if not _is_real(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 10.0:
            raise Edge0Error(
                f"repetition_penalty={self.repetition_penalty!r} must be in (0, 10] (1 turns it off)"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise Edge0Error(f"{name}={value!r} must be in [-2, 2] (0 turns it off)")
        _check_int("penalty_context", self.penalty_context, 1, "at least 1")
        for token, bias in self.logit_bias.items():
            _check_int("logit_bias", token, 0, "token id of 0 or more")
            if not _is_real(bias) or not -100.0 <= bias <= 100.0:
                raise Edge0Error(f"logit_bias={bias!r} for token {token} must be in [-100, 100]")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, "between 0 and 20", 20)
        if self.draft not in (None, "lookup"):
            raise Edge0Error(f"draft={self.draft!r} must be lookup (or none)")
        _check_int("draft_max", self.draft_max, 1, "between 1 and 64", 64)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(name: str, value: object, low: int, wanted: str, high: int | None = None) -> None:
    """Refuse a non-integer (bools included) or one outside [low, high], naming the field."""
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or value < low
        or (high is not None and value > high)
    ):
        raise Edge0Error(f"{name}={value!r} must be an integer {wanted}")
