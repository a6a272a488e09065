"""`edge0 eval`: a K profile's held-out quality, and what merging its LoRA into the base would cost.

    edge0 eval MODEL --text FILE [--k K] [--mode resident|on-demand|prerouter] [--no-lora] [--json]

- **Perplexity** over teacher-forced windows of the held-out text. resident / on-demand: the
  engine's model (true router at K). prerouter: the student path (`student.py`): position 0 routed by
  the gate, every later position by the prediction made one position earlier, which is what decode
  computes. (The engine's own forward over a window is a prefill and routes by the gate.)
- **recall@K** of the heads against the true router, per consumer layer: the router run on the
  consumer's actual input on the student path, over the same windows (what `--shadow-router`
  measures at decode); chance is K/E.
- **distinct-4**: distinct token 4-grams over all 4-grams of each sampled continuation, averaged. The
  collapse detector: heads-only checkpoints decode into repetition.
- **Merge-then-requantize retention** of the LoRA: merge the delta into the dequantized base weight,
  requantize (4-bit, group 64, `mx.quantize`), dequantize, and compare with the unmerged model:
  retention = 1 - |U - M| / |U - B| (U unmerged = base + delta, M merged-requantized, B base), per
  module kind on weights and on logits over held-out windows; on weights also the projection of the
  change the delta made that survived on it, <M - M0, delta> / |delta|^2, M0 being the base
  requantized alone (MLX's affine quantize is not idempotent: it re-grids a few groups of a 4-bit
  checkpoint's own weights, which the norm formula counts against the merge). The merge is what
  `mlx_lm fuse` then `convert -q` do: in the checkpoint's float dtype (bf16). The paper measured
  the same shares (its figures beside ours: docs/notebook/figures-from-code-comments.md).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..adapters.lora import LoRALinear
from ..config import EngineConfig
from ..errors import Edge0Error
from ..runtime.generation import Engine
from ..runtime.layer_major import (
    decoder_layer_list,
    layer_major,
    pass_budget,
    windows_per_pass,
)
from ..runtime.metrics import peak_memory_line, process_lifetime_peaks
from ..train.data import corpus_tokens, draw_prompts, sample_served
from ..train.run import Log, ProgressLines
from ..train.student import Student, load_student, lora_kind

PAPER_RETENTION = {"attention": 0.34, "dense": 0.02, "logits": 0.18}


@dataclass
class EvalConfig:
    k: int | None = None  # None: the engine's default for the mode
    mode: str | None = None  # None: prerouter when the model has heads, else on-demand
    lora: bool = True
    window: int = 128  # tokens per teacher-forced window
    max_tokens: int = 16_384  # of the held-out text, at most
    batch: int = 4  # windows per student forward
    samples: int = 8  # sampled continuations for distinct-4
    prompt_tokens: int = 16
    sample_tokens: int = 64
    temperature: float = 0.8
    top_p: float = 0.95
    retention_windows: int = 4
    group_size: int = 64  # the requantization of the merged weights
    bits: int = 4
    # The expert cache (EngineConfig's fields): by default what the memory plan leaves, so that
    # an evaluation runs wherever the model streams.
    expert_cache_bytes: int = 1 << 30
    expert_cache_auto: bool = True
    seed: int = 0
    exact_kernels: bool = False  # EngineConfig's field of the same name
    # Where K profiles are looked for (EngineConfig's fields of the same names).
    adapter_dirs: tuple[Path, ...] = ()
    data_dir: Path | None = None


# -- the maths ---------------------------------------------------------------------------------------


def nll_sum(logits: mx.array, tokens: mx.array) -> tuple[float, int]:
    """Summed negative log-likelihood of tokens[:, 1:] under logits[:, :-1], and the count."""
    nll = nn.losses.cross_entropy(logits[:, :-1].astype(mx.float32), tokens[:, 1:])
    return nll.sum().item(), nll.size


def perplexity(nll: float, count: int) -> float:
    return math.exp(nll / count)


def distinct_ngram_ratio(sequences: Sequence[Sequence], n: int = 4) -> float:
    """Mean over sequences (with at least n items) of distinct n-grams / all n-grams."""
    ratios = []
    for seq in sequences:
        grams = [tuple(seq[i : i + n]) for i in range(len(seq) - n + 1)]
        if grams:
            ratios.append(len(set(grams)) / len(grams))
    if not ratios:
        raise Edge0Error(f"no sequence has {n} items")
    return float(np.mean(ratios))


def retention(unmerged: mx.array, merged: mx.array, base: mx.array) -> float:
    """1 - |U - M| / |U - B|: 1 when merging keeps the adapter's effect, 0 when it erases it."""
    return 1.0 - _norm(unmerged - merged) / _norm(unmerged - base)


def requantize(
    weight: mx.array, group_size: int = 64, bits: int = 4, out_dtype: mx.Dtype | None = None
) -> mx.array:
    """`weight` quantized (affine) in its own dtype, where a checkpoint keeps the scales, then
    dequantized in `out_dtype` (default: the same)."""
    packed, scales, biases = mx.quantize(weight, group_size, bits)
    out_dtype = out_dtype or weight.dtype
    return mx.dequantize(
        packed, scales.astype(out_dtype), biases.astype(out_dtype), group_size, bits
    )


def _norm(a: mx.array) -> float:
    return math.sqrt(mx.sum(mx.square(a.astype(mx.float32))).item())


@dataclass
class Merge:
    """One LoRA module merged into its base and requantized, in the student's float dtype."""

    merged: mx.array  # M: base + delta, requantized
    alone: mx.array  # the base requantized with no delta (MLX's regridding is not idempotent)
    step: float  # mean 4-bit step (scale) of the base


def merge_lora(student: Student, engine: Engine, group_size: int = 64, bits: int = 4):
    """Every LoRA module merged as `mlx_lm fuse` then `convert -q` would: the base dequantized from
    the engine's 4-bit codes in the checkpoint's float dtype, the delta added there, quantized again;
    then dequantized as the served kernels compute (the student's float dtype)."""
    served = dict(engine.model.named_modules())
    dtypes = {"BF16": mx.bfloat16, "F16": mx.float16, "F32": mx.float32}
    merges = {}
    for path, module in student.lora_modules().items():
        base = served.get(path)
        base = base.base if isinstance(base, LoRALinear) else base
        entry = engine.loaded.index.tensors.get(f"{path}.scales")
        if not isinstance(base, nn.QuantizedLinear) or entry is None or entry.dtype not in dtypes:
            raise Edge0Error(
                f"{path}: not a quantized layer of the checkpoint; nothing to requantize"
            )
        dtype = dtypes[entry.dtype]
        biases = base.get("biases")
        checkpoint = mx.dequantize(
            base.weight,
            base.scales.astype(dtype),
            None if biases is None else biases.astype(dtype),
            base.group_size,
            base.bits,
            base.mode,
        )
        delta = (module.scale * (module.lora_b @ module.lora_a)).astype(dtype)
        out = module.base.weight.dtype
        merges[path] = Merge(
            requantize(checkpoint + delta, group_size, bits, out),
            requantize(checkpoint, group_size, bits, out),
            mx.mean(mx.abs(base.scales)).item(),
        )
    return merges


def weight_retention(student: Student, merges: dict[str, Merge]) -> dict[str, dict]:
    """Per module kind, over its LoRA modules: `retention` of the merged weights; the change the
    delta made that survived, projected on it, <M - M0, delta> / |delta|^2 (M0: the base requantized
    alone, which is B except in the groups MLX's affine quantize re-grids); the base's own
    requantization |M0 - B| / |delta| (what merging costs with no delta at all); the delta's RMS;
    the 4-bit step."""
    sums: dict[str, dict] = {}
    for path, module in student.lora_modules().items():
        base = module.base.weight.astype(mx.float32)
        delta = module.scale * (module.lora_b @ module.lora_a).astype(mx.float32)
        merged = merges[path].merged.astype(mx.float32)
        s = sums.setdefault(lora_kind(path), dict.fromkeys(("lost", "delta", "kept", "alone"), 0.0))
        s["lost"] += mx.sum(mx.square(base + delta - merged)).item()
        s["delta"] += mx.sum(mx.square(delta)).item()
        alone = merges[path].alone.astype(mx.float32)
        s["kept"] += mx.sum((merged - alone) * delta).item()
        s["alone"] += mx.sum(mx.square(alone - base)).item()
        s.setdefault("steps", []).append(merges[path].step)
        s["elements"] = s.get("elements", 0) + delta.size
    report = {}
    for kind, s in sums.items():
        some = s["delta"] > 0
        report[kind] = {
            "modules": len(s["steps"]),
            "retention": 1.0 - math.sqrt(s["lost"] / s["delta"]) if some else None,
            "projected": s["kept"] / s["delta"] if some else None,
            "requantized_alone": math.sqrt(s["alone"] / s["delta"]) if some else None,
            "delta_rms": math.sqrt(s["delta"] / s["elements"]),
            "step_mean": float(np.mean(s["steps"])),
        }
    return report


@contextlib.contextmanager
def lora_as(student: Student, how: str, merges: dict[str, Merge] | None = None):
    """The student with its LoRA `unmerged` (as served), `off` (the base), or `merged`."""
    saved = [(p, m, m.base.weight, m.scale) for p, m in student.lora_modules().items()]
    try:
        for path, module, _, _ in saved:
            if how == "merged":
                module.base.weight = merges[path].merged
            if how != "unmerged":
                module.scale = 0.0
        yield student
    finally:
        for _, module, weight, scale in saved:
            module.base.weight, module.scale = weight, scale


def logits_retention(student: Student, merges: dict[str, Merge], windows: mx.array) -> float:
    """`retention` on the logits of held-out windows through the student path."""
    logits = {}
    for how in ("unmerged", "merged", "off"):
        with lora_as(student, how, merges):
            logits[how] = student(windows)
            mx.eval(logits[how])
    return retention(logits["unmerged"], logits["merged"], logits["off"])


def recall_counts(record: dict, k: int) -> dict[int, tuple[int, int]]:
    """Per layer routed by prediction: (predicted experts the true router also chose, all)."""
    counts = {}
    for layer, (executed, true, predicted) in record.items():
        if predicted:
            pred, true = executed[:, 1:], true[:, 1:]  # position 0 routes by the gate
            hits = (pred[..., :, None] == true[..., None, :]).any(axis=-1).sum().item()
            counts[layer] = (hits, pred.size)
    return counts


# -- the command ---------------------------------------------------------------------------------------


def passes(windows: mx.array, loaded) -> list[mx.array]:
    """`windows` [N, T] in groups of as many as one layer-major pass of `loaded` holds within its
    memory plan."""
    per_pass = windows_per_pass(windows.shape[1], loaded.hidden, pass_budget(loaded.memory_plan))
    return [windows[start : start + per_pass] for start in range(0, len(windows), per_pass)]


@dataclass
class PassTotals:
    """What a text's layer-major passes add up to."""

    nll: float = 0.0  # summed negative log-likelihood
    tokens: int = 0  # scored
    expert_bytes_read: int = 0  # routed-expert bytes read from the checkpoint (0: resident)
    hits: dict[int, tuple[int, int]] = field(default_factory=dict)  # recall@K counts by layer

    @property
    def perplexity(self) -> float:
        return perplexity(self.nll, self.tokens)

    def add(self, sums: list[tuple[float, int]], store) -> None:
        self.nll += sum(s for s, _ in sums)
        self.tokens += sum(n for _, n in sums)
        if store is not None:  # the pass's counters (it is one step of the store)
            self.expert_bytes_read += store.counters.bytes_read


def engine_nll(engine: Engine, windows: mx.array, log: Log | None = None) -> PassTotals:
    """Summed NLL of `windows` through the engine's model (its own router), one window a
    forward, in layer-major passes (`runtime/layer_major.py`): each MoE layer's experts are
    read about once a pass. `log` gets progress lines with what is left."""
    totals = PassTotals()
    parts = passes(windows, engine.loaded)
    progress = PassProgress(log, len(parts), len(decoder_layer_list(engine.model)))
    for part in parts:
        batches, sums = [w[None] for w in part], []
        layer_major(
            engine.model,
            batches,
            engine.model,
            _summing_nll(batches, sums),
            engine.store,
            after_layer=progress.layer_done,
        )
        totals.add(sums, engine.store)
    return totals


class PassProgress:
    """Perplexity's progress on the log (`run.ProgressLines`), counted in decoder layers run
    over a pass: a pass may hold every window, and its layers are what takes the time."""

    def __init__(self, log: Log | None, passes: int, layers: int) -> None:
        total, first = passes * layers, "perplexity, its first layer"
        self.lines = ProgressLines(log, "perplexity", "layers", total, first=first) if log else None
        self.done = 0

    def layer_done(self, index: int = 0) -> None:
        self.done += 1
        if self.lines is not None:
            self.lines.advance(self.done)


def student_nll(
    student: Student, windows: mx.array, batch: int, k: int, log: Log | None = None
) -> PassTotals:
    """Summed NLL of `windows` through the student path (routing as decode routes), `batch`
    windows a forward, in layer-major passes; and recall@K hits per consumer layer. `log` gets
    progress lines with what is left."""
    totals = PassTotals()
    parts = passes(windows, student.loaded)
    progress = PassProgress(log, len(parts), len(decoder_layer_list(student.model)))
    for part in parts:
        batches = [part[start : start + batch] for start in range(0, len(part), batch)]
        records: list[dict] = [{} for _ in batches]
        sums: list[tuple[float, int]] = []
        student.layer_major(batches, records, _summing_nll(batches, sums), progress.layer_done)
        totals.add(sums, student.loaded.store)
        for record in records:
            for layer, (h, c) in recall_counts(record, k).items():
                before = totals.hits.get(layer, (0, 0))
                totals.hits[layer] = (before[0] + h, before[1] + c)
    return totals


def _summing_nll(batches: list[mx.array], sums: list[tuple[float, int]]):
    """A layer-major pass's `score`: each batch's summed NLL and count into `sums`."""
    return lambda b, logits: sums.append(nll_sum(logits, batches[b]))


def engine_logits(engine: Engine, tokens: mx.array) -> mx.array:
    """The engine's model over a whole window (in on-demand mode, experts through the pool)."""
    if engine.store is not None:
        engine.store.begin_step()
    try:
        logits = engine.model(tokens)
        mx.eval(logits)
        return logits
    finally:
        if engine.store is not None:
            engine.store.end_step()


def evaluate(model_dir: str | Path, text: str, config: EvalConfig, log: Log | None = None) -> dict:
    """The report `edge0 eval` prints (see the module docstring)."""
    model_dir = Path(model_dir)
    log = log or (lambda line: None)
    engine_config = EngineConfig(
        mode=config.mode or "on-demand",
        k=config.k,
        lora=config.lora,
        expert_cache_bytes=config.expert_cache_bytes,
        expert_cache_auto=config.expert_cache_auto,
        exact_kernels=config.exact_kernels,
        adapter_dirs=config.adapter_dirs,
        data_dir=config.data_dir,
    )
    if config.max_tokens < config.window:  # else "the text is too short", whatever the text
        raise Edge0Error(
            f"max_tokens={config.max_tokens} is below one perplexity window of {config.window} "
            f"tokens: give at least {config.window}"
        )
    engine = Engine(model_dir, engine_config)
    try:
        if config.mode is None and "prerouter" in engine.modes():
            # prerouter when some K profile (over the whole adapter search) has heads
            engine.request_mode("prerouter")
            engine.apply_requests()
        return _evaluate(engine, engine.mode, text, config, log, engine_config)
    finally:
        engine.close()


def _evaluate(
    engine: Engine, mode: str, text: str, config: EvalConfig, log: Log, engine_config: EngineConfig
) -> dict:
    k = engine.k
    files = engine.adapters.get(k)
    heads_file = files.prerouter if files is not None else None
    lora_file = files.lora if files is not None and config.lora else None
    report = {
        "model": engine.model_dir.name,
        "mode": mode,
        "k": k,
        "experts": engine.loaded.num_experts,
        "heads": heads_file.name if heads_file else None,
        "lora": lora_file.name if lora_file else None,
        # The engine serves a LoRA in prerouter mode only; retention is measured on the file anyway.
        "lora_applied": mode == "prerouter" and lora_file is not None,
    }
    tokens = corpus_tokens(engine.tokenizer, text, config.max_tokens)
    count = len(tokens) // config.window
    if count < 1:
        raise Edge0Error(
            f"the text is too short: {len(tokens)} tokens for windows of {config.window}"
        )
    windows = mx.array(tokens[: count * config.window].reshape(count, config.window))
    student = None
    if heads_file is not None or lora_file is not None:
        log("building the student path (dequantized base)")
        student = load_student(
            engine.model_dir, k, heads_file is not None, lora_file, engine_config
        )

    # -- perplexity and recall@K -------------------------------------------------------------------
    log(f"perplexity over {count} windows of {config.window} tokens")
    totals = PassTotals()
    if student is not None and (mode == "prerouter" or student.heads is not None):
        totals = student_nll(student, windows, config.batch, k, log)
    hits = totals.hits
    if mode != "prerouter":
        totals = engine_nll(engine, windows, log)
    report["perplexity"] = {
        "value": totals.perplexity,
        "tokens": totals.tokens,
        "expert_bytes_read": totals.expert_bytes_read,
        "windows": count,
        "window": config.window,
        "path": "student path (routing as decode routes)" if mode == "prerouter" else "engine",
    }
    if hits:
        per_layer = {layer: h / n for layer, (h, n) in sorted(hits.items())}
        report["recall"] = {
            "per_layer": per_layer,
            "mean": float(np.mean(list(per_layer.values()))),
            "chance": k / engine.loaded.num_experts,
        }

    # -- distinct-4 of sampled continuations -------------------------------------------------------
    rng = np.random.default_rng(config.seed)
    prompts = draw_prompts(tokens, config.samples, config.prompt_tokens, rng)
    log(f"sampling {config.samples} continuations of {config.sample_tokens} tokens")
    continuations = sample_served(
        engine, prompts, config.sample_tokens, config.temperature, config.top_p, config.seed
    )
    report["distinct_4"] = distinct_ngram_ratio(continuations, 4)
    report["sample"] = engine.tokenizer.decode(continuations[0])

    # -- merge-then-requantize retention -----------------------------------------------------------
    if student is not None and student.lora is not None:
        log("merging the LoRA into the base and requantizing")
        merges = merge_lora(student, engine, config.group_size, config.bits)
        held = windows[: config.retention_windows]
        report["retention"] = {
            "weights": weight_retention(student, merges),
            "logits": logits_retention(student, merges, held),
            "requantization": f"{config.bits}-bit affine, group {config.group_size}",
            "paper": PAPER_RETENTION,
        }
    # The whole evaluation's peaks (the engine's load and the student path included): what a
    # machine needs to run it.
    report["memory"] = process_lifetime_peaks()
    return report


def format_report(report: dict) -> str:
    """The report as `edge0 eval` prints it."""
    ppl = report["perplexity"]
    lora = report["lora"] or "none"
    if report["lora"] and not report["lora_applied"]:
        lora += f" (not applied in {report['mode']} mode)"
    lines = [
        f"{report['model']}: mode {report['mode']}, K={report['k']}, heads "
        f"{report['heads'] or 'none'}, LoRA {lora}",
        f"perplexity {ppl['value']:.3f} over {ppl['tokens']} tokens ({ppl['windows']} windows of "
        f"{ppl['window']}, teacher-forced)",
    ]
    if report["mode"] == "prerouter":
        lines.append(
            "  through the student path: position 0 routed by the gate, every later position by "
            "the prediction made one position earlier, as decode computes (the engine's own "
            "forward over a window would route by the gate)"
        )
    if "recall" in report:
        recall = report["recall"]
        lines.append(
            f"recall@{report['k']} of the heads vs the true router on the same inputs: mean "
            f"{recall['mean']:.3f} (chance {recall['chance']:.3f})"
        )
        lines += [f"  layer {layer:3d}: {r:.3f}" for layer, r in recall["per_layer"].items()]
    lines.append(
        f"distinct-4 of sampled continuations {report['distinct_4']:.3f} (1 = no repeated "
        "4-gram; repetition collapse drives it toward 0)"
    )
    if "retention" in report:
        ret = report["retention"]
        lines.append(
            f"LoRA merge-then-requantize retention ({ret['requantization']}; 1 = merging keeps "
            "all of the adapter's effect):"
        )
        for kind, r in ret["weights"].items():
            lines.append(
                f"  {kind:16s} weights {_percent(r['retention'])} (projected on the delta "
                f"{_percent(r['projected'])}) over {r['modules']} modules; delta RMS "
                f"{r['delta_rms']:.2e}, 4-bit step {r['step_mean']:.2e}; requantizing the base "
                f"alone moves it by {_percent(r['requantized_alone'])} of |delta|"
            )
        lines.append(f"  logits           {_percent(ret['logits'])}")
        paper = ret["paper"]
        lines.append(
            f"  (paper: {paper['attention']:.0%} attention, {paper['dense']:.0%} dense, "
            f"{paper['logits']:.0%} logits)"
        )
    if "memory" in report:
        lines.append(peak_memory_line(report["memory"]) + " (the whole evaluation)")
    return "\n".join(lines)


def _percent(value: float | None) -> str:
    return "n/a (zero delta)" if value is None else f"{value:.1%}"
