"""`train heads --time` (issue 48 item 3): the text's length comes from a time budget and the
rates measured first; the plan is printed before any work, to accept, stop or change; every
refusal and the shadowing note come before any text is written."""

from __future__ import annotations

import argparse
import shutil

import pytest
from adapters import write_random_profile

import engine.train.heads as heads_module
from edge0_tui.cli import main
from edge0_tui.commands.train import DEFAULT_TIME, duration, plan_confirmation
from engine.config import EngineConfig
from engine.train.budget import AIM, MIN_TEXT_WINDOWS, PlanDeclined, Rates, plan_heads
from engine.train.heads import TrainHeadsConfig, train_heads
from engine.train.self_text import SelfTextConfig

WINDOW = 64


class Written(Exception):
    """Raised in place of writing the text: the test has seen what would be written."""


@pytest.fixture
def fake_rates(monkeypatch):
    """Rates set by the test instead of timed (`heads._rates`), and the configs the writer got
    (it stops the run before any text is written)."""
    rates = {"now": Rates(write_s=0.1, collect_s=0.0, step_s=0.0)}
    asked = []
    monkeypatch.setattr(heads_module, "_rates", lambda *args: rates["now"], raising=False)

    def writer(engine, work, config, held_out_tokens, log, bar):
        asked.append(config)
        raise Written

    monkeypatch.setattr(heads_module, "write_self_text", writer)
    return rates, asked


def test_the_budget_chooses_the_text_by_the_measured_rate():
    slow, fast = Rates(0.2, 0.05, 1.0), Rates(0.1, 0.025, 1.0)
    plans = [plan_heads(r, 400, 7200, 60_000, WINDOW) for r in (slow, fast)]
    for plan in plans:
        assert plan.tokens % WINDOW == 0 and plan.total_s <= AIM * 7200 + 1
    assert plans[1].tokens == pytest.approx(2 * plans[0].tokens, abs=2 * WINDOW)
    # Capped by --max-tokens; at least a few windows however slow; an explicit length is kept.
    assert plan_heads(fast, 400, 7200, 5_000, WINDOW).tokens == 5_000
    crawl = plan_heads(Rates(100.0, 1.0, 1.0), 400, 7200, 60_000, WINDOW)
    assert crawl.tokens == MIN_TEXT_WINDOWS * WINDOW and "over the budget" in crawl.lines()[-1]
    fixed = plan_heads(fast, 400, 7200, 60_000, WINDOW, 1_100, "--self-text-tokens")
    assert fixed.tokens == 1_100 and "(--self-text-tokens)" in fixed.lines()[0]
    # The plan names each phase with its estimate.
    assert [line.split()[0] for line in plans[0].lines()[1:]] == ["write", "collect", "train"]


def test_the_plan_comes_before_the_work_and_its_tokens_are_written(
    checkpoint_dir, tmp_path, fake_rates
):
    rates, asked = fake_rates
    config = TrainHeadsConfig(k=2, max_tokens=60_000, steps=1, window=WINDOW)
    shown = []

    def run(write_s: float, data: str, **given) -> list[str]:
        rates["now"] = Rates(write_s=write_s, collect_s=0.0, step_s=0.0)
        lines = []
        with pytest.raises(Written):
            train_heads(
                checkpoint_dir("qwen3_moe"), None, config, progress=lines.append,
                engine_config=EngineConfig(data_dir=tmp_path / data), time_budget_s=100.0,
                confirm=lambda plan: shown.append(plan) or True, **given,
            )  # fmt: skip
        return lines

    lines = run(0.1, "a")
    assert lines[0].startswith("plan: ") and "budget of 100 s" in lines[0]
    assert asked[-1].tokens == shown[-1].tokens
    # Twice as fast, in another folder: twice the text in the same budget.
    run(0.05, "b")
    assert shown[1].tokens == pytest.approx(2 * shown[0].tokens, abs=WINDOW)
    assert asked[-1].tokens == shown[-1].tokens
    # The first folder's rerun keeps its first plan's length (its text resumes), whatever the
    # rates measure this time.
    lines = run(0.05, "a")
    assert asked[-1].tokens == shown[0].tokens and "as the first run" in lines[0]
    # --self-text-tokens overrides the budget's choice.
    run(0.1, "a", self_text=SelfTextConfig(tokens=704))
    assert asked[-1].tokens == 704


def test_a_plan_changed_or_declined_writes_nothing(checkpoint_dir, tmp_path, fake_rates):
    _, asked = fake_rates
    answers = iter([3600.0, False])  # another budget: planned again; then stopped
    shown = []

    def confirm(plan):
        shown.append(plan)
        return next(answers)

    config = TrainHeadsConfig(k=2, max_tokens=60_000, steps=1, window=WINDOW)
    with pytest.raises(PlanDeclined):
        train_heads(
            checkpoint_dir("qwen3_moe"), None, config, progress=lambda line: None,
            engine_config=EngineConfig(data_dir=tmp_path), time_budget_s=100.0, confirm=confirm,
        )  # fmt: skip
    assert [p.budget_s for p in shown] == [100.0, 3600.0] and shown[1].tokens > shown[0].tokens
    assert asked == []


def test_refusals_and_the_shadowing_note_come_before_any_text_is_written(
    checkpoint_dir, tmp_path, fake_rates, capsys
):
    _, asked = fake_rates
    model = tmp_path / "model"
    shutil.copytree(checkpoint_dir("qwen3_moe"), model)
    args = ["train", "heads", str(model), "--self-text-tokens", "320", "--max-tokens", "320"]
    args += ["--window", str(WINDOW), "--steps", "1", "--adapters", str(tmp_path / "data")]
    # K above the model's experts: refused once the model is read, before it writes a token.
    assert main([*args, "--k", "99"]) == 2
    assert "K=99 must be between 1" in capsys.readouterr().err and asked == []
    # Heads for K=2 in the model's folder shadow those about to go to --adapters: said first.
    write_random_profile(model, 2)
    with pytest.raises(Written):
        main([*args, "--k", "2"])
    printed = capsys.readouterr().out.splitlines()
    assert asked and any(line.startswith("note: the heads will") for line in printed)
    note = next(i for i, line in enumerate(printed) if line.startswith("note: the heads will"))
    plan = next(i for i, line in enumerate(printed) if line.startswith("plan: "))
    assert note < plan
    assert "not a terminal: going ahead" in printed[-1]  # (a test's stdout is no terminal)


def test_the_plan_is_asked_on_a_terminal_and_taken_elsewhere(capsys):
    def asked(*answers):
        replies = iter(answers)

        def ask(question):
            reply = next(replies)
            if reply is EOFError:
                raise EOFError
            return reply

        return plan_confirmation(False, True, ask)(None)

    assert asked("") is True and asked("y") is True and asked("n") is False
    assert asked("soon", "1h30m") == 5400 and "not a duration" in capsys.readouterr().out
    assert asked(EOFError) is False  # stdin closed: nothing is started
    assert plan_confirmation(True, True, lambda q: pytest.fail("asked"))(None) is True
    assert plan_confirmation(False, False, lambda q: pytest.fail("asked"))(None) is True
    assert "not a terminal: going ahead" in capsys.readouterr().out


def test_the_time_budget_is_read_and_its_default_stated(capsys):
    assert DEFAULT_TIME == 7200 and duration("1h30m") == 5400 and duration("45s") == 45
    for bad in ("2 hours", "90", "0m"):
        with pytest.raises(argparse.ArgumentTypeError):
            duration(bad)
    with pytest.raises(SystemExit):
        main(["train", "heads", "--help"])
    assert "default 2h" in " ".join(capsys.readouterr().out.split())
