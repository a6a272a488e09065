"""Write assets/screenshot.svg: the chat app, headless, after two real replies on the demo model.

    python -m edge0_tui.screenshot [--out assets/screenshot.svg]

The first reply runs on-demand at the model's native K, the second in prerouter mode at K=4, so
the sparklines show the change. Chats go to a temporary directory; the demo model to the usual cache.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from engine import EngineConfig, GenerationConfig, parse_size

from .app import Edge0App
from .model_source import BUNDLED_NOTICE
from .widgets.prompt import PromptInput

QUESTIONS = (
    "Speak of love, good sir.",
    "And what of the king?",
)


async def capture(out: Path, data_dir: Path) -> None:
    app = Edge0App(
        model="demo",
        engine_config=EngineConfig(expert_cache_bytes=parse_size("4M")),
        data_dir=data_dir,
        settings=GenerationConfig(max_tokens=80, temperature=0.7, top_p=0.9, seed=0),
    )
    async with app.run_test(size=(132, 42), notifications=True) as pilot:
        chat = app.chat_screen
        await _until(pilot, lambda: chat.controller.ready, 300)
        for n, question in enumerate(QUESTIONS):
            if n == 1:
                chat.choose_mode("prerouter")
                chat.choose_k(4)
            chat.query_one(PromptInput).text = question
            await pilot.press("enter")
            answered = 2 * (n + 1)  # messages once this reply is in
            await _until(
                pilot, lambda a=answered: chat.reply is None and len(chat.controller.messages) == a
            )
        await pilot.pause(0.5)  # one more panel tick after the last token
        chat.panel_timer.pause()
        # Keep only the demo notice on screen, so the toasts hide no panel.
        app.clear_notifications()
        chat.notify(BUNDLED_NOTICE, severity="information", timeout=60)
        prompt = chat.query_one(PromptInput)
        prompt.cursor_blink = False
        # TextArea's line cache leaves focus out of its key with blinking off: redraw the lines.
        prompt.notify_style_update()
        prompt.refresh()
        await pilot.pause()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(app.export_screenshot(title="edge0 chat"))
        await pilot.press("ctrl+q")


async def _until(pilot, condition, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the app did not get there in time")
        await pilot.pause(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("assets/screenshot.svg"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as data_dir:
        asyncio.run(capture(args.out, Path(data_dir)))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
