"""The `edge0` command: the top-level parser and dispatch to `edge0_tui.commands`, each error a
line on stderr with its exit status. The work is in `engine`."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from edge0_tui import ranks
from edge0_tui.checked_stdout import (
    STDOUT_CLOSED,
    CheckedStdout,
    StdoutError,
    discard_stdout,
    run_checked,
)
from edge0_tui.commands import COMMANDS, chat, options
from edge0_tui.commands.common import edge0_version
from edge0_tui.sanitize import escape_controls
from engine import Edge0Error, fit_mlx_lm_to_the_open_file_limit

# The exit status of a process killed by SIGPIPE (128 + 13), as shells report `yes | head`.
BROKEN_PIPE_STATUS = 141


class _OneLineErrorParser(argparse.ArgumentParser):
    """argparse with one-line errors (`edge0: error: argument --x: ...`, exit status 2) like every
    other edge0 error; the usage text stays with --help. Subcommand parsers share this class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, error_line(" ".join(message.split())))


def error_line(message: object) -> str:
    """`edge0: error: MESSAGE` and a newline: one line, whatever the message quotes from a file
    (a shard's name, a token, a template's text), its control characters shown escaped."""
    return f"edge0: error: {escape_controls(str(message), keep_newlines=False)}\n"


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineErrorParser(
        prog="edge0",
        description="Run Mixture-of-Experts models whose experts stream from disk.",
    )
    parser.add_argument("--version", action="version", version=f"edge0 {edge0_version()}")
    # No command runs `chat`.
    subparsers = parser.add_subparsers(dest="command", required=False)
    for command in COMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    fit_mlx_lm_to_the_open_file_limit()  # before any command imports mlx-lm
    parser = build_parser()
    stdout = sys.stdout
    try:  # --help and --version write to stdout; argparse ignores an OSError there, not this
        if stdout is not None:
            sys.stdout = CheckedStdout(stdout)
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:
            if e.code == 0 and stdout is not None:  # (with stdout closed, argparse uses stderr)
                sys.stdout.flush()
            raise
    except StdoutError as e:
        discard_stdout()
        print(error_line(e), end="", file=sys.stderr)
        return 2
    finally:
        sys.stdout = stdout
    if args.command is None:
        args = parser.parse_args([chat.NAME])
    if sys.stdout is None:  # started with stdout closed (`>&-`): Python then has no sys.stdout
        print(f"edge0: error: {STDOUT_CLOSED}", file=sys.stderr)
        return 2
    command = {command.NAME: command for command in COMMANDS}[args.command]
    try:
        if command is chat and args.hosts is None:
            return chat.run(args)  # the app draws on the terminal itself
        if getattr(args, "resolve_model", False):  # demo, a folder or a Hub id, as chat says
            args.model = options.model_path(args.model)
        if getattr(args, "runs_as_ranks", False) and args.hosts is not None:
            return _as_ranks(command, args, sys.argv[1:] if argv is None else list(argv))
        return run_checked(command.run, args)
    except StdoutError as e:
        discard_stdout()
        print(error_line(e), end="", file=sys.stderr)
        return 2
    except Edge0Error as e:
        print(error_line(e), end="", file=sys.stderr)
        return 2
    except BrokenPipeError:
        discard_stdout()  # quietly, as Unix tools stop when their reader goes away
        return BROKEN_PIPE_STATUS
    except KeyboardInterrupt:
        return 130


def _as_ranks(command, args: argparse.Namespace, argv: list[str]) -> int:
    """`--hosts`: start the ranks, or, in a rank, run the command as one (`ranks.py`). The chat
    app draws on the terminal: the other ranks write to logs (`chat.rank_logs`)."""
    if not ranks.in_rank():
        if getattr(args, "mode", None) == "resident":
            raise Edge0Error(
                "--hosts: resident mode holds every expert; ranks share the experts "
                "in the streamed modes (on-demand, prefetch, prerouter)"
            )
        if getattr(args, "max_batch", 1) > 1:
            raise Edge0Error(
                "--max-batch does not run with --hosts: the ranks run one reply at a time"
            )
        hosts = ranks.parse_hosts(args.hosts)
        if command is chat:
            chat.before_ranks(args, hosts)
        return ranks.launch(hosts, argv)
    log = (
        chat.rank_logs(args) / chat.RANK_LOG.format(rank=ranks.rank()) if command is chat else None
    )
    ranks.enter_rank(log)
    if ranks.rank() != 0:
        config = getattr(command, "engine_config", options.engine_config)(args)  # rank 0's
        return run_checked(lambda a: ranks.follow(a, config), args)  # rank 0 runs the command
    if command is chat:
        return chat.run(args)  # the app draws on the terminal itself
    return run_checked(command.run, args)


def entry() -> int:
    """The `edge0` command: `main` in a process of its own. On Linux every command first
    re-executes itself once with a fast BLAS preloaded (`engine.runtime.blas`: MLX's bundled one is
    far slower for dense products); only the command may replace its process, so this is not in
    `main`, which tests call in-process."""
    from engine import preload_fast_blas

    preload_fast_blas()
    status = main(sys.argv[1:])
    ranks.note_status(status)  # a rank 0 that mlx.launch started: for the command that did
    return status


if __name__ == "__main__":
    sys.exit(entry())
