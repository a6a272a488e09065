"""The engine: prefill and decode with mlx-lm's KV caches, sampling, and per-step metrics.

Prefill runs the prompt except its last token in chunks, evaluating only the cache (no logits), as
mlx-lm does; the forward on the last prompt token yields the first generated token. Everything up to
that token is the `prefill` phase (its sum is time-to-first-token); every later forward is `decode`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from .config import EngineConfig, GenerationConfig
from .errors import Edge0Error
from .families import set_top_k
from .loader import LoadedModel, load
from .metrics import LoadCounters, MemorySampler, StepMetrics, summarize

TokenCallback = Callable[[int, StepMetrics], None]


@dataclass(frozen=True)
class KProfile:
    """A routing width the engine can switch to."""

    k: int
    # True when trained adapters recover quality at this K; False when the true router is simply
    # narrowed or widened (quality is not recovered).
    recovered: bool


@dataclass
class GenerationResult:
    prompt_tokens: list[int]
    tokens: list[int]
    text: str
    steps: list[StepMetrics]
    summary: dict = field(default_factory=dict)
    stopped_by: str = "max_tokens"  # "eos", "max_tokens" or "cancelled"


class Engine:
    """One loaded checkpoint, ready to generate. All MLX work happens on the calling thread."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.model_dir = Path(model_dir)
        self.loaded: LoadedModel = load(self.model_dir, self.config)
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        self.store = self.loaded.store
        self.memory = MemorySampler(
            self.loaded.index.expert_file_ranges(), self.config.page_cache_sample_share
        )
        self.k = self.loaded.top_k
        self._requested_k: int | None = None
        self._lock = threading.Lock()
        self.context_limit = int(
            self.loaded.config.get("max_position_embeddings")
            or self.loaded.config.get("text_config", {}).get("max_position_embeddings")
            or 1 << 31
        )

    @property
    def mode(self) -> str:
        return self.config.mode

    def encode(self, text: str, chat: bool = False) -> list[int]:
        """Token ids of `text`: raw (as is), or wrapped in the tokenizer's chat template."""
        if chat:
            return self.encode_chat([{"role": "user", "content": text}])
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation (`role`/`content` dicts), ready for the assistant's turn."""
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def info(self) -> dict:
        """What a status line or `edge0 info` shows about this engine."""
        index = self.loaded.index
        layer_experts = next(iter(index.layers.values()))
        return {
            "model": self.model_dir.name,
            "family": self.loaded.family.name,
            "mode": self.mode,
            "k": self.k,
            "native_k": self.loaded.top_k,
            "moe_layers": len(index.layers),
            "experts": layer_experts.num_experts,
            "expert_bytes": index.expert_nbytes,
            "expert_cache_bytes": self.config.expert_cache_bytes,
            "dtype": str(self.loaded.float_dtype or "as saved"),
        }

    # -- routing width -----------------------------------------------------------------------------

    def profiles(self) -> list[KProfile]:
        """The K values this engine can route with. Without adapter files, the true router is
        narrowed or widened, and quality at K other than the native one is not recovered."""
        experts = next(iter(self.loaded.index.layers.values())).num_experts
        ks = sorted({k for k in (2, 4, 8) if k <= experts} | {self.loaded.top_k})
        return [KProfile(k, recovered=(k == self.loaded.top_k)) for k in ks]

    def request_k(self, k: int) -> KProfile:
        """Ask for routing width `k`; safe from any thread, applied before the next step."""
        profile = next((p for p in self.profiles() if p.k == k), None)
        if profile is None:
            choices = ", ".join(str(p.k) for p in self.profiles())
            raise Edge0Error(f"K={k} is not available for this model (choose {choices})")
        if self.store is not None:
            self.store.check_budget(k)
        with self._lock:
            self._requested_k = k
        return profile

    def _apply_requested_k(self) -> None:
        with self._lock:
            k, self._requested_k = self._requested_k, None
        if k is None or k == self.k:
            return
        for site in self.loaded.sites:
            set_top_k(site.parent, k)
        self.k = k

    def generate(
        self,
        prompt_tokens: list[int],
        gen: GenerationConfig | None = None,
        on_token: TokenCallback | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> GenerationResult:
        gen = gen or GenerationConfig()
        if not prompt_tokens:
            raise Edge0Error("the prompt is empty")
        if len(prompt_tokens) + gen.max_tokens > self.context_limit:
            raise Edge0Error(
                f"prompt of {len(prompt_tokens)} tokens plus {gen.max_tokens} new tokens exceeds "
                f"the model's context of {self.context_limit}"
            )
        mx.reset_peak_memory()
        if gen.seed is not None:
            mx.random.seed(gen.seed)
        sampler = make_sampler(gen.temperature, top_p=gen.top_p, top_k=gen.top_k)
        cache = make_prompt_cache(self.model)
        if self.store is not None:
            self.store.reset()
        try:
            return self._generate(prompt_tokens, gen, sampler, cache, on_token, should_stop)
        finally:
            # Whatever happened (a read error, a cancel), no per-request state outlives the request.
            if self.store is not None:
                self.store.reset()

    def _generate(
        self, prompt_tokens, gen, sampler, cache, on_token, should_stop
    ) -> GenerationResult:
        eos = set(self.tokenizer.eos_token_ids)
        steps: list[StepMetrics] = []
        result = GenerationResult(list(prompt_tokens), [], "", steps)

        chunk = self.config.prefill_chunk
        for start in range(0, len(prompt_tokens) - 1, chunk):
            piece = prompt_tokens[start : min(start + chunk, len(prompt_tokens) - 1)]
            self._forward(piece, cache, "prefill", steps, logits_wanted=False)
        logits = self._forward(prompt_tokens[-1:], cache, "prefill", steps)
        while True:
            token = self._sample(logits, sampler)
            result.tokens.append(token)
            if on_token is not None:
                on_token(token, steps[-1])
            if token in eos:
                result.stopped_by = "eos"
                break
            if len(result.tokens) >= gen.max_tokens:
                break
            if should_stop is not None and should_stop():
                result.stopped_by = "cancelled"
                break
            logits = self._forward([token], cache, "decode", steps)

        result.text = self.tokenizer.decode(result.tokens)
        result.summary = summarize(steps, len(prompt_tokens))
        return result

    def _forward(
        self,
        tokens: list[int],
        cache: list,
        phase: str,
        steps: list[StepMetrics],
        logits_wanted=True,
    ) -> mx.array | None:
        self._apply_requested_k()
        start = time.perf_counter()
        if self.store is not None:
            self.store.begin_step()
        out = self.model(mx.array(tokens)[None], cache=cache)
        if logits_wanted:
            out = out[:, -1, :]
            mx.eval(out)
        else:
            mx.eval([c.state for c in cache])
            out = None
        counters = self.store.end_step() if self.store is not None else LoadCounters()
        wall_ms = (time.perf_counter() - start) * 1e3
        pool_bytes = self.store.pool.resident_bytes if self.store is not None else 0
        steps.append(
            StepMetrics.build(
                phase, len(tokens), wall_ms, counters, self.memory.snapshot(), pool_bytes
            )
        )
        return out

    @staticmethod
    def _sample(logits: mx.array, sampler) -> int:
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        return int(sampler(logprobs).item())

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        self.memory.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
