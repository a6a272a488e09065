"""`edge0 synth`: a random-weight 4-bit checkpoint, or (--from) a trained one with wider experts."""

from __future__ import annotations

import argparse
from pathlib import Path

from edge0_tui.commands import options
from engine import Edge0Error, format_bytes

NAME = "synth"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        NAME,
        help="write a random-weight 4-bit checkpoint, or (--from) a trained one with wider experts",
    )
    parser.add_argument("out", type=Path)
    parser.add_argument("--family", default=None, help="default qwen3_moe")
    parser.add_argument("--preset", default=None, help="tiny (default), small or wall")
    parser.add_argument(
        "--from",
        type=Path,
        default=None,
        dest="from_model",
        metavar="MODEL",
        help="copy this trained checkpoint with its routed experts zero-padded (same outputs)",
    )
    parser.add_argument(
        "--expert-width",
        type=int,
        default=None,
        metavar="N",
        help="with --from: the experts' new intermediate width (6144 makes the demo's 2.5 MiB)",
    )
    parser.add_argument("--seed", type=options.seed, default=0)
    parser.add_argument(
        "--heads",
        type=k_list,
        default=None,
        help="comma-separated K values to train quick prerouter heads for (default: 4 for wall)",
    )


def k_list(text: str) -> tuple[int, ...]:
    """--heads: comma-separated routing widths, checked when parsed (a bad one was a traceback
    after the checkpoint was written)."""
    values = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if not (part.isascii() and part.isdigit()) or int(part) < 1:
            raise argparse.ArgumentTypeError(f"{part!r} is not a K (a whole number, at least 1)")
        values.append(int(part))
    return tuple(values)


def run(args: argparse.Namespace) -> int:
    if args.from_model is not None:
        return run_from(args)
    if args.expert_width is not None:
        raise Edge0Error("--expert-width widens a trained checkpoint: give it with --from MODEL")
    from engine.train.synth import write_synthetic_checkpoint

    family, preset = args.family or "qwen3_moe", args.preset or "tiny"
    try:
        out = write_synthetic_checkpoint(args.out, family, preset, seed=args.seed)
    except OSError as e:  # OUT is a file, or under one, or where nothing may be written
        raise Edge0Error(
            f"{e.filename or args.out}: cannot write the checkpoint ({e.strerror or e})"
        ) from None
    print(f"wrote {preset} {family} checkpoint to {out}")
    heads = args.heads if args.heads is not None else ((4,) if preset == "wall" else ())
    for k in heads:
        _quick_heads(out, k)
    return 0


def run_from(args: argparse.Namespace) -> int:
    """`edge0 synth OUT --from MODEL --expert-width N`: the trained model, experts zero-padded."""
    from engine.train.wall import pad_experts

    ignored = [f for f in ("family", "preset", "heads") if getattr(args, f) is not None]
    if ignored:
        raise Edge0Error(f"--from copies a trained checkpoint; --{ignored[0]} does not apply")
    if args.expert_width is None:
        raise Edge0Error("--from needs --expert-width N (the experts' new intermediate width)")
    report = pad_experts(args.from_model, args.out, args.expert_width)
    growth = report.expert_bytes_after / report.expert_bytes_before
    print(
        f"wrote {report.out_dir}: routed experts {report.width_before} -> {report.width_after} "
        f"wide, {format_bytes(report.expert_bytes_before)} -> "
        f"{format_bytes(report.expert_bytes_after)} of experts ({growth:.1f}x), "
        f"{report.shards} shard(s)"
    )
    if report.restamped:
        print(f"adapters stamped for the padded base: {', '.join(report.restamped)}")
    if report.copied_unchanged:
        print(
            "adapters trained for another base, copied unchanged (still refused): "
            + ", ".join(report.copied_unchanged)
        )
    return 0


def _quick_heads(model: Path, k: int) -> None:
    """Heads trained briefly on Python's own docs: realistic prediction sets for benchmarks
    (varied, token-dependent), not quality."""
    import pydoc_data.topics
    import shutil

    from engine.train.heads import TrainHeadsConfig, train_heads

    text = "\n\n".join(pydoc_data.topics.topics.values())
    config = TrainHeadsConfig(k=k, max_tokens=768, window=64, steps=150)
    # Beside the checkpoint (its folder is ours), traces in a work folder there too.
    train_heads(
        model,
        text,
        config,
        out=model / f"prerouter_k{k}.safetensors",
        progress=lambda line: print(line, flush=True),
        adapters_dir=model,
    )
    shutil.rmtree(model / "work", ignore_errors=True)  # the traces of a quick run are not kept
