"""Phase 1's plan from a time budget: how much text fits, measured before the long work.

`edge0 train heads MODEL --time 2h` spends its budget on three phases: the model writing its own
text (without `--text`), the collection of the routers' traces over that text, and training the
heads. Training's length is its steps, whatever the text; the text's is what the budget sets.
Before any of it, one short pass of each is timed on this machine (`measure_rates`): a few tokens
of a reply, one window's teacher-forced forward, one training step. The plan (`HeadsPlan`) is
what those rates give, printed before the work, for the user to accept or change.

Each rate comes from a single short pass: a reply's first tokens, and a window whose experts are
all read cold, cost more per token than the long run does (its reads ahead, its layer-major
passes), so the plan errs long; it also aims a little below the budget (`AIM`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from ..config import GenerationConfig
from ..errors import Edge0Error
from ..routing.prerouter import head_forward
from .run import Log, duration_text

# The share of the budget the plan fills: the rest is for what it does not time (loading, the
# held-out measures, saving).
AIM = 0.9
# Tokens of the probe reply that time the writing (its prompt's prefill is timed apart).
PROBE_REPLY_TOKENS = 12
# Where a work folder keeps the text lengths its plans chose (`KeptPlans`).
PLAN_FILE = "heads-plan.json"
# The least text a plan gives phase 1, in windows: fewer leave no held-out part worth a recall.
MIN_TEXT_WINDOWS = 10


@dataclass(frozen=True)
class Rates:
    """What one unit of each phase takes here, measured: a token of the model's own text (None:
    the text is given), a token of collection, a training step."""

    write_s: float | None
    collect_s: float
    step_s: float


@dataclass(frozen=True)
class HeadsPlan:
    """Phase 1's work: `tokens` of text (written by the model where `writes`), collected, and
    `steps` training steps; with the budget it was chosen for (None: no budget) and what chose
    the text's length."""

    tokens: int
    steps: int
    rates: Rates
    budget_s: float | None
    chosen_by: str

    @property
    def writes(self) -> bool:
        return self.rates.write_s is not None

    def phases(self) -> list[tuple[str, str, float]]:
        """(phase, how much, estimated seconds), in the order they run."""
        rows = []
        if self.writes:
            rows.append(("write", f"{self.tokens:,} tokens of its own text", self._write_s))
        rows.append(("collect", f"{self.tokens:,} tokens of traces", self._collect_s))
        rows.append(("train", f"{self.steps:,} steps", self.steps * self.rates.step_s))
        return rows

    @property
    def total_s(self) -> float:
        return sum(seconds for _, _, seconds in self.phases())

    @property
    def _write_s(self) -> float:
        return self.tokens * (self.rates.write_s or 0.0)

    @property
    def _collect_s(self) -> float:
        return self.tokens * self.rates.collect_s

    def lines(self) -> list[str]:
        """The plan as printed before the work."""
        budget = f" for a budget of {duration_text(self.budget_s)}" if self.budget_s else ""
        head = (
            f"plan: {self.tokens:,} tokens of text ({self.chosen_by}), about "
            f"{duration_text(self.total_s)} in all{budget}"
        )
        rows = [
            f"  {name:<8} {what:<36} about {duration_text(s)}" for name, what, s in self.phases()
        ]
        if self.budget_s is not None and self.total_s > self.budget_s:
            rows.append(
                f"  over the budget: {self.steps:,} training steps and the least text "
                f"({self.tokens:,} tokens) take longer; lower --steps or raise --time"
            )
        return [head, *rows]


def plan_heads(
    rates: Rates,
    steps: int,
    budget_s: float | None,
    most_tokens: int,
    window: int,
    fixed_tokens: int | None = None,
    fixed_by: str = "",
    kept_tokens: int | None = None,
) -> HeadsPlan:
    """The plan: `fixed_tokens` where the user set the text's length (`fixed_by` says how), or
    `kept_tokens` where a run of the same terms planned before (`KeptPlans`); else as many whole
    windows as the budget leaves after training, at most `most_tokens` (--max-tokens, or the
    text's length), at least `MIN_TEXT_WINDOWS`."""
    if fixed_tokens is not None:
        return HeadsPlan(fixed_tokens, steps, rates, budget_s, fixed_by)
    if kept_tokens is not None:
        return HeadsPlan(
            kept_tokens, steps, rates, budget_s, "as the first run of these terms planned"
        )
    if budget_s is None:
        return HeadsPlan(most_tokens, steps, rates, None, "all of --max-tokens")
    per_token = (rates.write_s or 0.0) + rates.collect_s
    left = AIM * budget_s - steps * rates.step_s
    fits = int(left / per_token) // window * window if left > 0 else 0
    least = min(most_tokens, MIN_TEXT_WINDOWS * window)
    if fits >= most_tokens:
        return HeadsPlan(most_tokens, steps, rates, budget_s, "all of --max-tokens fits the budget")
    return HeadsPlan(max(fits, least), steps, rates, budget_s, "what the budget holds")


Confirm = Callable[[HeadsPlan], "bool | float"]


class PlanDeclined(Exception):
    """The user stopped at the plan: nothing was written."""


@dataclass
class PlanTerms:
    """How a plan is agreed: the time budget (seconds; None: no budget), who confirms it (None:
    accepted as printed) and where it is printed."""

    budget_s: float | None
    confirm: Confirm | None
    log: Log

    def agree(self, make: Callable[[float | None], HeadsPlan]) -> HeadsPlan:
        """The plan `make(budget)` gives, printed, once confirmed: `confirm(plan)` accepts it
        (True), stops (False: `PlanDeclined`) or names another budget in seconds (planned
        again)."""
        while True:
            plan = make(self.budget_s)
            for line in plan.lines():
                self.log(line)
            answer = True if self.confirm is None else self.confirm(plan)
            if answer is True:
                return plan
            if answer is False:
                raise PlanDeclined("stopped at the plan; nothing was written")
            self.budget_s = float(answer)


class KeptPlans:
    """The text lengths earlier plans chose, by their terms, in a work folder's `PLAN_FILE`. A
    rerun of the same command keeps its first plan's length: its rates, measured again, differ a
    little, and another length is another text and other traces, which would start over instead
    of resuming."""

    def __init__(self, work: Path) -> None:
        self.path = work / PLAN_FILE

    def tokens(self, terms: dict) -> int | None:
        tokens = self._read().get(_terms_key(terms))
        return tokens if type(tokens) is int and tokens > 0 else None

    def keep(self, terms: dict, tokens: int) -> None:
        kept = {**self._read(), _terms_key(terms): tokens}
        temporary = self.path.with_suffix(".tmp")
        try:
            temporary.write_text(json.dumps(kept, indent=1) + "\n")
            temporary.replace(self.path)
        except OSError as e:
            raise Edge0Error(f"{self.path}: cannot keep the plan ({e.strerror or e})") from None

    def _read(self) -> dict:
        """The kept lengths; none where the file is missing or not ours (it is only a memo)."""
        try:
            kept = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return kept if isinstance(kept, dict) else {}


def _terms_key(terms: dict) -> str:
    return json.dumps(terms, sort_keys=True)


# -- measuring ----------------------------------------------------------------------------------------


def measure_rates(
    write: Callable[[], float] | None, collect: Callable[[], float], step: Callable[[], float]
) -> Rates:
    """Each phase's rate from its probe (a function timing one short pass of it)."""
    return Rates(write() if write is not None else None, collect(), step())


def writing_rate(engine, prompt: Sequence[int]) -> float:
    """Seconds a token of the model's own text takes: a probe reply to `prompt`, its decode steps
    timed (the prompt's prefill is a small share of a reply). The probe is not kept."""
    gen = GenerationConfig(max_tokens=PROBE_REPLY_TOKENS, temperature=0.0, ignore_eos=True)
    steps = engine.generate(list(prompt), gen).steps
    decode = [s.wall_ms for s in steps if s.phase == "decode"] or [s.wall_ms for s in steps]
    # The median: a reply's first steps also build kernels and read experts for the first time.
    return float(np.median(decode)) / 1e3


def collection_rate(model: nn.Module, store, window: np.ndarray) -> float:
    """Seconds a token of collection takes: one teacher-forced forward of `model` (its experts
    through `store`, None: resident) over `window` [T]."""
    started = time.perf_counter()
    if store is not None:
        store.begin_step()
    try:
        mx.eval(model(mx.array(window)[None]))
    finally:
        if store is not None:
            store.end_step()
    return (time.perf_counter() - started) / len(window)


def training_step_rate(heads: int, hidden: int, experts: int, inner: int, batch: int) -> float:
    """Seconds a training step of `heads` stacked heads takes on a batch of `batch` positions:
    the heads' shapes on random data, the second of two steps timed (the first builds kernels)."""
    width = hidden + 2 * experts
    stack = _Heads(
        mx.random.normal((heads, inner, width)),
        mx.zeros((heads, experts, inner)),
        mx.random.normal((heads, experts, width)),
    )
    z, y = mx.random.normal((heads, batch, width)), mx.random.normal((heads, batch, experts))

    def loss_fn(z, y):
        return -(mx.softmax(y, axis=-1) * nn.log_softmax(stack(z), axis=-1)).sum(-1).mean()

    loss_and_grad = nn.value_and_grad(stack, loss_fn)
    optimizer = optim.AdamW(learning_rate=1e-3)
    took = 0.0
    for _ in range(2):
        started = time.perf_counter()
        loss, grads = loss_and_grad(z, y)
        optimizer.update(stack, grads)
        mx.eval(stack.parameters(), optimizer.state, loss)
        took = time.perf_counter() - started
    return took


class _Heads(nn.Module):
    """Stacked heads of phase 1's shapes (as `heads.HeadStack` trains them)."""

    def __init__(self, fc1: mx.array, fc2: mx.array, linear_init: mx.array) -> None:
        super().__init__()
        self.fc1, self.fc2, self.linear_init = fc1, fc2, linear_init

    def __call__(self, z: mx.array) -> mx.array:
        return head_forward(self.fc1, self.fc2, self.linear_init, z)
