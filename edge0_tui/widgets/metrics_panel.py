"""The live panels: decode speed, time blocked on expert loads, cold pages, loads, memory.

The panel only displays: the chat screen's timer calls `show` a few times a second with the latest
snapshot. Sparklines scale to their data's own min..max (no zero baseline), so the range is printed
next to each, or a flat trace would look like noise.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Digits, Label, ProgressBar, Sparkline

from ..live_metrics import LiveMetrics
from .memory_bar import MemoryBar, MemoryBreakdown

# Above this share of a token's time spent waiting for expert bytes, the blocked figure turns to a
# warning colour: the step is then more I/O than compute.
BLOCKED_WARN_SHARE = 0.5


class MetricsPanel(VerticalScroll):
    def compose(self) -> ComposeResult:
        yield Label("decode tok/s", classes="panel-title")
        yield Digits("0.0", id="tok-per-s")
        yield Sparkline([], id="tok-per-s-history")
        yield Label("", id="tok-per-s-range", classes="panel-note")
        yield Label("blocked on expert loads", classes="panel-title")
        yield Label("", id="blocked-ms", classes="panel-value")
        yield Sparkline([], id="blocked-ms-history")
        yield Label("", id="blocked-ms-range", classes="panel-note")
        yield Label("cold pages, decode (of bytes read)", classes="panel-title")
        yield ProgressBar(total=1.0, show_eta=False, id="cold-fraction")
        yield Label("", id="loads", classes="panel-value")
        yield Label("", id="routed-from", classes="panel-note")
        yield Label("", id="prefill", classes="panel-note")
        yield Label("edge0's memory", classes="panel-title")
        yield MemoryBar(id="memory")
        # What the engine planned to hold, as `generate` and `serve` print it at start.
        yield Label("", id="memory-plan", classes="panel-note", markup=False)

    def show(self, metrics: LiveMetrics, memory: MemoryBreakdown) -> None:
        speed = metrics.tok_per_s_history
        self.query_one("#tok-per-s", Digits).update(f"{metrics.tok_per_s:.1f}")
        self.query_one("#tok-per-s-history", Sparkline).data = speed
        self.query_one("#tok-per-s-range", Label).update(_range(speed, "tok/s"))

        blocked = metrics.blocked_ms_history
        token_ms = 1e3 / metrics.tok_per_s if metrics.tok_per_s else 0.0
        share = metrics.blocked_ms / token_ms if token_ms else 0.0
        blocked_label = self.query_one("#blocked-ms", Label)
        blocked_label.update(
            f"{metrics.blocked_ms:.1f} ms/step" + (f", {share:.0%} of each token" if share else "")
        )
        blocked_label.set_class(share > BLOCKED_WARN_SHARE, "-warn")
        self.query_one("#blocked-ms-history", Sparkline).data = blocked
        self.query_one("#blocked-ms-range", Label).update(_range(blocked, "ms"))

        self.query_one("#cold-fraction", ProgressBar).update(progress=metrics.cold_fraction)
        self.query_one("#loads", Label).update(
            f"{metrics.loads_per_step:.1f} loads/step   {metrics.mib_per_step:.2f} MiB/step"
        )
        self.query_one("#routed-from", Label).update(routed_line(metrics))
        self.query_one("#prefill", Label).update(prefill_line(metrics))
        self.query_one("#memory", MemoryBar).show(memory)

    def show_plan(self, line: str) -> None:
        """The engine's memory plan (`MemoryPlan.line()`); "" before a model is loaded."""
        label = self.query_one("#memory-plan", Label)
        text = plan_lines(line)
        if str(label.content) != text:
            label.update(text)


def plan_lines(line: str) -> str:
    """`MemoryPlan.line()` (what generate and serve print) one term a line: wrapped at the
    panel's width, a term's figure and unit came apart. The line's own text, only reflowed."""
    head, sep, terms = line.rpartition(": ")
    if not sep or ": " not in head:  # not the plan line's shape: as it is
        return line
    return head + ":\n" + "\n".join(f"  {term}" for term in terms.split(", "))


def routed_line(metrics: LiveMetrics) -> str:
    """Where the routed experts came from, and the lookahead's recall layer by layer."""
    shares = metrics.routed_shares
    if not shares:
        return ""
    read_ahead = shares["heads"] + shares["lookahead"]
    line = f"resident {shares['resident']:.0%}, read ahead {read_ahead:.0%}, missed {shares['missed']:.0%}"
    recall = metrics.lookahead_recall_by_layer
    if recall:
        line += "\nlookahead recall by layer: " + " ".join(f"{r:.2f}" for r in recall.values())
    return line


def prefill_line(metrics: LiveMetrics) -> str:
    """The last prompt's reads, apart from decode's: a prefill reads whole layers, cold or not."""
    step = metrics.last_prefill
    if step is None:
        return "prefill: no prompt yet"
    # Two lines, not one wrapped where the panel's width falls (a figure without its unit).
    return (
        f"prefill, {step.tokens} tokens: {step.mib_read:.1f} MiB read\n"
        f"  {step.cold_fraction:.0%} cold, blocked {step.blocked_ms:.0f} ms"
    )


def _range(values: list[float], unit: str) -> str:
    return f"min {min(values):.1f}  max {max(values):.1f} {unit}" if values else ""
