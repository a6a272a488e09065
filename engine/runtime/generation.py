"""The engine: prefill and decode with mlx-lm's KV caches, sampling, and per-step metrics.

Prefill runs the prompt except its last token in chunks, evaluating only the cache (no logits), as
mlx-lm does; the forward on the last prompt token yields the first generated token. Everything up to
that token is the `prefill` phase (its sum is time-to-first-token); every later forward is `decode`.

In prerouter mode, during a one-token forward every head predicts its consumer's routing for the
next step as soon as its layer has computed, and the predicted experts go to the reader threads
right away, so each read has about a whole step to land. The flush at the end of the forward makes
those predictions the next step's routing (after a prefill chunk, it runs every head at once).

K and mode can be changed from any thread with `request_k` / `request_mode`; the change applies
before the next step (between steps of a reply, or before the next reply). Base and pool are kept.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from ..adapters.lora import AppliedLoRA, load_lora
from ..adapters.profiles import AdapterFiles, ProfileSearch
from ..adapters.quality import kept_quality
from ..config import HEAD_MODES, EngineConfig, GenerationConfig, format_bytes
from ..errors import Edge0Error
from ..experts.heat import HeatPicture
from ..experts.store import LoadCounters
from ..experts.switch_glu import projection_specs
from ..routing.lookahead import Guess, Lookahead, attach_lookahead
from ..routing.moe_block import set_top_k
from ..routing.prerouter import PrerouterHeads
from ..routing.state import Predictions, RoutingCounters
from ..trace import NO_TRACE, Tracer
from .blas import blas_in_use, prefill_kernels
from .chat_template import render_chat_template
from .compute_activity import follow_compute
from .loader import LoadedModel, load
from .memory_plan import wire_for_plan
from .metrics import (
    MemorySampler,
    StepMetrics,
    merged,
    metal_wired_limit_bytes,
    process_peak_rss_bytes,
    reset_request_peaks,
    summarize,
)
from .numerics import HiddenGuard, guard_layers
from .sampling import Sampler, TokenLogprobs

TokenCallback = Callable[[int, StepMetrics], None]


def expert_format(loaded: LoadedModel) -> str:
    """How the routed experts are stored, e.g. "mxfp4 4-bit, group 32, with biases"."""
    spec = projection_specs(loaded.sites[0].switch, str(loaded.index.model_dir))[0]
    text = f"{spec.mode} {spec.bits}-bit, group {spec.group_size}"
    return text + (", with biases" if spec.has_bias else "")


def release_thread_streams() -> None:
    """Destroy MLX's streams of the calling thread. A thread that ran an `Engine` calls it last:
    left to process exit, those streams abort the process ("terminate called without an active
    exception") about half the time on Linux (MLX 0.32)."""
    mx.clear_streams()


@dataclass(frozen=True)
class KProfile:
    """A routing width the engine can switch to."""

    k: int
    # True when quality at this K is the model's own (native K on the true router) or recovered by
    # trained adapters; False when the true router is merely narrowed or widened.
    recovered: bool
    prerouter: bool = False  # has prerouter heads (prerouter mode possible)
    lora: bool = False  # has a recovery LoRA


@dataclass
class GenerationResult:
    prompt_tokens: list[int]
    tokens: list[int]
    text: str
    steps: list[StepMetrics]
    summary: dict = field(default_factory=dict)
    stopped_by: str = "max_tokens"  # "eos", "max_tokens" or "cancelled"
    # One per token, when GenerationConfig.logprobs asks for them.
    logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass
class _Step:
    """One forward, built and queued on the device until its values are read (`Engine._finish`)."""

    phase: str
    tokens: int
    started: float
    pool_step: int = 0
    logits: mx.array | None = None  # the last position's (one-token forwards)
    sampled: list[mx.array] = field(default_factory=list)  # the sampler's token (and logprobs)
    repaired: mx.array | None = None  # hidden values the numerical guard repaired
    predictions: Predictions | None = None  # the heads' routing of the next step
    guess: Guess | None = None  # the lookahead's guess of the next step's first MoE layer
    wait: list = field(default_factory=list)  # evaluated in the step's read, not read (a cache)
    # Held layers' routing, on the device: (layer, indices), read with the token.
    device_routing: list[tuple[int, mx.array]] = field(default_factory=list)
    routing_counters: RoutingCounters | None = None
    counters: LoadCounters | None = None  # the store's, when its step ended at the build

    def device_values(self) -> list:
        values = [*self.sampled, *self.wait]
        for value in (self.logits, self.repaired):
            if value is not None:
                values.append(value)
        if self.predictions is not None:
            values.append(self.predictions.indices)
        if self.guess is not None:
            values.append(self.guess.indices)
        return values


class Engine:
    """One loaded checkpoint, ready to generate.

    All MLX work happens on the thread that calls `generate` (use one thread for the engine's
    whole life). A thread other than the main one that used MLX must call `mx.clear_streams()`
    before it ends, or the process can abort at exit (seen with mlx 0.32 on Linux)."""

    def __init__(
        self, model_dir: str | Path, config: EngineConfig | None = None, tracer: Tracer = NO_TRACE
    ) -> None:
        self.config = config or EngineConfig()
        self.model_dir = Path(model_dir)
        self.loaded: LoadedModel = load(self.model_dir, self.config, tracer)
        self.config = self.loaded.engine_config  # as the memory plan resolved it
        self.memory_plan = self.loaded.memory_plan
        # Metal: the plan's resident weights and expert cache wired (None elsewhere).
        self.wired_bytes = wire_for_plan(self.memory_plan)
        self.store = self.loaded.store
        self.tracer = tracer
        self.memory = None
        try:
            self._setup()
        except BaseException:
            self.close()  # no reader thread or file outlives a failed start
            raise

    def _setup(self) -> None:
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        self.routing = self.loaded.routing
        self.fingerprint = self.loaded.fingerprint
        # K profiles over the adapter search (--adapters folders, the model dir, the auto
        # folder), as the load found them for its memory plan.
        self.adapter_search: ProfileSearch = self.loaded.profiles
        self.adapters: dict[int, AdapterFiles] = self.adapter_search.profiles
        self.memory = MemorySampler(
            self.loaded.index.expert_file_ranges(), self.config.page_cache_sample_share
        )
        self.context_limit = int(
            self.loaded.config.get("max_position_embeddings")
            or self.loaded.config.get("text_config", {}).get("max_position_embeddings")
            or 1 << 31
        )
        sizes = self.loaded.config.get("text_config", self.loaded.config)
        self.vocab_size = int(sizes.get("vocab_size") or 1 << 31)  # the logits' width
        self.mode = self.config.mode
        self.k = self.loaded.top_k
        self.lora: AppliedLoRA | None = None
        self._lock = threading.Lock()
        self._requested: dict[str, object] = {}
        self._prompt_cache = None  # (KV cache, tokens it holds, (K, mode)) of the last reply
        self.last_prefill: StepMetrics | None = None  # the latest prompt's forwards as one
        # The latest sampled token's log-probabilities when the reply asks for them (read from
        # `on_token`, on the engine's thread).
        self.last_logprobs: TokenLogprobs | None = None
        # Whether the tracer samples MLX's compute thread (Linux CPU); None: not tried yet.
        self._following_compute: bool | None = None
        if self.routing is not None:
            self.routing.shadow_router = self.config.shadow_router
        self.lookahead: Lookahead | None = None
        if self.store is not None and self.config.lookahead:
            self.lookahead = attach_lookahead(
                self.model, self.loaded.sites, self.loaded.blocks, self.loaded.top_k
            )
            for site in self.loaded.sites if self.lookahead is not None else ():
                getattr(site.parent, site.attribute).lookahead = self.lookahead
        self._cache_holds_last = False  # the last reply's last token was fed (a step ahead)
        self._first_guessed = False
        self._last_read_end = 0.0
        self.host_reads = self.loaded.host_reads
        self.guard = None
        if self.config.hidden_guard and self.mode != "resident":
            self.guard = HiddenGuard(self.config.hidden_clip)
            guard_layers(self.model.layers, self.guard)
        k = self.config.k if self.config.k is not None else self._default_k(self.mode)
        self._apply_profile(self._check_k(k, self.mode), self.mode)

    # -- profiles and modes ------------------------------------------------------------------------

    def profiles(self) -> list[KProfile]:
        """The K values this engine can route with. Without adapter files, the true router is
        narrowed or widened, and quality at K other than the native one is not recovered."""
        native = self.loaded.top_k
        usable = self.loaded.num_experts
        ks = {k for k in (2, 4, 8, *self.adapters) if 1 <= k <= usable} | {native}
        if not self.loaded.family.other_k:  # the family routes only at its native K
            ks = {native}
        out = []
        for k in sorted(ks):
            files = self.adapters.get(k)
            # A family routed by its own block has no predictions to route by.
            routed = files is not None and self.loaded.family.routing
            has_heads = routed and files.prerouter is not None
            has_lora = routed and files.lora is not None
            out.append(KProfile(k, k == native or (has_heads and has_lora), has_heads, has_lora))
        return out

    def modes(self) -> list[str]:
        if self.mode == "resident":
            return ["resident"]
        has_heads = any(p.prerouter for p in self.profiles())
        return ["on-demand", *(HEAD_MODES if has_heads else ()), "prefetch"]

    def _default_k(self, mode: str) -> int:
        """The model's native K; in prerouter mode, the K with heads closest to it."""
        native = self.loaded.top_k
        if mode not in HEAD_MODES:
            return native
        with_heads = [p.k for p in self.profiles() if p.prerouter]
        if not with_heads:
            raise Edge0Error(
                f"{self.model_dir}: {mode} mode needs prerouter_k<K>.safetensors files; "
                "train them with `edge0 train heads`"
            )
        return min(with_heads, key=lambda k: (abs(k - native), k))

    def _check_k(self, k: int, mode: str) -> int:
        profile = next((p for p in self.profiles() if p.k == k), None)
        if profile is None:
            choices = ", ".join(str(p.k) for p in self.profiles())
            raise Edge0Error(f"K={k} is not available for this model (choose {choices})")
        if mode in HEAD_MODES and not profile.prerouter:
            with_heads = ", ".join(str(p.k) for p in self.profiles() if p.prerouter) or "none"
            raise Edge0Error(f"no prerouter heads for K={k} (heads exist for K: {with_heads})")
        if self.store is not None:
            plan = self.loaded.plan_at(k)
            if not plan.fits and self.config.refuse_over_plan:
                raise Edge0Error(
                    f"K={k}: the memory plan needs {format_bytes(plan.total_bytes)} (its expert "
                    f"cache holds one routed set of {k} a layer) but "
                    f"{format_bytes(plan.limit_bytes or 0)} is available ({plan.limit_source}); "
                    f"K={self.k} stays"
                )
            self.store.set_top_k(k)
        return k

    def quality_note(self) -> str | None:
        """A warning to show when the current K runs without adapters that recover its quality."""
        profile = next(p for p in self.profiles() if p.k == self.k)
        if profile.recovered:
            return None
        native = f"native K={self.loaded.top_k}"
        if profile.prerouter and not profile.lora:  # heads only (`train heads`, no phase 2)
            routed = (
                "routes by the heads' predictions"
                if self.mode in HEAD_MODES
                else f"narrows or widens the true router ({native})"
            )
            return (
                f"K={self.k} {routed} with prerouter heads but no recovery LoRA "
                f"(lora_k{self.k}.safetensors, `edge0 train lora`): quality is not recovered"
            )
        return (
            f"K={self.k} narrows or widens the true router ({native}) without trained adapters: "
            "quality is not recovered"
        )

    def request_k(self, k: int) -> KProfile:
        """Ask for routing width `k`; safe from any thread, applied before the next step."""
        with self._lock:
            mode = self._requested.get("mode", self.mode)
        self._check_k(k, mode)
        with self._lock:
            self._requested["k"] = k
        return next(p for p in self.profiles() if p.k == k)

    def request_mode(self, mode: str) -> KProfile:
        """Switch between on-demand, prerouter and prefetch; safe from any thread, applied before the
        next step. Returns the profile that will be used (a mode with heads may need another K)."""
        if mode not in self.modes():
            raise Edge0Error(
                f"mode {mode!r} is not available here (choose {', '.join(self.modes())})"
            )
        with self._lock:
            k = self._requested.get("k", self.k)
        if mode in HEAD_MODES and not any(p.k == k and p.prerouter for p in self.profiles()):
            k = self._default_k(mode)
        self._check_k(k, mode)
        with self._lock:
            self._requested.update(mode=mode, k=k)
        return next(p for p in self.profiles() if p.k == k)

    def request_page_cache(self, budget_bytes: int | None) -> None:
        """Set the page-cache budget of the checkpoint's experts (None: the OS decides); safe from
        any thread, applied before the next step. A new budget starts cold."""
        if self.store is None:
            raise Edge0Error("a page-cache budget needs a streaming mode (experts are resident)")
        if budget_bytes is not None and budget_bytes < 0:
            raise Edge0Error(f"page-cache budget {budget_bytes} must be 0 or more")
        with self._lock:
            self._requested["page_cache"] = budget_bytes

    def kv_cache_bytes(self) -> int:
        """Bytes of the conversation's KV cache kept for the next turn (0 when none is kept)."""
        if self._prompt_cache is None:
            return 0
        return sum(c.nbytes for c in self._prompt_cache[0])

    def expert_heat(self) -> HeatPicture | None:
        """What every MoE layer's experts did in the latest step, and which are in the expert
        cache now (None in resident mode: every expert is in memory). Engine thread only."""
        return self.store.heat_picture() if self.store is not None else None

    @property
    def pending(self) -> tuple[int, str]:
        """(K, mode) as they will be at the next step: requested, or current when none is."""
        with self._lock:
            return self._requested.get("k", self.k), self._requested.get("mode", self.mode)

    def apply_requests(self) -> None:
        """Apply the requested K and mode now. Every step does this first; an idle caller (the
        app, between replies) calls it from the engine's thread so a switch shows at once.
        Raises Edge0Error when the new profile's files cannot be read (the old one stays)."""
        with self._lock:
            requested, self._requested = self._requested, {}
        if "page_cache" in requested:
            self.store.set_page_cache_budget(requested["page_cache"])
        k = requested.get("k", self.k)
        mode = requested.get("mode", self.mode)
        if (k, mode) != (self.k, self.mode):
            self._apply_profile(k, mode)

    def _apply_profile(self, k: int, mode: str) -> None:
        """Route with width k in `mode`: swap heads and LoRA files, never the base or the pool.
        The files are read before anything changes, so a file that cannot be read leaves the
        profile that stood."""
        heads = adapter = None
        if self.routing is not None:
            # Prefetch reads ahead what heads predict where the profile has them, and where
            # the experts are big enough for a read ahead to pay (EngineConfig's
            # prefetch_min_expert_bytes).
            profile = next((p for p in self.profiles() if p.k == k), None)
            reads_pay = self._largest_expert_bytes() >= self.config.prefetch_min_expert_bytes
            with_heads = mode in HEAD_MODES or (
                mode == "prefetch" and profile and profile.prerouter and reads_pay
            )
            heads = self._load_heads(k) if with_heads else None
            files = self.adapters.get(k)
            if mode == "prerouter" and self.config.lora and files is not None and files.lora:
                adapter = load_lora(files.lora, self.fingerprint)
        if self.lora is not None:
            self.lora.remove()
            self.lora = None
        if self.routing is None:  # resident: stock mlx-lm blocks
            for site in self.loaded.sites:
                set_top_k(self.loaded.family, site.parent, k)
        else:
            self.routing.k = k
            self.routing.set_heads(heads, route_by_predictions=mode == "prerouter")
            predicted = set()
            if heads is not None and mode == "prerouter":
                predicted = set(heads.consumers)
            self_routed = set(self.loaded.blocks) - predicted if predicted else set()
            self.store.pool.keep_layers(self_routed)
            held = self._layers_to_hold(k, self_routed)
            self.store.hold_layers(held)
            if self.lookahead is not None:
                self.lookahead.k = k
                self.store.lookahead_reads = reads_pay or mode != "prefetch"
                # Layers routed by a prediction need no guess of their true router's routing,
                # nor do held ones: their every expert is resident.
                self.lookahead.skip = frozenset(predicted | held)
            # Prefetch reads a head's predictions where they guess as well as the lookahead.
            self.store.gate_head_reads = mode == "prefetch" and self.lookahead is not None
            self.store.head_gate.reset()
            # Reads ahead only: readers on a core of their own (experts/reader_core.py says why).
            self.store.use_reader_core(mode == "prerouter")
            if adapter is not None:
                self.lora = AppliedLoRA(self.model, adapter, self.loaded.float_dtype)
        self.k, self.mode = k, mode
        if self.store is not None:
            self.memory_plan = self.loaded.plan_at(k)
            self.wired_bytes = wire_for_plan(self.memory_plan)

    def _layers_to_hold(self, k: int, self_routed: set[int]) -> set[int]:
        """The MoE layers kept whole in the expert cache, routed on the device: every layer when
        the cache holds every expert (the model fits: a step never waits on the host), else in
        prerouter mode the layers that route by their own router, where the cache also keeps
        room for the others' routed sets (their routing would otherwise be read back each step)."""
        every = set(self.loaded.index.layers)
        if self.store.can_hold(every, k):
            return every
        if self_routed and self.store.can_hold(self_routed, k):
            return self_routed
        return set()

    def _largest_expert_bytes(self) -> int:
        return max(layer.expert_nbytes for layer in self.loaded.index.layers.values())

    def _load_heads(self, k: int) -> PrerouterHeads:
        return self.loaded.load_heads(self.adapters[k].prerouter, self.fingerprint, k)

    # -- text ----------------------------------------------------------------------------------------

    def encode(self, text: str, chat: bool = False) -> list[int]:
        """Token ids of `text`: raw (as is), or wrapped in the tokenizer's chat template."""
        if chat:
            return self.encode_chat([{"role": "user", "content": text}])
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_chat(
        self, messages: list[dict], tools: list[dict] | None = None, template_kwargs=None
    ) -> list[int]:
        """Token ids of a conversation (`role`/`content` dicts), ready for the assistant's turn,
        with the tools it may call and the template's own switches (`enable_thinking`) passed
        to the template as mlx-lm does. The checkpoint's chat template renders sandboxed and
        bounded in time and size; a template that fails is reported as the model's fault."""
        return render_chat_template(
            self.tokenizer, messages, self.model_dir, tools, template_kwargs or {}
        )

    def reply_text(self, tokens: list[int]) -> str:
        """The text of generated tokens, without end-of-sequence tokens."""
        eos = set(self.tokenizer.eos_token_ids)
        return self.tokenizer.decode([t for t in tokens if t not in eos])

    def profile_quality(self) -> dict[int, dict[str, float]]:
        """Each K profile's perplexity over the native model's, where `edge0 eval --profiles`
        kept a table (read from disk each time: an eval may run while the engine is open)."""
        return kept_quality(self.fingerprint, self.config.data_dir)

    def info(self) -> dict:
        """What a status line or `edge0 info` shows about this engine."""
        index = self.loaded.index
        return {
            "model": self.model_dir.name,
            "family": self.loaded.family.name,
            "family_description": self.loaded.family.description,
            "family_modes": list(self.loaded.family.modes),
            "expert_format": expert_format(self.loaded),
            "mode": self.mode,
            "k": self.k,
            "native_k": self.loaded.top_k,
            "layers": self.loaded.num_layers,
            "moe_layers": len(index.layers),
            "experts": self.loaded.num_experts,
            "hidden": self.loaded.hidden,
            "expert_bytes": index.expert_nbytes,
            "expert_cache_bytes": self.config.expert_cache_bytes,  # as the plan resolved it
            "memory_plan": self.memory_plan.as_dict(),
            # Metal only, None elsewhere: the wired limit this run set, and the most it could.
            "wired_limit_bytes": self.wired_bytes,
            "working_set_bytes": metal_wired_limit_bytes(),
            "dtype": str(self.loaded.float_dtype or "as saved"),
            "blas": blas_in_use().as_dict(),
            "prefill_kernels": prefill_kernels(self.config),
            "fingerprint": self.fingerprint,
            "profiles": [p.__dict__ for p in self.profiles()],
            # Perplexity over the native model's, per K and routing (`edge0 eval --profiles`).
            "profile_quality": self.profile_quality(),
            "warnings": self.warnings,
        }

    @property
    def warnings(self) -> list[str]:
        """Problems that do not stop the model from running: stray shards, adapter files ignored
        (a K named otherwise than canonically, a K above the model's experts)."""
        experts = self.loaded.num_experts
        too_wide = [
            f"{files.prerouter or files.lora}: ignored: K={k} is above the model's {experts} "
            "routed experts"
            for k, files in sorted(self.adapters.items())
            if k > experts
        ]
        return [*self.loaded.index.warnings, *self.adapter_search.warnings, *too_wide]

    # -- generation ----------------------------------------------------------------------------------

    def generate(
        self,
        prompt_tokens: list[int],
        gen: GenerationConfig | None = None,
        on_token: TokenCallback | None = None,
        should_stop: Callable[[], bool] | None = None,
        forced_tokens: list[int] | None = None,
        on_logits: Callable[[mx.array], None] | None = None,
    ) -> GenerationResult:
        """Generate a reply to `prompt_tokens`. With `forced_tokens`, feed those instead of sampling
        (teacher forcing): every benchmark arm then does exactly the same work. `should_stop` is
        asked before each prefill chunk and after each token; true ends the reply ("cancelled"),
        with no token at all when it ends the prefill. `on_logits` gets each token's logits
        (evaluated, before sampling): `edge0 doctor` compares them step by step between runs."""
        gen = gen or GenerationConfig()
        if forced_tokens is not None:
            gen = dataclasses.replace(gen, max_tokens=len(forced_tokens))
        if not prompt_tokens:
            raise Edge0Error("the prompt is empty")
        if len(prompt_tokens) + gen.max_tokens > self.context_limit:
            raise Edge0Error(
                f"prompt of {len(prompt_tokens)} tokens plus {gen.max_tokens} new tokens exceeds "
                f"the model's context of {self.context_limit} (max_position_embeddings in "
                f"{self.model_dir / 'config.json'})"
            )
        if gen.top_k >= self.vocab_size:
            raise Edge0Error(
                f"top_k={gen.top_k} must be below the vocabulary size of {self.vocab_size} "
                "(0 turns top-k off)"
            )
        outside = [t for t in gen.logit_bias if t >= self.vocab_size]
        if outside:
            raise Edge0Error(
                f"logit_bias=names token {outside[0]}, outside the vocabulary of {self.vocab_size}"
            )
        # The request's peaks, MLX's and the kernel's RSS high-water mark, start here.
        peak_rss_scope = reset_request_peaks()
        if gen.seed is not None:
            mx.random.seed(gen.seed)
        sampler = Sampler(gen, prompt_tokens)
        self.apply_requests()
        profile = (self.k, self.mode)
        cache, reused = self._take_prompt_cache(prompt_tokens, profile)
        self._reset_request_state()
        if self.tracer.samples_compute and self._following_compute is None:
            self._following_compute = follow_compute(self.tracer)  # once: MLX's thread stays
        try:
            result = self._generate(
                prompt_tokens,
                gen,
                sampler,
                cache,
                reused,
                on_token,
                should_stop,
                forced_tokens,
                on_logits,
            )
            result.summary = summarize(
                result.steps,
                len(prompt_tokens),
                peak_mlx_bytes=mx.get_peak_memory(),
                peak_rss_bytes=process_peak_rss_bytes(),
                peak_rss_scope=peak_rss_scope,
            )
            result.summary["reused_prompt_tokens"] = reused
        finally:
            # Whatever happened (a read error, a cancel), no per-request state outlives the request.
            self._reset_request_state()
        if not result.tokens:  # cancelled during the prefill: the cache holds part of it
            result.summary["generated_tokens"] = 0
        elif self.config.reuse_prompt_cache and (self.k, self.mode) == profile:
            # The cache now holds the prompt and every generated token but the last (never fed,
            # unless a step was built ahead of it).
            fed = list(prompt_tokens) + result.tokens[: None if self._cache_holds_last else -1]
            self._prompt_cache = (cache, fed, profile)
        return result

    def _take_prompt_cache(self, prompt_tokens: list[int], profile) -> tuple[list, int]:
        """A KV cache to continue from, and how many prompt tokens it already holds.

        A chat turn's prompt is the previous prompt, the reply and the new message: only the new
        part needs a prefill. The reply's tokens need not survive decoding and re-encoding, so the
        cache is cut back to the longest common prefix where the cache allows it (attention
        caches do; the recurrent state of linear attention does not). Only a cache computed with
        the same K and mode is reused, and at least one prompt token is always run."""
        kept, self._prompt_cache = self._prompt_cache, None
        if kept is None or kept[2] != profile:
            return make_prompt_cache(self.model), 0
        cache, fed, _ = kept
        common = 0
        limit = min(len(fed), len(prompt_tokens) - 1)
        while common < limit and fed[common] == prompt_tokens[common]:
            common += 1
        if common == len(fed):
            return cache, common
        if common > 0 and can_trim_prompt_cache(cache):
            trim_prompt_cache(cache, len(fed) - common)
            return cache, common
        return make_prompt_cache(self.model), 0

    def _reset_request_state(self) -> None:
        self._first_guessed = False  # the next step's first layer was guessed and read ahead
        self._last_read_end = 0.0
        if self.store is not None:
            self.store.reset()
        if self.routing is not None:
            self.routing.reset()

    def _generate(
        self, prompt_tokens, gen, sampler, cache, reused, on_token, should_stop, forced, on_logits
    ) -> GenerationResult:
        """Prefill, then decode: each step is built and queued on the device, then its values (the
        token, and what the next step needs from it) are read in one wait (`_finish`). Where the
        next step needs nothing from the host (every layer held, or resident), it is built before
        this step's token is read, as mlx-lm's `generate_step` does: the device never idles
        between steps."""
        eos = set() if forced is not None or gen.ignore_eos else set(self.tokenizer.eos_token_ids)
        steps: list[StepMetrics] = []
        result = GenerationResult(list(prompt_tokens), [], "", steps)
        self._cache_holds_last = False

        chunk = self.config.prefill_chunk
        body = prompt_tokens[reused:-1]
        for start in range(0, len(body), chunk):
            # A long prompt is many chunks, each a forward: a caller gone meanwhile (a client
            # that disconnected) frees the engine now, not after the whole prefill.
            if should_stop is not None and should_stop():
                result.stopped_by = "cancelled"
                return result
            last_chunk = start + chunk >= len(body)
            tokens = mx.array(body[start : start + chunk])
            after = prompt_tokens[-1] if last_chunk else None
            step = self._build(tokens, cache, "prefill", next_input=after, flush=last_chunk)
            self._finish(step, steps)
        sampler = sampler if forced is None else None  # forced tokens are fed, not sampled
        first = forced[0] if forced else None
        step = self._build(mx.array(prompt_tokens[-1:]), cache, "prefill", sampler, first)
        prefill = True
        while True:
            position = len(result.tokens)  # the token this step gives
            ahead = None
            if self._pipelined and position + 1 < gen.max_tokens:
                following = forced[position + 1] if forced and position + 2 < len(forced) else None
                next_input = (
                    mx.array(forced[position : position + 1]) if forced else step.sampled[0]
                )
                ahead = self._build(next_input, cache, "decode", sampler, following)
            values = self._finish(step, steps, on_logits is not None)
            if prefill:
                self.last_prefill = merged(steps)  # the whole prompt's forwards, for live panels
                prefill = False
            if on_logits is not None:
                on_logits(step.logits)
            token = sampler.finish(values) if forced is None else forced[position]
            result.tokens.append(token)
            if forced is None and gen.logprobs is not None:
                self.last_logprobs = sampler.last
                result.logprobs.append(sampler.last)
            if on_token is not None:
                on_token(token, steps[-1])
            if token in eos:
                result.stopped_by = "eos"
            elif len(result.tokens) >= gen.max_tokens:
                pass
            elif should_stop is not None and should_stop():
                result.stopped_by = "cancelled"
            else:
                if ahead is None:
                    following = (
                        forced[position + 1] if forced and position + 2 < len(forced) else None
                    )
                    ahead = self._build(mx.array([token]), cache, "decode", sampler, following)
                step = ahead
                continue
            # A step built ahead fed this last token to the KV cache already.
            self._cache_holds_last = ahead is not None
            break
        result.text = self.reply_text(result.tokens)
        return result

    @property
    def _pipelined(self) -> bool:
        """Whether a step can be built before the previous one's values are read: nothing in it
        waits for the host (every expert is resident: no read, no routing read back)."""
        return self.store is None or self.store.every_layer_held

    def _build(
        self,
        tokens: mx.array,
        cache: list,
        phase: str,
        sampler: Sampler | None = None,
        next_input: int | None = None,
        flush: bool = True,
    ) -> _Step:
        """Build one forward and queue it on the device. A one-token forward with a `sampler`
        samples its token (on the device); `flush` runs the prerouter heads for the next step;
        `next_input` is the next step's input where the host knows it (a prompt's or a forced
        token; else the sampled one), from which the next step's first MoE layer is guessed."""
        self.apply_requests()
        started = time.perf_counter()
        one = tokens.size == 1
        step = _Step(phase, tokens.size, started)
        if self.routing is not None:
            step.routing_counters = self.routing.begin_step()
        if self.store is not None:
            self.store.begin_step()
            step.pool_step = self.store.pool.step
        guessing = one and self.lookahead is not None and self.mode in ("prefetch", "prerouter")
        if guessing:
            self.lookahead.active = True
            self._look_ahead_at_first_layer(tokens)
        out = self.model(tokens[None], cache=cache)
        step.repaired = self.guard.take() if self.guard is not None else None
        if one:
            step.logits = out[:, -1, :]
            if sampler is not None:
                with self.tracer.span("sample", "step"):
                    step.sampled = sampler(step.logits)
        else:
            step.wait = [c.state for c in cache]  # a prefill chunk: only the cache is kept
        if self.store is not None:
            step.device_routing = self.store.device_routing()
        if flush and self.routing is not None and self.routing.heads is not None:
            step.predictions = self.routing.flush()
        if self.lookahead is not None:
            self.lookahead.end_step()
            self.lookahead.active = False
            following = step.sampled[0] if step.sampled else None
            if following is None and next_input is not None:
                following = mx.array([next_input])
            if following is not None and self.mode in ("prefetch", "prerouter"):
                step.guess = self.lookahead.guess_first(following)
        mx.async_eval(step.device_values())
        if self._pipelined and self.store is not None:
            # Nothing of this step can be read or evicted any more: its accounting ends now,
            # before the next step is built over it.
            step.counters = self.store.end_step()
        return step

    def _finish(self, step: _Step, steps: list[StepMetrics], keep_logits: bool = False) -> list:
        """Read the step's values in one wait; count the held layers' routing; start the next
        step's reads ahead. Returns the sampler's values."""
        tracer = self.tracer
        routing = step.device_routing
        arrays = [*step.sampled]
        named = {}
        for name, array in (
            ("repaired", step.repaired),
            ("predictions", step.predictions.indices if step.predictions else None),
            ("guess", step.guess.indices if step.guess else None),
        ):
            if array is not None:
                named[name] = len(arrays)
                arrays.append(array)
        first_routing = len(arrays)
        arrays += [indices for _, indices in routing]
        with tracer.span("evaluate", "compute"):  # the compute left once the graph is built
            also = step.wait + ([step.logits] if keep_logits else [])
            host = self.host_reads.read(
                arrays, "the step's token and what the next one needs", also
            )
        staged = time.perf_counter()
        counters = step.counters
        if counters is None:
            counters = self.store.end_step() if self.store is not None else LoadCounters()
        if self.store is not None:
            held = [(layer, host[first_routing + i]) for i, (layer, _) in enumerate(routing)]
            self.store.settle(counters, held, step.pool_step)
        # The next step's reads, in the order it needs them: its first MoE layer's guess, then
        # the predicted layers (each reader takes the oldest read first).
        if "guess" in named:
            step.guess.host = host[named["guess"]]
            self.store.look_ahead(step.guess.layer, step.guess.likely, next_step=True)
            self._first_guessed = True
        if "predictions" in named:
            predicted = self.routing.settle(step.predictions, host[named["predictions"]])
            for layer, experts in sorted(predicted.items()):
                self.store.stage(layer, experts)
        end = time.perf_counter()
        # A step's time runs from the later of its build's start and the previous step's read:
        # steps built ahead overlap, and their times add up to the reply's.
        wall_ms = (end - max(step.started, self._last_read_end)) * 1e3
        self._last_read_end = end
        syncs, reasons = self.host_reads.take()
        tracer.complete(
            f"{step.phase} step", "step", step.started, end, tokens=step.tokens, host_syncs=syncs
        )
        pool_bytes = self.store.pool.resident_bytes if self.store is not None else 0
        repaired = int(host[named["repaired"]]) if "repaired" in named else 0
        steps.append(
            StepMetrics.build(
                step.phase,
                step.tokens,
                wall_ms,
                counters,
                self.memory.snapshot(),
                pool_bytes,
                step.routing_counters,
                self.mode,
                self.k,
                repaired,
                (end - staged) * 1e3 if "predictions" in named else 0.0,
                syncs,
                reasons,
            )
        )
        return host[: len(step.sampled)]

    def _look_ahead_at_first_layer(self, tokens: mx.array) -> None:
        """Read ahead the first MoE layer's guessed experts before the forward starts: no layer
        before it in the token can guess it (routing/lookahead.py). The previous step built the
        guess from this input, read it with its token and started its reads; a step without
        one (the first of a reply whose prompt needed no prefill chunk) reads it now."""
        guessed, self._first_guessed = self._first_guessed, False
        guess = None if guessed else self.lookahead.guess_first(tokens)
        if guess is None:
            return
        with self.tracer.span("lookahead first layer", "prerouter"):
            guess.host = self.host_reads.read([guess.indices], "the first layer's guess")[0]
        self.store.look_ahead(guess.layer, guess.likely)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        if self.memory is not None:
            self.memory.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
