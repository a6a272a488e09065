"""The key footer, showing only whole keys: Textual's footer cuts the key at its right edge mid-word
("f2 Settin"). This one shows the keys that fit, in order, and leaves the rest to the keys panel
(F1), which lists every key. The screens put F1 among the first keys, so it always fits.
"""

from __future__ import annotations

from textual.widgets import Footer
from textual.widgets._footer import FooterKey


class FittingFooter(Footer):
    DEFAULT_CSS = """
    FittingFooter {
        padding-left: 1;
    }
    """

    def __init__(self) -> None:
        super().__init__(compact=True)

    async def recompose(self) -> None:
        await super().recompose()  # Textual rebuilds the keys whenever the bindings change
        self.fit_keys()

    def on_resize(self) -> None:
        self.fit_keys()

    def fit_keys(self) -> None:
        """Show every key, then, once laid out, hide the first that ends past the edge and all
        after it."""
        keys = self.binding_keys()
        for key in keys:
            key.display = True
        self.call_after_refresh(self._hide_past_the_edge)

    def binding_keys(self) -> list[FooterKey]:
        return [key for key in self.query(FooterKey) if not key.has_class("-command-palette")]

    def _hide_past_the_edge(self) -> None:
        palette = [key for key in self.query(FooterKey) if key.has_class("-command-palette")]
        edge = palette[0].region.x if palette else self.region.right
        cut = False
        for key in self.binding_keys():
            cut = cut or key.region.right > edge
            key.display = not cut
