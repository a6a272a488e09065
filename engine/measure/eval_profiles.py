"""`edge0 eval MODEL --text FILE --profiles`: one table of every K profile's quality.

The reference is the 4-bit model as released: its own router at its native K, perplexity over
teacher-forced windows of the held-out text (the engine, on-demand). Every K profile with heads
is then measured on the same windows through the student path (routing as decode routes: by the
prediction made one position earlier), twice: heads only (the LoRA off), and with its LoRA. Each
row gives the perplexity, its ratio to the reference, and the heads' recall@K against the true
router per consumer layer.

The table is kept (`quality.json` in the model's automatic adapter folder, by the base's
fingerprint), so `edge0 info` and the app's K selector can show each profile's measured cost
(`K=4 prerouter +8.8% ppl`) without evaluating again. A kept file is data from disk: read with a
size bound and every number checked (`adapters/quality.py`).
"""

from __future__ import annotations

import gc
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..adapters.quality import keep_quality
from ..config import EngineConfig
from ..errors import Edge0Error
from ..experts.freed_memory import release_freed_memory
from ..runtime.generation import Engine
from ..train.data import corpus_tokens
from ..train.run import Log
from ..train.student import load_student
from .evaluate import EvalConfig, PassTotals, engine_nll, lora_as, student_nll


def evaluate_profiles(
    model_dir: str | Path, text: str, config: EvalConfig, log: Log | None = None
) -> dict:
    """The table (see the module docstring), also written to the automatic adapter folder."""
    model_dir = Path(model_dir)
    log = log or (lambda line: None)
    engine_config = EngineConfig(
        mode="on-demand",
        expert_cache_bytes=config.expert_cache_bytes,
        expert_cache_auto=config.expert_cache_auto,
        exact_kernels=config.exact_kernels,
        adapter_dirs=config.adapter_dirs,
        data_dir=config.data_dir,
    )
    engine = Engine(model_dir, engine_config)
    try:
        native = engine.loaded.top_k
        windows = _windows(engine, text, config)
        log(f"the 4-bit model at its native K={native}: {len(windows)} windows")
        reference = engine_nll(engine, windows, log)
        expert_bytes = _expert_bytes(engine.loaded)
        profiles = {
            k: files
            for k, files in sorted(engine.adapters.items())
            if files.prerouter is not None and engine.loaded.family.routing
        }
        fingerprint = engine.fingerprint
    finally:
        engine.close()
    del engine  # the students load after it, each planned with what the process holds then
    gc.collect()
    release_freed_memory()
    rows = [_row(native, "int4 model (true router)", reference, reference, expert_bytes)]
    for k, files in profiles.items():
        log(f"K={k}: {files.prerouter.name}" + (f" and {files.lora.name}" if files.lora else ""))
        student = load_student(model_dir, k, True, files.lora, engine_config)
        try:
            with lora_as(student, "off"):
                rows.append(_student_row(student, windows, config, k, "heads only", reference, log))
            if files.lora is not None:
                rows.append(
                    _student_row(student, windows, config, k, "heads + LoRA", reference, log)
                )
        finally:
            student.close()  # before the next profile's student is planned and loaded
        del student
    table = {
        "model": model_dir.name,
        "fingerprint": fingerprint,
        "native_k": native,
        "tokens": int(windows.size),
        "window": config.window,
        "rows": rows,
    }
    table["written"] = str(keep_quality(table, fingerprint, config.data_dir))
    return table


def _windows(engine: Engine, text: str, config: EvalConfig) -> mx.array:
    tokens = corpus_tokens(engine.tokenizer, text, config.max_tokens)
    count = len(tokens) // config.window
    if count < 1:
        raise Edge0Error(
            f"the text is too short: {len(tokens)} tokens for windows of {config.window}"
        )
    return mx.array(tokens[: count * config.window].reshape(count, config.window))


def _expert_bytes(loaded) -> int:
    """The model's routed-expert bytes: what an expert-reads figure is a multiple of."""
    return sum(layer.nbytes for layer in loaded.index.layers.values())


def _student_row(
    student,
    windows: mx.array,
    config: EvalConfig,
    k: int,
    variant: str,
    reference: PassTotals,
    log: Log | None = None,
) -> dict:
    """A profile's row: perplexity routed as decode routes, recall@K per consumer layer."""
    totals = student_nll(student, windows, config.batch, k, log)
    recall = {layer: h / c for layer, (h, c) in sorted(totals.hits.items())}
    return _row(k, variant, totals, reference, _expert_bytes(student.loaded), recall)


def _row(
    k: int,
    variant: str,
    totals: PassTotals,
    reference: PassTotals,
    expert_bytes: int,
    recall: dict | None = None,
) -> dict:
    ppl = totals.perplexity
    row = {"k": k, "variant": variant, "perplexity": ppl, "vs_native": ppl / reference.perplexity}
    # The row's routed-expert reads over the model's routed-expert bytes: about one per
    # layer-major pass (`runtime/layer_major.py`); 0 for a model held in memory.
    row["expert_reads"] = totals.expert_bytes_read / expert_bytes
    if recall:
        row["recall_per_layer"] = {str(layer): r for layer, r in recall.items()}
        row["recall_mean"] = float(np.mean(list(recall.values())))
    return row


def format_table(table: dict) -> str:
    """The table as `edge0 eval --profiles` prints it."""
    lines = [
        f"{table['model']}: every K profile against the 4-bit model at its native "
        f"K={table['native_k']} ({table['tokens']} tokens of held-out text, windows of "
        f"{table['window']}, routed as decode routes)",
        "",
        "| K | routing | perplexity | vs native | recall@K mean | recall@K per layer | expert reads |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in table["rows"]:
        recall = row.get("recall_per_layer", {})
        per_layer = " ".join(f"{layer}:{r:.2f}" for layer, r in recall.items()) or "-"
        mean = f"{row['recall_mean']:.3f}" if "recall_mean" in row else "-"
        lines.append(
            f"| {row['k']} | {row['variant']} | {row['perplexity']:.3f} "
            f"| {_change(row['vs_native'])} | {mean} | {per_layer} "
            f"| {row.get('expert_reads', 0):.2f}x |"
        )
    lines += [
        "",
        "expert reads: routed-expert bytes read for the row over the model's (each layer read "
        "about once a pass of the text)",
        f"kept in {table['written']} (edge0 info and the app show it)",
    ]
    return "\n".join(lines)


def _change(ratio: float) -> str:
    return "-" if ratio == 1.0 else f"{ratio - 1:+.1%}"
