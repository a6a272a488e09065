"""Killing the app during a reply leaves the saved conversations readable."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

from edge0_tui.chat_store import ChatStore

# Run in a child process: the real app, headless; it sends a message and the process is killed
# with SIGKILL (no clean-up of any kind) while the reply is being written.
CHILD = textwrap.dedent(
    """
    import asyncio, os, signal, sys, time
    sys.path.insert(0, {tests!r})
    from test_tui_app import LONG, SHORT, make_app, ready, send
    from edge0_tui.messages import ReplyText

    async def main():
        app = make_app({model!r}, __import__("pathlib").Path({data!r}), settings=SHORT)
        async with app.run_test(size=(120, 40)) as pilot:
            await ready(app, pilot)
            await send(app, pilot, "first question")
            while app.chat_screen.reply is not None:
                await pilot.pause(0.05)
            app.chat_screen.controller.settings = LONG  # a reply long enough to be killed in the middle of
            await send(app, pilot, "second question, killed mid-reply")
            start = time.monotonic()
            while time.monotonic() - start < 1.0:
                await pilot.pause(0.05)
            print("killing", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    asyncio.run(main())
    """
)


def test_kill_during_reply_keeps_chats_readable(checkpoint_dir, tmp_path):
    import os

    tests = os.path.dirname(__file__)
    script = CHILD.format(tests=tests, model=str(checkpoint_dir("qwen3_moe")), data=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    assert "killing" in out.stdout

    store = ChatStore(tmp_path)
    try:
        chats = store.chats()
        assert len(chats) == 1
        messages = store.messages(chats[0].id)
        users = [m.content for m in messages if m.role == "user"]
        assert users == ["first question", "second question, killed mid-reply"]
        assert any(m.role == "assistant" and m.content for m in messages)
    finally:
        store.close()
