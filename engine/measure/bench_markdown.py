"""`edge0 bench`'s report as text: the markdown tables (cf. the paper's Tables 3 and 4), the notes
under them, and the terminal plot of each arm's steps. `bench.py` runs the arms and builds the
report these read."""

from __future__ import annotations

import statistics

from ..config import format_bytes
from . import bench_reads_ahead
from .bench import FIGURES, TABLE_4


def wall_lines(report: dict) -> list[str]:
    """Under the throughput table, where a run had no wall: why, and what each mode then costs."""
    wall = report.get("memory_wall")
    if not wall or not wall["runs"] or wall["cold_mib"] > 0:
        return []
    why = (
        "the expert cache holds every expert the replay routes to (0 loads a step)"
        if wall["loads_per_step"] == 0
        else "every expert read came from the page cache (0 MiB read cold)"
    )
    lines = [
        "",
        f"**No memory wall in this run**: every expert is in memory ({why}). Each arm's ms/step "
        "is then its mode's own cost with nothing to read from disk. For a wall: a smaller "
        "`--expert-cache`, a `--page-cache` budget, or `--cold` with `--ram-limit` below the model.",
    ]
    arms = report["arms"]
    base = arms.get("on-demand", {}).get("figures", {}).get("median_wall_ms")
    for mode, what in (("prefetch", "the lookahead's guesses"), ("prerouter", "its heads' work")):
        step = arms.get(mode, {}).get("figures", {}).get("median_wall_ms")
        if base is not None and step is not None:
            extra = step["median"] - base["median"]
            lines.append(
                f"- {mode}: {extra:+.1f} ms/step against on-demand with nothing to read ({what})."
            )
    return lines


def plan_note(check: dict) -> str:
    """One line under the memory table: did every run stay within its plan?"""
    if not check["runs"]:
        return "No completed run to hold against its memory plan."
    if not check["over"]:
        return (
            f"Every run's true peak is within its memory plan + {check['slack']:.0%} "
            f"({check['runs']} runs; the largest peak / plan {check['largest_ratio']:.2f})."
        )
    over = "; ".join(
        f"{o['arm']} round {o['round']}: peak {o['peak_rss_mib']:.0f} MiB, plan {o['plan_mib']:.0f} MiB"
        for o in check["over"]
    )
    return f"**Over the memory plan + {check['slack']:.0%}**: {over}."


def peak_note(arms: dict) -> str:
    """What the two peak columns are, under the table that shows them."""
    scopes = {d.get("peak_rss_scope") for d in arms.values() if d["figures"]} - {None}
    if scopes == {"request"}:
        covers = "from the start of the replay to its end (the model's load is not in it)"
    else:
        covers = (
            "over the arm's whole process, the model's load included (this kernel's mark could "
            "not be reset as the replay began)"
        )
    return (
        "peak MLX: MLX's own peak counter over the replay; peak RSS: the kernel's high-water mark "
        f"of the arm's process (VmHWM, ru_maxrss on macOS) {covers}, not a maximum of samples."
    )


def sync_cost_note(cfg: dict) -> str:
    """`, each host sync made to wait 1 ms more (--sync-cost)`, or nothing at none."""
    cost = cfg.get("sync_cost_s") or 0.0
    return f", each host sync made to wait {cost * 1e3:g} ms more (--sync-cost)" if cost else ""


def markdown(report: dict) -> str:
    cfg = report["config"]
    limit = format_bytes(cfg["ram_limit_bytes"]) if cfg["ram_limit_bytes"] else "none"
    read_limit = cfg.get("read_limit_bps")
    how = " (paced in the readers)" if cfg.get("read_limit_by") == "pacing" else ""
    reads = f"read limit {format_bytes(read_limit)}/s{how}, " if read_limit else ""
    lines = [
        f"Model `{cfg['model']}`, K={cfg['k'] or 'native'}, expert cache "
        f"{'auto' if cfg.get('expert_cache_auto') else format_bytes(cfg['expert_cache_bytes'])}, "
        f"RAM limit {limit}, {reads}"
        f"{'cold' if cfg['cold'] else 'warm'} page cache, {cfg['rounds']} rounds (order rotated), "
        f"{report['prompt_tokens']} prompt + {report['tokens']} replayed tokens"
        f"{sync_cost_note(cfg)}. Median [min-max].",
        "",
        "**Throughput** (cf. the paper's Table 3; host syncs: the times a step waited on the "
        "device, each a GPU queue drain on Metal)",
        "",
        "| arm | decode tok/s | vs on-demand | vs resident | ms/step | blocked ms/step | vs on-demand | flush ms/step | host syncs/step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, data in report["arms"].items():
        f, ratios = data["figures"], data["ratios"]
        if not f:
            needed = data["memory_needed_bytes"]
            reason = "; ".join(data["errors"]) or "failed"
            lines.append(
                f"| {arm} | failed: {reason} (peak {format_bytes(needed)}) | | | | | | | |"
            )
            continue
        lines.append(
            f"| {arm} | {_cell(f, 'decode_tok_per_s', '{:.2f}')} | {_x(ratios.get('tok_s_vs_on-demand'))} "
            f"| {_x(ratios.get('tok_s_vs_resident'))} | {_cell(f, 'median_wall_ms', '{:.1f}')} "
            f"| {_cell(f, 'median_blocked_ms', '{:.1f}')} | {_x(ratios.get('blocked_vs_on-demand'))} "
            f"| {_cell(f, 'median_flush_ms', '{:.1f}')} | {_cell(f, 'median_host_syncs', '{:.1f}')} |"
        )
    lines += wall_lines(report)
    lines += [
        "",
        "**Loads and memory** (cf. the paper's Table 4)",
        "",
        "| arm | " + " | ".join(label for label, key, _ in FIGURES if key in TABLE_4) + " |",
        "|---" * (len(TABLE_4) + 1) + "|",
    ]
    for arm, data in report["arms"].items():
        f = data["figures"]
        if not f:
            continue
        cells = [_cell(f, key, fmt) for _, key, fmt in FIGURES if key in TABLE_4]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    lines += ["", peak_note(report["arms"])]
    for arm, settings in report.get("not_taken", {}).items():
        lines.append(f"{arm} ran without {', '.join(settings)}.")
    if "plan_check" in report:
        lines.append(plan_note(report["plan_check"]))
    read_arms = {a: d for a, d in report["arms"].items() if "read_mib_per_s" in d["figures"]}
    if read_limit or read_arms:
        lines += [
            "",
            "**Reads** (achieved: MiB read from disk during the replay over the time at least one "
            "expert read was in flight; the throttle lets short bursts pass above its limit)",
            "",
            "| arm | achieved read MiB/s | vs limit | disk MiB read | cold MiB (mincore) "
            "| read-busy ms |",
            "|---|---|---|---|---|---|",
        ]
        for arm, data in report["arms"].items():
            f = data["figures"]
            if arm not in read_arms:
                why = "no expert reads from disk" if f else "failed"
                lines.append(f"| {arm} | - ({why}) | | | | |")
                continue
            share = f["read_mib_per_s"]["median"] * 2**20 / read_limit if read_limit else None
            lines.append(
                f"| {arm} | {_cell(f, 'read_mib_per_s', '{:.1f}')} | {_x(share)} "
                f"| {_cell(f, 'read_disk_mib', '{:.1f}')} | {_cell(f, 'read_cold_mib', '{:.1f}')} "
                f"| {_cell(f, 'read_busy_ms', '{:.0f}')} |"
            )
    waits = {a: d for a, d in report["arms"].items() if "compute_waited_ms" in d["figures"]}
    if waits:
        from ..runtime.compute_activity import largest_waits  # MLX only with traced arms

        lines += [
            "",
            "**Compute waits** (`--trace`: ms a decode step that MLX's compute thread was off its "
            "core, and what the engine thread was doing meanwhile, in the first round)",
            "",
            "| arm | compute waited ms/step | the engine thread meanwhile (ms/step) |",
            "|---|---|---|",
        ]
        for arm, data in waits.items():
            first = next(
                r for r in report["runs"] if r["arm"] == arm and "compute_waited_ms" in r["summary"]
            )
            during = largest_waits(first["summary"]["compute_waits_by_span"])
            lines.append(
                f"| {arm} | {_cell(data['figures'], 'compute_waited_ms', '{:.1f}')} | {during} |"
            )
    overlap = {a: d["overlap"] for a, d in report["arms"].items() if "overlap" in d}
    if overlap:
        lines += [
            "",
            "**Overlap limit** (a step cannot beat max(compute-only step, cold MiB per step / "
            "achieved read MiB/s); medians)",
            "",
            "| arm | ms/step | compute-only ms | read ms | limit ms | step / limit | blocked share |",
            "|---|---|---|---|---|---|---|",
        ]
        for arm, o in overlap.items():
            step = report["arms"][arm]["figures"]["median_wall_ms"]["median"]
            lines.append(
                f"| {arm} | {step:.1f} | {o['compute_ms']:.1f} | {o['read_ms']:.1f} "
                f"| {o['limit_ms']:.1f} | {_x(o['step_vs_limit'])} "
                f"| {o['blocked_share']:.0%} |"
            )
    lines += rank_lines(report)
    lines += bench_reads_ahead.markdown_lines(report, _cell)
    return "\n".join(lines) + "\n"


def rank_lines(report: dict) -> list[str]:
    """The ranked arms (`MODE@N`): the ranks' sum per MoE layer and per token (timed alone, in
    the same run), against one process, and each rank's waits and reads."""
    ranked = {a: d for a, d in report["arms"].items() if d.get("ranks")}
    if not ranked:
        return []
    lines = [
        "",
        "**Ranks** (`MODE@N`: N processes on this machine, each with its share of the experts; "
        "the sum over the ranks timed alone; each rank's blocked ms/step and MiB read)",
        "",
        "| arm | decode tok/s | vs one process | sum ms/layer | sum ms/token | ranks |",
        "|---|---|---|---|---|---|",
    ]
    for arm, data in ranked.items():
        f = data["figures"]
        each = "; ".join(
            f"{r['rank']}: {r['median_blocked_ms']:.1f} ms blocked, {r['expert_mib_read']:.1f} MiB"
            for r in data["ranks"]
        )
        lines.append(
            f"| {arm} | {_cell(f, 'decode_tok_per_s', '{:.2f}')} "
            f"| {_x(data['ratios'].get('tok_s_vs_one_process'))} "
            f"| {_cell(f, 'all_sum_ms', '{:.2f}')} | {_cell(f, 'all_sum_ms_per_token', '{:.1f}')} "
            f"| {each} |"
        )
    return lines


def _cell(figures: dict, key: str, fmt: str) -> str:
    if key not in figures:
        return "-"
    v = figures[key]
    return f"{fmt.format(v['median'])} [{fmt.format(v['min'])}-{fmt.format(v['max'])}]"


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def terminal_plot(report: dict, width: int = 60) -> str:
    """ms/step of each arm over the decode steps (median over rounds), one row of bars per arm."""
    blocks = " ▁▂▃▄▅▆▇█"
    series = {a: d["step_ms_median"] for a, d in report["arms"].items() if d["step_ms_median"]}
    if not series:
        return "(no successful arm to plot)"
    top = max(max(s) for s in series.values())
    lines = [f"ms/step per decode step (full bar = {top:.0f} ms)"]
    for arm, values in series.items():
        step = max(1, len(values) // width)
        cols = [statistics.mean(values[i : i + step]) for i in range(0, len(values), step)][:width]
        bar = "".join(blocks[min(8, int(round(v / top * 8)))] for v in cols)
        lines.append(f"{arm:>10s} |{bar}| median {statistics.median(values):.0f} ms")
    return "\n".join(lines)
