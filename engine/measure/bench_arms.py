"""What a bench arm's name means: a mode, `compute-only[:MODE]`, `MODE+lookup` (drafts) or `MODE@N`
(ranks), each parsed here, where the bench (`bench.py`) and its command read them."""

from __future__ import annotations

from ..errors import Edge0Error
from ..runtime.ranks import MAX_RANKS

ARMS = ("resident", "on-demand", "prerouter", "prefetch", "compute-only")
# The compute-only arm streams like the others but has every expert resident before the replay (no
# RAM or read limit, no eviction: it reads nothing). Its step is the compute a streamed step cannot
# go below, one term of the overlap limit. `compute-only:MODE` runs that mode so (what the mode
# costs a step when nothing is read: the heads' work, the lookahead's guesses); plain
# `compute-only` runs prerouter where the bench has it, else on-demand.
COMPUTE_ONLY = "compute-only"
STREAMED_MODES = ("on-demand", "prefetch", "prerouter")
# `MODE+lookup`: that mode with prompt-lookup drafts verified in one forward each.
DRAFTED = "+lookup"
DRAFTED_MODES = ("resident", "on-demand", "prefetch")


def check_arms(arms: list[str]) -> None:
    """Refuse an empty list of arms or one whose name means nothing, naming every kind."""
    unknown = [
        a
        for a in arms
        if a not in ARMS
        and compute_only_mode(a) is None
        and drafted_mode(a) is None
        and ranked_arm(a) is None
    ]
    if unknown or not arms:
        raise Edge0Error(
            f"unknown arm(s) {unknown}: choose from {', '.join(ARMS)}, compute-only:MODE "
            f"(MODE one of {', '.join(STREAMED_MODES)}), MODE{DRAFTED} (MODE one of "
            f"{', '.join(DRAFTED_MODES)}), or MODE@N (N ranks on this machine)"
        )


def with_ranked_twins(arms: list[str], ranks: int | None) -> list[str]:
    """`bench --hosts N`: each streamed arm followed by its N-rank twin (`MODE@N`)."""
    if ranks is None:
        return arms
    return [
        x for arm in arms for x in ([arm, f"{arm}@{ranks}"] if arm in STREAMED_MODES else [arm])
    ]


def ranked_arm(arm: str) -> tuple[str, int] | None:
    """`MODE@N`: a streamed mode run as N ranks on this machine, each with its share of the
    experts (engine/experts/share.py). Returns (MODE, N); None for any other arm."""
    mode, _, ranks = arm.partition("@")
    if mode in STREAMED_MODES and ranks.isdigit() and 2 <= int(ranks) <= MAX_RANKS:
        return mode, int(ranks)
    return None


def drafted_mode(arm: str) -> str | None:
    """The mode a drafting arm (`MODE+lookup`) runs; None: `arm` drafts nothing."""
    mode = arm.removesuffix(DRAFTED)
    return mode if mode != arm and mode in DRAFTED_MODES else None


def compute_only_mode(arm: str, arms: list[str] = ()) -> str | None:
    """The mode a compute-only arm runs (None: `arm` is no compute-only arm)."""
    if arm == COMPUTE_ONLY:
        return "prerouter" if "prerouter" in arms else "on-demand"
    name, _, mode = arm.partition(":")
    return mode if name == COMPUTE_ONLY and mode in STREAMED_MODES else None
