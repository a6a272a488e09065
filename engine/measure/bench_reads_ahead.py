"""The bench's reads-ahead tables: how well each arm's reads ahead matched its routing.

Per arm (medians over rounds of each run's decode figures): the share of routed experts the
heads' reads ahead covered (prefetch with a K profile), the lookahead's recall (routed experts it
had guessed), and its reads per step: issued, landed in time, late, dropped unused; and the
heads' predicted experts not read ahead (their layer guessed better by the lookahead). By layer
(summed over every round): where each MoE layer's routed experts came from, resident, read ahead
by the heads or by the lookahead, or missed (read while the forward waited).
"""

from __future__ import annotations

from ..experts.counters import sum_layer_routed

# (label, summary key, format): added to the bench's per-arm figures.
READ_AHEAD_FIGURES = (
    ("heads hit rate", "prefetch_hit_rate", "{:.2f}"),
    ("lookahead recall", "lookahead_recall", "{:.2f}"),
    ("lookahead reads/step", "median_lookahead_issued", "{:.1f}"),
    ("lookahead in time", "median_lookahead_in_time", "{:.1f}"),
    ("lookahead late", "median_lookahead_late", "{:.1f}"),
    ("lookahead dropped", "median_lookahead_dropped", "{:.1f}"),
    ("heads not read", "median_heads_not_read", "{:.1f}"),
)


def routed_by_layer(summaries: list[dict]) -> dict[int, dict]:
    """Each layer's routed experts by where they came from, summed over the summaries of an
    arm's successful runs."""
    tables = (summary.get("routed_by_layer", {}) for summary in summaries)
    return {layer: vars(total) for layer, total in sum_layer_routed(tables).items()}


def markdown_lines(report: dict, cell) -> list[str]:
    """The reads-ahead tables (none when no arm read anything ahead). `cell(figures, key, fmt)`
    formats a median [min-max] cell as the bench's other tables do."""
    arms = {
        arm: data
        for arm, data in report["arms"].items()
        if any(key in data["figures"] for _, key, _ in READ_AHEAD_FIGURES)
    }
    if not arms:
        return []
    labels = [label for label, _, _ in READ_AHEAD_FIGURES]
    lines = [
        "",
        "**Reads ahead** (heads: a prediction a token ahead; lookahead: the next layer's router on "
        "this layer's input, a layer ahead; medians per decode step)",
        "",
        "| arm | " + " | ".join(labels) + " |",
        "|---|" + "---|" * len(labels),
    ]
    for arm, data in arms.items():
        cells = [cell(data["figures"], key, fmt) for _, key, fmt in READ_AHEAD_FIGURES]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "**Routed experts by layer** (shares of every decode step's routed experts, all rounds: "
        "resident / read ahead by the heads / by the lookahead / missed; lookahead recall)",
        "",
        "| arm | layer | resident | heads | lookahead | missed | recall |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm, data in arms.items():
        for layer, row in data.get("routed_by_layer", {}).items():
            routed = row["resident"] + row["heads"] + row["lookahead"] + row["missed"]
            if not routed:
                continue
            shares = [row[k] / routed for k in ("resident", "heads", "lookahead", "missed")]
            recall = row["guessed_right"] / row["guessed_of"] if row["guessed_of"] else None
            lines.append(
                f"| {arm} | {layer} | "
                + " | ".join(f"{s:.0%}" for s in shares)
                + f" | {'-' if recall is None else f'{recall:.2f}'} |"
            )
    return lines
