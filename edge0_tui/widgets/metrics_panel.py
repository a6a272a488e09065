"""The decode panel: decode speed, time blocked on expert loads, cold pages and loads.

The panel only displays: the chat screen's timer calls `show` a few times a second with the latest
snapshot. Sparklines scale to their data's own min..max (no zero baseline), so the range is printed
next to each, or a flat trace would look like noise. The speed has two forms: big digits where the
terminal is tall enough, one line otherwise; the app's stylesheet shows one of the two.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Digits, Label, ProgressBar, Sparkline

from ..live_metrics import LiveMetrics

# Above this share of a token's time spent waiting for expert bytes, the blocked figure turns to a
# warning colour: the step is then more I/O than compute.
BLOCKED_WARN_SHARE = 0.5


class MetricsPanel(Vertical):
    def compose(self) -> ComposeResult:
        yield Label("decode tok/s", classes="panel-title")
        yield Digits("0.0", id="tok-per-s")
        yield Label("", id="tok-per-s-line", classes="panel-value")
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

    def show(self, metrics: LiveMetrics) -> None:
        speed = metrics.tok_per_s_history
        self.query_one("#tok-per-s", Digits).update(f"{metrics.tok_per_s:.1f}")
        self.query_one("#tok-per-s-line", Label).update(
            f"{metrics.tok_per_s:.1f} tok/s" + (f"   {_range(speed)}" if speed else "")
        )
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


def routed_line(metrics: LiveMetrics) -> str:
    """Where the routed experts came from, and the lookahead's recall: its mean over the layers
    and its lowest layer's (a line a layer would not fit a model of 60 layers)."""
    shares = metrics.routed_shares
    if not shares:
        return ""
    read_ahead = shares["heads"] + shares["lookahead"]
    line = f"resident {shares['resident']:.0%}, read ahead {read_ahead:.0%}, missed {shares['missed']:.0%}"
    recall = list(metrics.lookahead_recall_by_layer.values())
    if recall:
        line += (
            f"\nlookahead recall {sum(recall) / len(recall):.2f}, lowest layer {min(recall):.2f}"
        )
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


def _range(values: list[float], unit: str = "") -> str:
    """ "min A  max B UNIT" (no unit: the line it follows has said it); "" without values."""
    if not values:
        return ""
    return f"min {min(values):.1f}  max {max(values):.1f}" + (f" {unit}" if unit else "")
