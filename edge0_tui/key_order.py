"""The order the chat screen's keys are listed in: the switches first (the footer, the keys panel).

Textual lists the focused widget's keys first (the prompt's Send, New line). The K and mode keys,
the reason to have this app, come before them: at 80 columns the footer has room for little more
than the switches, and F1 lists what it leaves out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The switch keys, the heat view, the keys panel and Quit, in this order, before every other key.
SWITCH_BINDING_IDS = (
    "chat.next_k",
    "chat.next_mode",
    "chat.panels",
    "app.heat",
    "app.keys",
    "app.quit",
    "chat.stop",
)


def switch_keys_first(bindings: Mapping[str, Any]) -> dict[str, Any]:
    """`bindings` (key -> Textual's active binding, which has `.binding.id`) with the switch keys
    first, in `SWITCH_BINDING_IDS`' order; the others follow in the order they came."""
    first = sorted(
        (SWITCH_BINDING_IDS.index(active.binding.id), key)
        for key, active in bindings.items()
        if active.binding.id in SWITCH_BINDING_IDS
    )
    return {**{key: bindings[key] for _, key in first}, **bindings}
