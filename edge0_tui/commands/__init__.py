"""The `edge0` commands, one module each: `NAME`, `add_parser(subparsers)` for its arguments and
`run(args) -> int` for its work. `edge0_tui.cli` dispatches to them."""

from edge0_tui.commands import (
    bench,
    chat,
    doctor,
    eval,
    generate,
    info,
    list_models,
    pull,
    serve,
    soak,
    synth,
    train,
)

# In the order `edge0 --help` lists them.
COMMANDS = (
    generate,
    bench,
    soak,
    info,
    list_models,
    pull,
    train,
    eval,
    synth,
    chat,
    serve,
    doctor,
)
