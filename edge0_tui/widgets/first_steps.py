"""What an empty chat shows: how to start, and for the demo what it is and prompts to try.

The demo answers a speech with a speech, often a line; the prompts offered are those after which
it wrote the longest replies (8 seeds each at the demo's settings: medians of 20-40 tokens, where
"What is love?" got 9), so that the panels and the stop key have time to be watched. A click on
one, or the palette's "Suggested prompt", puts it in the message box.
"""

from __future__ import annotations

from textual.widgets import Static

DEMO_PROMPTS = (
    "Hello",
    "What say you to my suit? Speak at length, and leave nothing out.",
    "Speak the speech, I pray you.",
    "O Romeo, Romeo, wherefore art thou Romeo?",
)

DEMO_INTRO = (
    "The demo is a 24M-parameter Mixture-of-Experts trained on Shakespeare on a CPU. It answers "
    "in a line or a speech, in Elizabethan English, not wisely: it is here to show the memory "
    "wall. Every reply reads experts from disk: watch the panels, and press Esc to stop a reply."
)
KEYS = "Enter sends · Ctrl+J new line · Ctrl+R writes the reply again · Ctrl+Q quits"


def first_steps_markup(demo: bool) -> str:
    """The empty chat's text (Textual markup: each prompt a link that puts it in the box)."""
    if not demo:
        return f"[dim]Type a message. {KEYS}[/]"
    prompts = "\n".join(
        f"  [@click=screen.suggest({i})]▸ {prompt}[/]" for i, prompt in enumerate(DEMO_PROMPTS)
    )
    return f'{DEMO_INTRO}\n\nTry (click, or Ctrl+P "suggested"):\n{prompts}\n\n[dim]{KEYS}[/]'


class FirstSteps(Static):
    DEFAULT_CSS = """
    FirstSteps {
        height: auto;
        padding: 1 2;
        color: $text-muted;
        link-color: $accent;
        link-style: none;
        link-background-hover: $accent 20%;
    }
    """

    def show_for(self, demo: bool) -> None:
        self.update(first_steps_markup(demo))

    def show_while_empty(self, empty: bool, demo: bool) -> None:
        """Shown on an empty chat only, with the hints for the demo (`demo`) or another model."""
        self.display = empty
        if empty:
            self.show_for(demo)
