"""The metrics snapshot the engine thread publishes and the panels read.

The engine thread builds a new, frozen `LiveMetrics` after every token and swaps it into
`EngineService.live` (a plain attribute assignment, atomic in Python). The UI reads that attribute
from one timer a few times a second, so the decode speed never sets the UI's refresh rate and neither
side ever waits for the other. The figures the panels show are properties computed from the recent
steps here, so they can be tested without a UI.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from engine import HeatPicture, MemorySnapshot, StepMetrics, routed_by_layer

# Steps kept for the sparklines, and the most recent of those averaged into the headline figures
# (long enough to smooth single slow steps, short enough to show a K switch within a second).
HISTORY_STEPS = 60
FIGURE_STEPS = 16
# The expert heat picture is built at most this often (the chat screen's panels refresh at 6 Hz:
# screens/chat.py PANEL_REFRESH_HZ), and after every reply's last step.
HEAT_EVERY_S = 1 / 6
# Where a routed expert came from (`engine.experts.counters.LayerRouted`'s fields).
ROUTED_SOURCES = ("resident", "heads", "lookahead", "missed")


@dataclass(frozen=True)
class LiveMetrics:
    k: int = 0
    mode: str = ""
    # Prompt plus reply tokens of the latest request: what the KV cache holds.
    context_tokens: int = 0
    # The most MLX memory the engine has held at once since it loaded.
    peak_memory_bytes: int = 0
    # The most memory the process has held resident at once, as the kernel counts it (its
    # high-water mark, the model's load included): not a maximum of the steps' RSS samples.
    peak_rss_bytes: int = 0
    # The latest forward (prefill or decode): the memory figures come from here.
    last_step: StepMetrics | None = None
    # The engine's memory as it loaded (`MemorySnapshot`: the same memory fields as a step's),
    # shown until the first forward, so the panel never reads 0 B with a model in memory.
    loaded_memory: MemorySnapshot | None = None
    # The latest reply's prefill (every prompt chunk up to the first token): its reads are shown
    # apart from the decode figures, which a whole-layer prefill read would swamp.
    last_prefill: StepMetrics | None = None
    # Decode steps only, newest last, at most HISTORY_STEPS, across replies.
    recent_steps: tuple[StepMetrics, ...] = ()
    # Wall time between consecutive decode tokens as the app saw them (forward, sampling and
    # streaming included), matching `recent_steps`.
    recent_token_ms: tuple[float, ...] = ()
    # What each MoE layer's experts did in the latest step the picture was taken of, and which
    # are in the expert cache (None: no reply yet, resident mode, or a service not asked for it).
    expert_heat: HeatPicture | None = None

    @property
    def tok_per_s_history(self) -> list[float]:
        return [1e3 / ms for ms in self.recent_token_ms if ms > 0]

    @property
    def tok_per_s(self) -> float:
        window = self.recent_token_ms[-FIGURE_STEPS:]
        return len(window) * 1e3 / sum(window) if window and sum(window) > 0 else 0.0

    @property
    def blocked_ms_history(self) -> list[float]:
        return [s.blocked_ms for s in self.recent_steps]

    @property
    def blocked_ms(self) -> float:
        return self._mean("blocked_ms")

    @property
    def loads_per_step(self) -> float:
        return self._mean("loads")

    @property
    def mib_per_step(self) -> float:
        return self._mean("mib_read")

    @property
    def host_syncs_per_step(self) -> float:
        """Times a decode step waited on the device for a value (each a GPU queue drain on
        Metal), mean of the recent steps."""
        return self._mean("host_syncs")

    @property
    def cold_fraction(self) -> float:
        """Cold bytes over bytes read in the recent steps (weighted by bytes, unlike a mean of
        per-step fractions, so steps that read little do not swing it)."""
        window = self.recent_steps[-FIGURE_STEPS:]
        read = sum(s.mib_read for s in window)
        return sum(s.mib_read * s.cold_fraction for s in window) / read if read else 0.0

    @property
    def routed_shares(self) -> dict[str, float]:
        """Where the recent decode steps' routed experts came from, as shares: resident, read
        ahead by the heads, read ahead by the lookahead, missed (empty before any step)."""
        rows = self._routed_by_layer().values()
        totals = {source: sum(row[source] for row in rows) for source in ROUTED_SOURCES}
        routed = sum(totals.values())
        return {s: n / routed for s, n in totals.items()} if routed else {}

    @property
    def lookahead_recall_by_layer(self) -> dict[int, float]:
        """The lookahead's recall of each MoE layer's routing over the recent decode steps (the
        layers it guessed)."""
        rows = self._routed_by_layer().items()
        return {
            n: row["lookahead_recall"] for n, row in rows if row["lookahead_recall"] is not None
        }

    def _routed_by_layer(self) -> dict[int, dict]:
        return routed_by_layer(list(self.recent_steps[-FIGURE_STEPS:]))

    def _mean(self, name: str) -> float:
        window = self.recent_steps[-FIGURE_STEPS:]
        return statistics.fmean(getattr(s, name) for s in window) if window else 0.0
