"""One rank of tests/test_expert_parallel.py: for each case of the JSON file `sys.argv[1]`, a
greedy reply with this rank's share of the experts; rank 0 writes the tokens and every rank's
figures to `sys.argv[2]`.

`ranks_worker.py chat RESULT K EDGE0_ARGS...` is one rank of `edge0 EDGE0_ARGS` (chat --hosts,
tests/test_chat_ranks.py) through the real command line: rank 0's app runs headless, driven by
`chat_scenario`, and writes what it saw to RESULT; every rank then writes its exit status to
RESULT.rankN, which a rank killed or stopped by a signal never does.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's engine

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from engine import Engine, EngineConfig, GenerationConfig  # noqa: E402


def greedy_reply(engine: Engine, prompt: list[int], tokens: int):
    """A greedy reply, and a digest of every token's logits (to compare them bit for bit)."""
    digest = hashlib.sha256()
    reply = engine.stream(prompt, GenerationConfig(tokens, 0.0, ignore_eos=True), keep_logits=True)
    for token in reply:
        digest.update(np.array(token.logits.astype(mx.float32)).tobytes())
    return reply.result, digest.hexdigest()


def main() -> None:
    cases = json.loads(open(sys.argv[1]).read())
    replies = []
    for case in cases:
        config = EngineConfig(expert_parallel=True, **case["config"])
        with Engine(case["model"], config) as engine:
            rank = engine.share.rank
            if rank != 0:
                engine.follow()  # every reply of rank 0's, step by step
                continue
            result, logits = greedy_reply(engine, case["prompt"], case["tokens"])
            replies.append(
                {"tokens": result.tokens, "logits": logits, "ranks": result.summary["ranks"]}
            )
    if rank == 0:
        with open(sys.argv[2], "w") as f:
            json.dump(replies, f)


CHAT_SIZE = (100, 32)
GREEDY = GenerationConfig(max_tokens=8, temperature=0.0)
MESSAGE = "Tell me about the sea."


async def wait_until(pilot, condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


async def chat_scenario(pilot, k: int, result: dict) -> None:
    """A greedy reply at `k` (switched to first: every rank must run it), then the reloads the
    app offers (resident mode, another model). `result` gets the notices, what the header said,
    and the mode that runs and is kept."""
    from edge0_tui.widgets.prompt import PromptInput

    app = pilot.app
    chat, control = app.chat_screen, app.chat_screen.controller
    notices = result.setdefault("notices", [])
    notify = app.notify
    app.notify = lambda message, *a, **kw: (notices.append(str(message)), notify(message, *a, **kw))
    await wait_until(pilot, lambda: control.ready, "the model to load")
    control.settings = GREEDY
    chat.choose_k(k)
    prompt = chat.query_one(PromptInput)
    prompt.focus()
    prompt.text = MESSAGE
    await pilot.press("enter")
    await wait_until(pilot, lambda: prompt.text == "" and chat.reply is None, "the reply")
    # The header takes the ranks' figures of the reply at its next refresh.
    await wait_until(pilot, lambda: "rank 1: " in app.title, "the header's figures")
    result["title"] = app.title
    chat.show_outcome(control.reload("resident", writing=False))  # as the dialog's "Load"
    await wait_until(pilot, lambda: control.ready, "the chat ready again")
    await pilot.pause()
    app.action_open_model()
    result["mode"] = app.session.metrics.mode
    result["kept_mode"] = app.preferences.current.mode


def record_replies(into: list) -> None:
    """Each reply's prompt and token ids, as the engine thread has them at the reply's end."""
    from edge0_tui.engine_service.service import _ReplyRun

    done = _ReplyRun._done

    def recorded(self, result):
        into.append({"prompt": list(result.prompt_tokens), "tokens": list(result.tokens)})
        return done(self, result)

    _ReplyRun._done = recorded


def chat_rank(result_path: str, k: int, argv: list[str]) -> None:
    """One rank of `edge0 ARGV` (chat --hosts): rank 0's app headless, driven by
    `chat_scenario`, then Ctrl+Q."""
    from edge0_tui import cli
    from edge0_tui.app import Edge0App

    result: dict = {"replies": []}
    record_replies(result["replies"])

    async def drive(pilot) -> None:
        try:
            await chat_scenario(pilot, k, result)
        finally:
            Path(result_path).write_text(json.dumps(result))
        await pilot.press("ctrl+q")

    run = Edge0App.run
    Edge0App.run = lambda app, **kw: run(app, headless=True, size=CHAT_SIZE, auto_pilot=drive)
    status = cli.main(argv)
    Path(f"{result_path}.rank{os.environ['MLX_RANK']}").write_text(str(status))


if __name__ == "__main__":
    if sys.argv[1] == "chat":
        chat_rank(sys.argv[2], int(sys.argv[3]), sys.argv[4:])
    else:
        main()
