"""`GET /metrics`: the memory wall in Prometheus's text format (version 0.0.4).

The same live figures the app's panels show (decode tok/s over the recent steps, ms blocked on
expert loads per step, the cold share of bytes read, loads per step, MLX memory, the checkpoint's
expert bytes in the OS page cache, the expert pool), the profile that stands (K and mode), and the
server's request counters. Written by hand: a few dozen lines do not need a client library.
"""

from __future__ import annotations

from dataclasses import dataclass

from .engine_worker import EngineWorker

MIB = 1024 * 1024
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class ServerStats:
    """Request counters; changed and read on the event loop's thread only."""

    served: int = 0  # replies finished (stop or length)
    failed: int = 0  # the server's own failures: 5xx, or an error event mid-stream
    client_errors: int = 0  # refused for the client's mistake: 4xx but 429 (access_log.py)
    rejected: int = 0  # 429: the queue was full
    cancelled: int = 0  # the client went away before its reply was finished
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Replies made under a grammar (structured output, a forced tool call), their tokens, and the
    # host time spent on the grammar's token masks.
    constrained: int = 0
    constrained_tokens: int = 0
    grammar_mask_ms: float = 0.0


def _label(value: object) -> str:
    text = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{text}"'


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self._described: set[str] = set()

    def metric(
        self, name: str, kind: str, help: str, value: float, labels: dict | None = None
    ) -> None:
        if name not in self._described:  # one HELP and TYPE per name, before its first sample
            self._described.add(name)
            self.lines.append(f"# HELP {name} {help}")
            self.lines.append(f"# TYPE {name} {kind}")
        shown = ""
        if labels:
            shown = "{" + ",".join(f"{k}={_label(v)}" for k, v in labels.items()) + "}"
        self.lines.append(f"{name}{shown} {float(value)!r}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


# With --hosts, each rank's figures from the last reply: (metric, figure, scale, help).
RANK_METRICS = (
    (
        "edge0_rank_expert_bytes_read",
        "expert_mib_read",
        MIB,
        "Expert bytes the rank read for the last reply.",
    ),
    (
        "edge0_rank_expert_cache_bytes",
        "expert_cache_mib",
        MIB,
        "Expert bytes in the rank's cache after the last reply.",
    ),
    (
        "edge0_rank_blocked_ms_per_step",
        "median_blocked_ms",
        1,
        "Milliseconds the rank's decode steps waited for expert bytes (median, last reply).",
    ),
)


def render(worker: EngineWorker, stats: ServerStats, model_id: str) -> str:
    live = worker.live
    memory = worker.memory
    last = live.last_step
    w = _Writer()
    w.metric(
        "edge0_info",
        "gauge",
        "The model served and the profile that stands (K and mode as labels).",
        1,
        {
            "model": model_id,
            "family": worker.info.get("family", ""),
            "k": live.k or "",
            "mode": live.mode,
            "state": worker.state,
        },
    )
    w.metric("edge0_ready", "gauge", "1 once the model is loaded.", worker.state == "ready")
    w.metric("edge0_k", "gauge", "Routing width K that stands.", live.k)
    w.metric(
        "edge0_decode_tokens_per_second",
        "gauge",
        "Decode speed over the recent steps, as the client sees tokens arrive.",
        live.tok_per_s,
    )
    w.metric(
        "edge0_blocked_ms_per_step",
        "gauge",
        "Milliseconds a decode step waited for expert bytes (mean of the recent steps).",
        live.blocked_ms,
    )
    w.metric(
        "edge0_cold_fraction",
        "gauge",
        "Share of the bytes read that were not in the OS page cache (recent decode steps).",
        live.cold_fraction,
    )
    w.metric(
        "edge0_loads_per_step",
        "gauge",
        "Experts read per decode step (mean of the recent steps).",
        live.loads_per_step,
    )
    w.metric(
        "edge0_host_syncs_per_step",
        "gauge",
        "Times a decode step waited on the device for a value it computed (mean of the recent "
        "steps): on Metal each one drains the GPU's queue.",
        live.host_syncs_per_step,
    )
    step = live.last_step
    if step is not None and step.phase == "decode":
        w.metric(
            "edge0_step_positions",
            "gauge",
            "Positions the latest decode step computed: 1, a batch's replies (--max-batch), or "
            "a drafted step's tokens.",
            step.tokens,
        )
        w.metric(
            "edge0_step_experts_union",
            "gauge",
            "Routed experts the latest decode step used, each once a layer, against "
            "edge0_step_experts_summed for its positions one at a time: the reads a step of "
            "several positions saves.",
            step.experts_union,
        )
        w.metric(
            "edge0_step_experts_summed",
            "gauge",
            "Routed experts the latest decode step's positions would use one at a time.",
            step.experts_summed,
        )
    w.metric(
        "edge0_read_bytes_per_step",
        "gauge",
        "Expert bytes read per decode step (mean of the recent steps).",
        live.mib_per_step * MIB,
    )
    w.metric(
        "edge0_mlx_active_bytes",
        "gauge",
        "MLX memory in use (wired on a Mac).",
        memory.get("mlx_active_bytes", 0),
    )
    w.metric(
        "edge0_mlx_cache_bytes",
        "gauge",
        "MLX's buffer cache.",
        memory.get("mlx_cache_bytes", 0),
    )
    w.metric(
        "edge0_mlx_peak_bytes",
        "gauge",
        "The most MLX memory held at once since the model loaded.",
        max(live.peak_memory_bytes, memory.get("mlx_peak_bytes", 0)),
    )
    w.metric(
        "edge0_process_resident_bytes",
        "gauge",
        "Resident set size of the server process now.",
        memory.get("rss_bytes", 0),
    )
    w.metric(
        "edge0_process_peak_rss_bytes",
        "gauge",
        "The kernel's high-water mark of the server process's resident set size (VmHWM; "
        "ru_maxrss on macOS): the most it has held at once since it started, the model's load "
        "included.",
        max(live.peak_rss_bytes, memory.get("process_peak_rss_bytes", 0)),
    )
    for source, share in live.routed_shares.items():
        w.metric(
            "edge0_routed_experts_share",
            "gauge",
            "Share of the recent decode steps' routed experts by where they came from: resident, "
            "read ahead by the heads or by the lookahead, or missed (read while the step waited).",
            share,
            {"source": source},
        )
    ranks = worker.last_figures.get("ranks", ())  # --hosts: each rank, its last reply
    for name, key, scale, help in RANK_METRICS:
        for row in ranks:  # (a family's samples together, as the text format wants)
            w.metric(name, "gauge", help, row[key] * scale, {"rank": int(row["rank"])})
    for layer, recall in live.lookahead_recall_by_layer.items():
        w.metric(
            "edge0_lookahead_recall",
            "gauge",
            "The lookahead's recall of a MoE layer's routing over the recent decode steps: the "
            "share of its routed experts that the guess made a layer earlier had named.",
            recall,
            {"layer": layer},
        )
    w.metric(
        "edge0_checkpoint_page_cache_bytes",
        "gauge",
        "Bytes of the checkpoint's expert tensors in the OS page cache (reclaimable).",
        memory.get("page_cache_expert_bytes", 0),
    )
    w.metric(
        "edge0_expert_pool_bytes",
        "gauge",
        "Routed-expert bytes held in the engine's pool.",
        (last.expert_pool_mib * MIB) if last is not None else 0,
    )
    w.metric(
        "edge0_expert_cache_budget_bytes",
        "gauge",
        "The expert pool's byte budget (--expert-cache).",
        worker.info.get("expert_cache_bytes", 0),
    )
    w.metric(
        "edge0_kv_cache_bytes",
        "gauge",
        "The conversation's KV cache kept for the next request.",
        worker.kv_cache_bytes,
    )
    w.metric(
        "edge0_context_tokens",
        "gauge",
        "Prompt and reply tokens of the latest request.",
        live.context_tokens,
    )
    prefill = live.last_prefill
    w.metric(
        "edge0_prefill_ms",
        "gauge",
        "Time to first token of the latest request (every prompt chunk, sampling excluded).",
        prefill.wall_ms if prefill is not None else 0,
    )
    w.metric("edge0_queue_depth", "gauge", "Requests waiting for the engine.", worker.queue_depth)
    w.metric(
        "edge0_queue_limit", "gauge", "Requests that may wait (--queue-limit).", worker.queue_limit
    )
    w.metric(
        "edge0_requests_running",
        "gauge",
        "Requests generating now (a batch's, or 1).",
        worker.running,
    )
    for name, value, help in (
        ("served", stats.served, "Replies finished."),
        ("failed", stats.failed, "Requests the server failed (5xx, or an error mid-stream)."),
        (
            "client_errors",
            stats.client_errors,
            "Requests refused for the client's mistake (4xx; 429 counted apart).",
        ),
        ("rejected", stats.rejected, "Requests refused with 429 because the queue was full."),
        ("cancelled", stats.cancelled, "Requests whose client went away before the reply ended."),
    ):
        w.metric(f"edge0_requests_{name}_total", "counter", help, value)
    w.metric(
        "edge0_prompt_tokens_total",
        "counter",
        "Prompt tokens of finished replies.",
        stats.prompt_tokens,
    )
    w.metric(
        "edge0_completion_tokens_total",
        "counter",
        "Tokens generated in finished replies.",
        stats.completion_tokens,
    )
    w.metric(
        "edge0_constrained_replies_total",
        "counter",
        "Finished replies made under a grammar (response_format, json_schema, grammar, or a "
        "forced tool call).",
        stats.constrained,
    )
    w.metric(
        "edge0_constrained_tokens_total",
        "counter",
        "Tokens generated in finished replies made under a grammar.",
        stats.constrained_tokens,
    )
    w.metric(
        "edge0_grammar_mask_ms_total",
        "counter",
        "Host milliseconds spent computing and applying grammars' token masks (divided by "
        "edge0_constrained_tokens_total: the cost per token).",
        stats.grammar_mask_ms,
    )
    return w.text()
