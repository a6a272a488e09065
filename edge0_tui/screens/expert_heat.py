"""The expert heat screen (F7): every MoE layer's experts, live, over the whole terminal.

It reads the engine's latest snapshot on its own timer, at the chat screen's panel rate; the
engine thread publishes a new picture at most that often while a reply is written and once after
its last step, so the screen keeps showing the last step once the reply has ended. Escape (or F7
again) goes back to the chat.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Header

from ..engine_session import EngineSession
from ..widgets.expert_heat import ExpertHeatView
from ..widgets.fitting_footer import FittingFooter
from .chat import PANEL_REFRESH_HZ


class ExpertHeatScreen(Screen):
    BINDINGS = [Binding("escape", "app.pop_screen", "Back to the chat", id="heat.close")]

    def __init__(self, session: EngineSession) -> None:
        super().__init__()
        self.session = session

    def compose(self) -> ComposeResult:
        yield Header()
        yield ExpertHeatView(id="expert-heat")
        yield FittingFooter()

    def on_mount(self) -> None:
        self.sub_title = "expert heat"
        self.timer = self.set_interval(1 / PANEL_REFRESH_HZ, self.refresh_view)
        self.call_after_refresh(self.refresh_view)  # once the view has its width

    def refresh_view(self) -> None:
        self.query_one(ExpertHeatView).show(self.session.metrics)
