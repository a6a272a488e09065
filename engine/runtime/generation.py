"""The engine: prefill and decode with mlx-lm's KV caches, sampling, and per-step metrics.

Prefill runs the prompt except its last token in chunks, evaluating only the cache (no logits), as
mlx-lm does; the forward on the last prompt token yields the first generated token. Everything up to
that token is the `prefill` phase (its sum is time-to-first-token); every later forward is `decode`.

A reply's steps are run by `decode.Decoder` (one host wait on the device a step where the routing
allows it); how the (mode, K) that stands decodes is one `decode_policy.DecodePolicy`. `stream`
yields the tokens as mlx-lm's `generate_step` does; `generate` is the same with callbacks.

K and mode can be changed from any thread with `request_k` / `request_mode`; the change applies
before the next step (between steps of a reply, or before the next reply). Base and pool are kept.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import threading
from collections.abc import Callable, Generator
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from ..adapters.lora import AppliedLoRA, load_lora
from ..adapters.profiles import AdapterFiles, KProfile, ProfileSearch, chosen_k, k_profiles
from ..adapters.quality import kept_quality
from ..config import HEAD_MODES, MODES, EngineConfig, GenerationConfig, format_bytes
from ..errors import Edge0Error
from ..experts.heat import HeatPicture
from ..experts.share import ExpertShare
from ..experts.switch_glu import projection_specs
from ..routing.lookahead import Lookahead, attach_lookahead
from ..routing.moe_block import set_top_k
from ..routing.prerouter import PrerouterHeads
from ..trace import NO_TRACE, Tracer
from .batch import Batch
from .blas import blas_in_use, prefill_kernels
from .chat_template import render_chat_template
from .compute_activity import follow_compute
from .decode import Decoder, GeneratedToken, GenerationResult, Reply
from .decode_policy import apply as apply_policy
from .decode_policy import decode_policy
from .follow import agree, announce, ranks_lost
from .loader import LoadedModel, load
from .memory_plan import wire_for_plan
from .metrics import (
    MemorySampler,
    StepMetrics,
    metal_wired_limit_bytes,
    process_peak_rss_bytes,
    reset_request_peaks,
    summarize,
)
from .numerics import HiddenGuard, guard_layers
from .sampling import Sampler
from .speculative import Speculation, check_draftable


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
        self.model_context = int(
            self.loaded.config.get("max_position_embeddings")
            or self.loaded.config.get("text_config", {}).get("max_position_embeddings")
            or 1 << 31
        )
        # A reply's prompt and tokens fit the context the memory plan counted KV caches for.
        self.context_limit = min(self.model_context, self.memory_plan.context_tokens)
        sizes = self.loaded.config.get("text_config", self.loaded.config)
        self.vocab_size = int(sizes.get("vocab_size") or 1 << 31)  # the logits' width
        self.mode = self.config.mode
        self.k = self.loaded.top_k
        self.lora: AppliedLoRA | None = None
        self._lock = threading.Lock()
        self._requested: dict[str, object] = {}
        # With ranks, in a reply: the (K, mode) the ranks last agreed to run (runtime/follow.py).
        # Rank 0 runs it, not a switch asked since on another thread, which waits its turn.
        self._agreed: tuple[int, str] | None = None
        self._prompt_cache = None  # (KV cache, tokens it holds, (K, mode)) of the last reply
        self.last_prefill: StepMetrics | None = None  # the latest prompt's forwards as one
        # Whether the tracer samples MLX's compute thread (Linux CPU); None: not tried yet.
        self._following_compute: bool | None = None
        if self.routing is not None:
            self.routing.shadow_router = self.config.shadow_router
        self.lookahead: Lookahead | None = None
        if self.store is not None and self.config.lookahead:
            self.lookahead = attach_lookahead(
                self.model, self.loaded.sites, self.loaded.blocks, self.loaded.top_k
            )
            self.store.lookahead = self.lookahead
        self.host_reads = self.loaded.host_reads
        self.guard = None
        if self.config.hidden_guard and self.mode != "resident":
            self.guard = HiddenGuard(self.config.hidden_clip)
            guard_layers(self.model.layers, self.guard)
        # The K the load planned for (`chosen_k`, before any weight was read).
        self._apply_profile(self._check_k(self.loaded.k, self.mode), self.mode)

    # -- profiles and modes ------------------------------------------------------------------------

    def profiles(self) -> list[KProfile]:
        """The K values this engine can route with (`k_profiles`)."""
        loaded = self.loaded
        family = loaded.family
        native, experts = loaded.top_k, loaded.num_experts
        return k_profiles(native, experts, family.other_k, family.routing, self.adapters)

    def modes(self) -> list[str]:
        if self.mode == "resident":
            return ["resident"]
        has_heads = any(p.prerouter for p in self.profiles())
        return ["on-demand", *(HEAD_MODES if has_heads else ()), "prefetch"]

    def _check_k(self, k: int | None, mode: str) -> int:
        """`k` as `chosen_k` checks it (None: the mode's default K), and its memory plan: the
        expert cache must hold one routed set of it a layer."""
        k = chosen_k(k, mode, self.loaded.top_k, self.profiles(), self.model_dir)
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
            k = None  # the mode's default K
        k = self._check_k(k, mode)
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
            if self._agreed is not None:  # asked after the ranks agreed: for the next agreement
                self._requested = {p: requested.pop(p) for p in ("k", "mode") if p in requested}
                requested.update(zip(("k", "mode"), self._agreed))
        if "page_cache" in requested:
            self.store.set_page_cache_budget(requested["page_cache"])
        k = requested.get("k", self.k)
        mode = requested.get("mode", self.mode)
        if (k, mode) != (self.k, self.mode):
            self._apply_profile(k, mode)

    def _apply_profile(self, k: int, mode: str) -> None:
        """Route with width k in `mode`: swap heads and LoRA files, never the base or the pool;
        decode by the (mode, K) policy (`decode_policy.py`). The files are read before anything
        changes, so a file that cannot be read leaves the profile that stood."""
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
            moe_layers = set(self.loaded.index.layers)
            lookahead = self.lookahead is not None
            policy = decode_policy(mode, k, heads, moe_layers, self.store, reads_pay, lookahead)
            apply_policy(policy, self.routing, self.store, self.lookahead)
            if adapter is not None:
                self.lora = AppliedLoRA(self.model, adapter, self.loaded.float_dtype)
        self.k, self.mode = k, mode
        if self.store is not None:
            self.memory_plan = self.loaded.plan_at(k)
            self.wired_bytes = wire_for_plan(self.memory_plan)

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
        kept a table (read from disk each time: an eval may run while the engine is open); a
        table that does not check out is one of `warnings`."""
        return kept_quality(self.fingerprint, self.config.data_dir).table

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
            # In effect: the banks' bytes, at most every expert (an `auto` budget may be larger).
            "expert_cache_bytes": self.memory_plan.expert_cache_bytes,
            # Prefetch reads ahead only experts big enough for a read ahead to pay
            # (EngineConfig.prefetch_min_expert_bytes); smaller ones are read when needed.
            "prefetch_reads_ahead": self._largest_expert_bytes()
            >= self.config.prefetch_min_expert_bytes,
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
        (a K named otherwise than canonically, a K above the model's experts), a kept quality
        table ignored."""
        experts = self.loaded.num_experts
        too_wide = [
            f"{files.prerouter or files.lora}: ignored: K={k} is above the model's {experts} "
            "routed experts"
            for k, files in sorted(self.adapters.items())
            if k > experts
        ]
        quality = kept_quality(self.fingerprint, self.config.data_dir).warning
        return [
            *self.loaded.index.warnings,
            *self.adapter_search.warnings,
            *too_wide,
            *([quality] if quality else []),
        ]

    # -- generation ----------------------------------------------------------------------------------

    def generate(
        self,
        prompt_tokens: list[int],
        gen: GenerationConfig | None = None,
        forced_tokens: list[int] | None = None,
    ) -> GenerationResult:
        """Generate a whole reply to `prompt_tokens` (`stream`, to its end)."""
        reply = self.stream(prompt_tokens, gen, forced_tokens=forced_tokens)
        for _ in reply:
            pass
        return reply.result

    def stream(
        self,
        prompt_tokens: list[int],
        gen: GenerationConfig | None = None,
        should_stop: Callable[[], bool] | None = None,
        forced_tokens: list[int] | None = None,
        keep_logits: bool = False,
    ) -> Reply:
        """A reply to `prompt_tokens`: iterated, it gives each token as it is made, as mlx-lm's
        `generate_step` does; then its `result` is the whole `GenerationResult`. With
        `forced_tokens`, feed those instead of sampling (teacher forcing): every benchmark arm
        then does exactly the same work. `should_stop` is asked before each prefill chunk and
        after each token; true ends the reply ("cancelled"), with no token at all when it ends
        the prefill. With `keep_logits`, each token's logits come evaluated. A request this
        model cannot serve raises Edge0Error here, before any token."""
        gen = self.checked_request(prompt_tokens, gen, forced_tokens)
        announcement = None
        if self.share is not None:  # every rank runs this reply with this one (runtime/follow.py)
            gen, announcement, should_stop = self._lead(gen, should_stop)
            announcement.update(prompt=prompt_tokens, forced=forced_tokens, logits=keep_logits)
        steps = self._reply(
            prompt_tokens, gen, should_stop, forced_tokens, keep_logits, announcement
        )
        return Reply(steps if announcement is None else self._in_step(steps))

    def batch(self) -> Batch:
        """Replies that decode together, joining and leaving at any step (runtime/batch.py), at
        most `EngineConfig.max_batch` (the memory plan counts that many KV caches); one at a time
        where the model's KV caches cannot be batched (`Batch.rows_merge`)."""
        if self.share is not None:
            raise Edge0Error("batched replies are not available with several ranks")
        return Batch(self, self.config.max_batch)

    # With several ranks: a reply that ends partway on rank 0 (an error, a caller that stops
    # reading) leaves the others inside it; every later reply is refused (restart the ranks).
    _out_of_step = False

    def _in_step(self, steps: Generator[GeneratedToken, None, GenerationResult]):
        try:
            return (yield from steps)
        except RuntimeError as e:  # MLX's distributed layer: a rank ended, or the link to it broke
            self._out_of_step = True
            raise ranks_lost(e) from None
        except BaseException:
            self._out_of_step = True
            raise

    @property
    def share(self) -> ExpertShare | None:
        """This rank's share of the experts, when the engine is one rank of several."""
        return self.store.share if self.store is not None else None

    def _lead(self, gen: GenerationConfig, should_stop: Callable[[], bool] | None):
        """Rank 0's reply: what the other ranks are told (the sampling seed chosen here, so that
        every rank samples alike), and a stop that they hear at the same step, with the K and
        mode that step runs."""
        if self.share.rank != 0:
            raise Edge0Error(f"rank {self.share.rank} runs rank 0's replies (Engine.follow)")
        if self._out_of_step:
            raise Edge0Error(
                "a reply failed partway on rank 0 and the other ranks are out of step with it: "
                "restart the ranks"
            )
        if gen.constraint is not None:
            raise Edge0Error("structured output (a grammar) is not available with several ranks")
        if gen.seed is None:
            gen = dataclasses.replace(gen, seed=random.randrange(2**63))
        k, mode = self.pending
        config = {f.name: getattr(gen, f.name) for f in dataclasses.fields(gen)}
        config.pop("constraint")
        config["logit_bias"] = list(gen.logit_bias.items())

        def stop_here() -> bool:
            stop = should_stop is not None and should_stop()
            k, mode = self.pending
            stop = agree(self.share, stop, k, MODES.index(mode))[0]
            self._agreed = (k, mode)
            return stop

        return gen, {"gen": config, "k": k, "mode": mode}, stop_here

    def follow(self, on_reply: Callable[[GenerationResult], None] | None = None) -> None:
        """A rank other than 0: run each reply that rank 0 announces, switching K and mode where
        it does, until rank 0's engine closes (runtime/follow.py)."""
        share = self.share
        while (message := announce(share, None)) is not None:
            if message.get("op") == "time_layer_sum":
                self.time_layer_sum()
                continue
            self.request_mode(message["mode"])
            self.request_k(message["k"])
            config = message["gen"]
            gen = GenerationConfig(**{**config, "logit_bias": dict(config["logit_bias"])})

            def stop_here() -> bool:
                stop, k, mode = agree(share, False, 0, 0)
                if (k, MODES[mode]) != self.pending:
                    self.request_mode(MODES[mode])
                    self.request_k(k)
                return stop

            prompt, forced = message["prompt"], message["forced"]
            reply = Reply(self._reply(prompt, gen, stop_here, forced, message["logits"]))
            for _ in reply:
                pass
            if on_reply is not None:
                on_reply(reply.result)

    def time_layer_sum(self, repeats: int = 50) -> float:
        """The median ms of one MoE layer's sum over the ranks at decode, timed alone (every rank
        runs it: rank 0 tells the others)."""
        if self.share.rank == 0:
            announce(self.share, {"op": "time_layer_sum"})
        return self.share.time_sum(
            (1, self.k, self.loaded.hidden), self.loaded.float_dtype, repeats
        )

    def _reply(
        self,
        prompt_tokens: list[int],
        gen: GenerationConfig,
        should_stop: Callable[[], bool] | None,
        forced_tokens: list[int] | None,
        keep_logits: bool,
        announcement: dict | None = None,
    ) -> Generator[GeneratedToken, None, GenerationResult]:
        if announcement is not None:  # told as the reply starts: a reply never run is never told
            announce(self.share, announcement)
            self._agreed = (announcement["k"], announcement["mode"])
        # The request's peaks, MLX's and the kernel's RSS high-water mark, start here.
        peak_rss_scope = reset_request_peaks()
        if gen.seed is not None:
            mx.random.seed(gen.seed)
        self.apply_requests()
        profile = (self.k, self.mode)
        cache, reused = self._take_prompt_cache(prompt_tokens, profile)
        self._reset_request_state()
        if self.tracer.samples_compute and self._following_compute is None:
            self._following_compute = follow_compute(self.tracer)  # once: MLX's thread stays
        sampler = Sampler(gen, prompt_tokens)
        speculation = Speculation(gen) if gen.draft is not None else None
        decoder = Decoder(self, cache, sampler, forced_tokens, keep_logits, speculation)
        result = GenerationResult(list(prompt_tokens), [], "", decoder.steps)
        eos = set(self.tokenizer.eos_token_ids)
        if forced_tokens is not None or gen.ignore_eos:
            eos = set()
        try:
            for item in decoder.run(prompt_tokens, reused, gen.max_tokens, eos, should_stop):
                result.tokens.append(item.token)
                if item.logprobs is not None:
                    result.logprobs.append(item.logprobs)
                yield item
            result.stopped_by = decoder.stopped_by
            result.summary = summarize(
                result.steps,
                len(prompt_tokens),
                peak_mlx_bytes=mx.get_peak_memory(),
                peak_rss_bytes=process_peak_rss_bytes(),
                peak_rss_scope=peak_rss_scope,
            )
            result.summary["reused_prompt_tokens"] = reused
            if self.store is not None and self.store.share is not None:
                result.summary["ranks"] = self.store.share.by_rank(self._rank_figures(result))
        finally:
            # Whatever happened (a read error, a cancel), no per-request state outlives the request.
            self._reset_request_state()
            self._agreed = None  # between replies, a switch applies at once (the next is told)
        if not result.tokens:  # cancelled during the prefill: the cache holds part of it
            result.summary["generated_tokens"] = 0
        elif self.config.reuse_prompt_cache and (self.k, self.mode) == profile:
            # The cache now holds the prompt and every generated token but the last (never fed,
            # unless a step was built ahead of it).
            fed = list(prompt_tokens) + result.tokens[: None if decoder.cache_holds_last else -1]
            self._prompt_cache = (cache, fed, profile)
        result.text = self.reply_text(result.tokens)
        return result

    def _rank_figures(self, result: GenerationResult) -> dict[str, float]:
        """What this rank read, held and waited for in a reply, to show beside the others'."""
        decode = [s for s in result.steps if s.phase == "decode"]
        return {
            "expert_mib_read": sum(s.mib_read + s.whole_layer_mib for s in result.steps),
            "decode_expert_mib_read": sum(s.mib_read for s in decode),
            "loads": sum(s.loads for s in result.steps),
            "median_blocked_ms": statistics.median(s.blocked_ms for s in decode) if decode else 0.0,
            "expert_cache_mib": self.store.pool.resident_bytes / 2**20,
            "decode_tok_per_s": result.summary["decode_tok_per_s"],
        }

    def checked_request(
        self, prompt_tokens: list[int], gen: GenerationConfig | None, forced: list[int] | None
    ) -> GenerationConfig:
        """The reply's config (as long as `forced` where given), or an Edge0Error naming what
        this model cannot do."""
        gen = gen or GenerationConfig()
        if forced is not None:
            gen = dataclasses.replace(gen, max_tokens=len(forced))
        if not prompt_tokens:
            raise Edge0Error("the prompt is empty")
        if len(prompt_tokens) + gen.max_tokens > self.context_limit:
            where = (
                f"the model's context of {self.context_limit} (max_position_embeddings in "
                f"{self.model_dir / 'config.json'})"
                if self.context_limit == self.model_context
                else f"the context of {self.context_limit} tokens the memory plan counts "
                f"(the model's is {self.model_context}; --context sets it)"
            )
            raise Edge0Error(
                f"prompt of {len(prompt_tokens)} tokens plus {gen.max_tokens} new tokens exceeds "
                f"{where}"
            )
        if gen.top_k >= self.vocab_size:
            raise Edge0Error(
                f"top_k={gen.top_k} must be below the vocabulary size of {self.vocab_size} "
                "(0 turns top-k off)"
            )
        check_draftable(gen, self.pending[1], make_prompt_cache(self.model))
        outside = [t for t in gen.logit_bias if t >= self.vocab_size]
        if outside:
            raise Edge0Error(
                f"logit_bias=names token {outside[0]}, outside the vocabulary of {self.vocab_size}"
            )
        return gen

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
        if self.store is not None:
            self.store.reset()
        if self.routing is not None:
            self.routing.reset()

    def close(self) -> None:
        # The other ranks' `follow` ends. Not when out of step: they are inside the reply that
        # failed, not listening; their launcher stops them once rank 0 has ended.
        if self.share is not None and self.share.rank == 0 and not self._out_of_step:
            try:
                announce(self.share, None)
            except RuntimeError:
                pass  # a rank is lost (its launcher stops the others): nobody to tell
        if self.store is not None:
            self.store.close()
        if self.memory is not None:
            self.memory.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
