"""`edge0 chat --hosts`: the app on rank 0 (headless, driven by Pilot in tests/ranks_worker.py),
another rank following its replies on this machine, through the real command line and launcher:
the reply is one process's, token for token, at the K the app switched to; the follower writes
to its log, never to the terminal; reloads are refused; quitting the app ends every rank."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

from ranks_worker import CHAT_SIZE, GREEDY, wait_until

from edge0_tui.cli import build_parser, main
from edge0_tui.commands import chat
from engine import Engine, EngineConfig, parse_size, run_ranks_here

TESTS = Path(__file__).resolve().parent
DEMO = TESTS.parent / "assets" / "demo"
K = 4  # one of the demo's K profiles (not its native K), switched to before the reply
RANKS_TIMEOUT_S = 300  # a hang guard only: the ranks end long before it


def _chat_args(data_dir: Path) -> list[str]:
    return ["chat", str(DEMO), "--data-dir", str(data_dir), "--expert-cache", "4M"]


def _one_process_tokens(prompt: list[int]) -> list[int]:
    config = EngineConfig(mode="on-demand", k=K, expert_cache_bytes=parse_size("4M"))
    with Engine(DEMO, config) as engine:
        return engine.generate(prompt, GREEDY).tokens


def test_chat_as_two_ranks_replies_as_one_process_and_quitting_ends_every_rank(tmp_path):
    data, result = tmp_path / "data", tmp_path / "result.json"
    command = [sys.executable, str(TESTS / "ranks_worker.py"), "chat", str(result), str(K)]
    with open(tmp_path / "terminal", "w+") as terminal:
        status = run_ranks_here(
            2,
            [*command, *_chat_args(data), "--hosts", "2"],
            stdout=terminal,
            stderr=terminal,
            timeout_s=RANKS_TIMEOUT_S,
        )
        terminal.seek(0)
        said = terminal.read()
    assert status == 0, said
    ranked = json.loads(result.read_text())
    # The reply, at the K the app switched to, is one process's.
    [reply] = ranked["replies"]
    assert reply["tokens"] and reply["tokens"] == _one_process_tokens(reply["prompt"])
    # The header says the app runs as ranks, with each rank's share of the last reply.
    assert "2 ranks" in ranked["title"] and "rank 1: " in ranked["title"], ranked["title"]
    # Resident mode and the model picker are refused in one line each; the mode that runs
    # stays, shown and kept for next time.
    refused = [n for n in ranked["notices"] if n.startswith("running as ranks (--hosts)")]
    assert len(refused) == 2 and all("\n" not in n for n in refused), ranked["notices"]
    assert ranked["mode"] == "on-demand" and ranked["kept_mode"] != "resident"  # refused: not kept
    # Both ranks ended on their own after Ctrl+Q (one the launcher stopped writes no status).
    assert (tmp_path / "result.json.rank0").read_text() == "0"
    assert (tmp_path / "result.json.rank1").read_text() == "0"
    # Rank 1 wrote its line of the reply to its log, and nothing on the terminal.
    log = (data / "logs" / "chat-rank-1.log").read_text()
    assert log.count("edge0 rank 1: [") == 1, log
    assert "edge0 rank 1" not in said


async def test_sigterm_quits_the_app_as_ctrl_q_does_and_says_why(tmp_path, capsys):
    """With --hosts, a rank that ends makes the launcher stop rank 0 with SIGTERM: the app quits
    as Ctrl+Q does (its engine closed, which tells the other ranks; the terminal handed back),
    and says why in one line."""
    app = chat.build_app(build_parser().parse_args(_chat_args(tmp_path)))
    with chat._quits_on_sigterm(app, "edge0: stopped: a rank ended"):
        async with app.run_test(size=CHAT_SIZE) as pilot:
            await wait_until(pilot, lambda: app.chat_screen.controller.ready, "the model")
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # the launcher's signal
            await wait_until(pilot, lambda: app.return_code is not None, "the app to quit")
    assert app.return_code == 1
    assert app.session.closed.wait(30)
    assert capsys.readouterr().err == "edge0: stopped: a rank ended\n"


def test_chat_refuses_ranks_on_other_machines_in_one_line(capsys):
    """mlx.launch, which reaches other machines, pipes every rank's terminal: the app would have
    none. Refused before any rank starts."""
    assert main(["chat", "demo", "--hosts", "10.0.0.1,10.0.0.2"]) == 2
    err = capsys.readouterr().err
    assert "chat runs its ranks on this machine only" in err and err.count("\n") == 1, err
