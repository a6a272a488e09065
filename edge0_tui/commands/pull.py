"""`edge0 pull OWNER/NAME`: download a Hub repo's checkpoint into the Hugging Face cache, as
`chat`, `generate` and `serve` do before they load it (`model_source.pull_from_hub`), and say
what it took.

Only the files edge0 reads are fetched (config, tokenizer, chat template, safetensors index and
shards, K profiles); the free disk space is checked before a byte is written; an interrupted pull
run again resumes each file where it stopped, and a pull of a complete copy transfers nothing.
`--adapters OWNER/NAME` pulls an adapter repo's prerouter/LoRA files the same way."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from edge0_tui.commands import options
from engine import Edge0Error, format_bytes

if TYPE_CHECKING:
    from edge0_tui.model_source import Pulled

NAME = "pull"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        NAME,
        help="download a Hugging Face model (only the files edge0 needs; resumable)",
        description=(
            "Download a Hugging Face repo's checkpoint into the Hugging Face cache: its config, "
            "tokenizer, chat template and safetensors files, nothing else. The free disk space "
            "is checked first; an interrupted pull run again resumes where it stopped."
        ),
    )
    parser.add_argument("model", type=options.utf8, metavar="OWNER/NAME")
    parser.add_argument(
        "--revision", type=options.utf8, help="a branch, tag or commit (default: main)"
    )
    parser.add_argument(
        "--adapters",
        action="append",
        default=[],
        metavar="OWNER/NAME",
        type=options.adapter_spec,
        help="an adapter repo to pull too (its prerouter_*/lora_* files); repeatable",
    )


def run(args: argparse.Namespace) -> int:
    from huggingface_hub import constants

    from edge0_tui.model_source import is_hub_id, pull_adapters, pull_from_hub

    for repo in (args.model, *args.adapters):
        if not is_hub_id(repo):
            raise Edge0Error(f"{repo!r}: not a Hugging Face repo id (owner/name)")
    offline = bool(constants.HF_HUB_OFFLINE)
    progress = options.StderrProgress()
    try:
        print(summary(pull_from_hub(args.model, progress, offline=offline, revision=args.revision)))
        for repo in args.adapters:
            print(summary(pull_adapters(repo, progress, offline=offline)))
    finally:
        progress.end()
    return 0


def summary(pulled: Pulled) -> str:
    """One line: the repo, its folder, and what the pull transferred."""
    plan = pulled.plan
    if plan is None:
        return f"{pulled.folder}: the cached copy (offline: the Hub was not asked)"
    files = f"{len(plan.files)} file{'s' * (len(plan.files) != 1)}"
    done = f"{plan.repo_id}: {files}, {format_bytes(plan.total_bytes)} in {pulled.folder}"
    if not pulled.received:
        return f"{done}; complete already, nothing downloaded"
    kept = f" ({format_bytes(plan.have_bytes)} were already here)" if plan.have_bytes else ""
    return f"{done}; {format_bytes(pulled.received)} downloaded{kept}"
