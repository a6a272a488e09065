"""`edge0 train PHASE`: the demo corpus and teacher, the prerouter heads, the recovery LoRA and
its on-policy distillation."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

from edge0_tui.commands import options
from edge0_tui.commands.common import read_text
from edge0_tui.model_source import is_bundled_demo
from engine import Edge0Error, EngineConfig

NAME = "train"
# `train heads --time`: an evening's training.
DEFAULT_TIME_TEXT = "2h"
_UNITS = {"h": 3600, "m": 60, "s": 1}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([hms])")


def duration(text: str) -> float:
    """A time budget such as `2h`, `90m`, `1h30m` or `45s`, in seconds."""
    spoken = text.strip().lower()
    parts = _DURATION.findall(spoken)
    if not parts or "".join(n + u for n, u in parts) != spoken:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration: write it as 2h, 90m, 1h30m or 45s"
        )
    seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the time budget must be above zero")
    return seconds


DEFAULT_TIME = duration(DEFAULT_TIME_TEXT)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(NAME, help="training phases")
    phases = parser.add_subparsers(dest="phase", required=True)
    _add_heads(phases)
    _add_corpus(phases)
    _add_base(phases)
    _add_lora_and_distill(phases)


def _add_heads(phases: argparse._SubParsersAction) -> None:
    heads = phases.add_parser("heads", help="phase 1: distill prerouter heads for width K")
    options.add_model(heads)
    heads.add_argument(
        "--k", type=options.count(1), required=True, help="the routing width the heads predict"
    )
    heads.add_argument(
        "--text",
        type=Path,
        default=None,
        help="UTF-8 text to run the model over, its first windows held out (default: for the "
        "demo, its own corpus, the train split of Shakespeare's works; for another model, text "
        "it writes itself: its replies to 56 built-in prompts of eight kinds (code, maths, chat, "
        "facts, stories, instructions, other languages, reasoning) through its chat template, "
        "the replies to 8 of them held out; no download; see --self-text-tokens)",
    )
    heads.add_argument(
        "--self-text-tokens",
        type=options.count(1),
        default=None,
        metavar="N",
        help="without --text: how many tokens of text the model writes itself (default: what "
        "--time holds, at most --max-tokens); written once at T=0.8 with a fixed seed into "
        "ADAPTERS/work, kept reply by reply, a rerun goes on where it stopped; on the demo, "
        "its own text instead of its corpus",
    )
    heads.add_argument(
        "--time",
        type=duration,
        default=DEFAULT_TIME,
        metavar="DURATION",
        help=f"the time budget, e.g. 45m, 2h, 1h30m (default {DEFAULT_TIME_TEXT}, an evening): "
        "one short pass of each phase is timed first, and the text is as long as the budget "
        "holds after the training steps (at most --max-tokens); the plan (phases, tokens, "
        "time each) is printed before any work, to accept or change",
    )
    heads.add_argument(
        "--yes",
        action="store_true",
        help="accept the plan without asking (on a terminal it asks; elsewhere it goes ahead "
        "and prints the plan)",
    )
    heads.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the heads file (default ADAPTERS/prerouter_k{K}.safetensors)",
    )
    heads.add_argument(
        "--adapters",
        type=options.folder,
        default=None,
        metavar="DIR",
        help="the adapter folder to write to, traces and training state in DIR/work (default: "
        "the model's automatic folder, $EDGE0_DATA_DIR or the user data folder, "
        "adapters/<fingerprint>); a rerun resumes there",
    )
    options.add_expert_cache(
        heads,
        default=options.AUTO,
        auto=True,
        help="routed-expert budget while collecting, e.g. 512M, 2G, or auto (default: what the "
        "memory plan leaves; the model runs on-demand)",
    )
    heads.add_argument(
        "--window",
        type=options.count(2),
        default=128,
        metavar="N",
        help="tokens per teacher-forced forward while collecting (default 128); a window that "
        "touches most experts reads each layer whole, so on a model that does not fit, larger "
        "windows read the checkpoint fewer times",
    )
    heads.add_argument(
        "--start-layer",
        type=options.count(0),
        default=None,
        help="the first layer routed by prediction (default: the second MoE layer)",
    )
    heads.add_argument(
        "--steps", type=options.count(1), default=400, help="training steps (default: 400)"
    )
    heads.add_argument(
        "--max-tokens",
        type=options.count(1),
        default=60_000,
        help="the most tokens of text the heads learn from, whatever --time holds (default: 60000)",
    )
    add_force(heads)


def _add_corpus(phases: argparse._SubParsersAction) -> None:
    corpus = phases.add_parser(
        "corpus", help="the demo corpus: OUT/train.txt and OUT/held_out.txt (the phases' --text)"
    )
    corpus.add_argument("out", type=Path)


def _add_base(phases: argparse._SubParsersAction) -> None:
    base = phases.add_parser("base", help="phase 0: train the demo teacher (resumable)")
    base.add_argument("out", type=Path, help="training directory: state, loss.csv, teacher/, base/")
    base.add_argument(
        "--steps", type=options.count(1), default=None, help="total steps (default 720)"
    )
    base.add_argument("--resume", action="store_true", help="require a saved state in OUT")
    base.add_argument("--seed", type=options.seed, default=0)


def _add_lora_and_distill(phases: argparse._SubParsersAction) -> None:
    lora = phases.add_parser("lora", help="phase 2: SFT of the recovery LoRA on teacher text")
    distill = phases.add_parser("distill", help="phase 3: on-policy distillation (reverse KL)")
    for phase, steps, out_dir, continuation_tokens, checkpoint_every in (
        # The defaults of the phases' configs (gen_tokens, checkpoint_every), written out so that
        # `edge0 --help` does not import MLX (a test keeps them equal).
        (lora, 300, "lora", 96, 50),
        (distill, 40, "distill", 64, 25),
    ):
        options.add_model(phase)
        phase.add_argument("--k", type=options.count(1), required=True)
        phase.add_argument(
            "--teacher",
            type=Path,
            default=None,
            help="the unquantized float model (mlx-lm); default: the checkpoint itself (its 4-bit "
            "weights routed by its own routers at its native K, without the LoRA)",
        )
        phase.add_argument(
            "--text", type=Path, required=True, help="UTF-8 text to draw prompts from"
        )
        phase.add_argument("--steps", type=options.count(1), default=steps)
        phase.add_argument(
            "--student",
            choices=("auto", "memory", "streamed"),
            default="auto",
            help="memory: the base dequantized in memory (faster); streamed: routed experts stay "
            "4-bit on disk, read through the expert cache in forward and again in backward "
            "(bounded by the memory plan); auto (default): memory where it fits",
        )
        options.add_expert_cache(
            phase,
            default="auto",
            auto=True,
            help='the streamed student\'s expert cache, e.g. 256M, or "auto" (default): what '
            "the memory plan leaves",
        )
        phase.add_argument(
            "--lr", type=options.positive_float, default=None, help="AdamW learning rate"
        )
        phase.add_argument(
            "--batch",
            type=options.count(1),
            default=None,
            help="rows (lora) or rollouts (distill) per step; lora's default: 8, or the most "
            "that a streamed student's memory plan holds (it says which)",
        )
        phase.add_argument(
            "--checkpoint-every",
            type=options.int_between(1, 1_000_000),
            default=None,
            metavar="N",
            help=f"save the run's state (and measure the held-out loss) every N steps; default "
            f"{checkpoint_every}. A run stopped between saves resumes from the last one",
        )
        phase.add_argument(
            "--continuation-tokens",
            type=options.int_between(1, 4096),
            default=None,
            metavar="N",
            help=f"tokens written after each prompt, by the teacher (lora) or the student "
            f"(distill); default {continuation_tokens}. Fewer make each row cheaper to write "
            "(the teacher samples them a token at a time) and each step shorter",
        )
        phase.add_argument(
            "--out",
            type=Path,
            default=None,
            help="default lora_k{K}.safetensors in the folder of the K profile's heads",
        )
        phase.add_argument(
            "--out-dir",
            type=options.folder,
            default=None,
            help=f"checkpoints (default HEADS_FOLDER/train/{out_dir}_k{{K}}); a rerun resumes "
            "there",
        )
        options.add_adapters(phase)
        add_force(phase)
    lora.add_argument(
        "--generate",
        type=options.count(1),
        default=1600,
        help="teacher continuations (cached, see --rows)",
    )
    lora.add_argument(
        "--continuations",
        choices=("sampled", "text"),
        default="sampled",
        help="sampled: the teacher writes each prompt's continuation (cached, see --rows); "
        "text: the text's own continuations (no sampling). Either way the target is the "
        "teacher's distribution at each position",
    )
    lora.add_argument(
        "--rows",
        type=Path,
        default=None,
        help="teacher rows cache (default HEADS_FOLDER/train/teacher_rows.npz, shared by every K)",
    )
    lora.add_argument(
        "--teacher-top-k",
        type=options.int_between(0, 1 << 16),
        default=None,
        metavar="K",
        help="keep the teacher's K likeliest tokens per position on disk, computed once beside "
        "the rows (K*6+4 bytes a position; 388 KB per 1k tokens at 64) instead of its whole "
        "distribution computed at every step: a teacher forward less per step, exact only where "
        "K tokens hold its mass (default: the whole distribution, or 64 where a streamed student's "
        "memory plan holds no step with it)",
    )


def add_force(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--force",
        action="store_true",
        help="let --out overwrite a file that is not an adapter of this kind, or write into the "
        "model folder under another name than prerouter_*/lora_*",
    )


def check_out(args: argparse.Namespace, kind: str) -> None:
    """--out is refused before any work when it would overwrite what is not such an adapter."""
    if args.out is not None and not args.force:
        from engine import check_adapter_out

        check_adapter_out(args.out, kind, args.model)


def run(args: argparse.Namespace) -> int:
    if args.phase == "corpus":
        return run_corpus(args)
    if args.phase == "base":
        return run_base(args)
    if args.phase in ("lora", "distill"):
        return run_lora_or_distill(args)
    return run_heads(args)


def run_heads(args: argparse.Namespace) -> int:
    from engine.train.heads import TrainHeadsConfig, train_heads

    check_out(args, "prerouter")
    from engine.train.data import CHARS_PER_TOKEN
    from engine.train.self_text import SelfTextConfig

    self_text = None
    if args.self_text_tokens is not None:
        if args.text is not None:
            raise Edge0Error("--self-text-tokens is for the model's own text: not with --text")
        if args.self_text_tokens > args.max_tokens:
            raise Edge0Error(
                f"--self-text-tokens {args.self_text_tokens} is above --max-tokens "
                f"{args.max_tokens}, all that phase 1 reads"
            )
        self_text = SelfTextConfig(tokens=args.self_text_tokens)
    # Only what is encoded is read (the first CHARS_PER_TOKEN x --max-tokens characters).
    limit = CHARS_PER_TOKEN * args.max_tokens
    text = read_text(args.text, max_chars=limit) if args.text is not None else None
    text_name = str(args.text) if args.text is not None else None
    if text is None and self_text is None and is_bundled_demo(args.model):
        # The demo knows Shakespeare and cannot chat: its own corpus is the text it is used on.
        from engine.train.corpus import DEMO_HEADS_CORPUS, train_split_text

        text, text_name = train_split_text()[:limit], DEMO_HEADS_CORPUS
    config = TrainHeadsConfig(
        k=args.k,
        start_layer=args.start_layer,
        steps=args.steps,
        max_tokens=args.max_tokens,
        window=args.window,
    )
    engine_config = EngineConfig(
        **options.expert_cache_config(args.expert_cache), data_dir=options.data_dir()
    )
    from engine.train.budget import PlanDeclined

    try:
        train_heads(
            args.model,
            text,
            config,
            out=args.out,
            progress=lambda line: print(line, flush=True),
            engine_config=engine_config,
            adapters_dir=args.adapters,
            bar=sys.stderr.isatty(),
            text_name=text_name,
            self_text=self_text,
            time_budget_s=args.time,
            confirm=plan_confirmation(args.yes, sys.stdin.isatty() and sys.stdout.isatty()),
        )
    except PlanDeclined as e:
        print(f"{e}: change it with --time, --self-text-tokens, --max-tokens or --steps")
    return 0


def plan_confirmation(
    yes: bool, terminal: bool, ask: Callable[[str], str] = input
) -> Callable[[object], bool | float]:
    """How `train heads` takes its plan: with --yes, as printed; on a terminal, by asking (Enter
    or y: start; n: stop; a duration: plan again for it); elsewhere as printed, saying so, since
    a script must never wait on a question nobody sees."""

    def confirm(plan) -> bool | float:
        if yes:
            return True
        if not terminal:
            print("not a terminal: going ahead with the plan (--yes says so without this line)")
            return True
        while True:
            try:
                answer = ask("start? [Enter/y: yes, n: stop, or another budget, e.g. 1h] ")
            except EOFError:
                return False
            answer = answer.strip().lower()
            if answer in ("", "y", "yes"):
                return True
            if answer in ("n", "no"):
                return False
            try:
                return duration(answer)
            except argparse.ArgumentTypeError as e:
                print(e)

    return confirm


def run_corpus(args: argparse.Namespace) -> int:
    from engine import peak_memory_line
    from engine.train.corpus import write_split_texts

    split = write_split_texts(args.out)
    print(
        f"wrote {args.out / 'train.txt'} ({len(split.train)} works) and "
        f"{args.out / 'held_out.txt'} (held out: {', '.join(split.held_out)})"
    )
    print(peak_memory_line())
    return 0


def run_base(args: argparse.Namespace) -> int:
    from engine.train.base import TrainBaseConfig, train_base

    config = TrainBaseConfig(seed=args.seed)
    if args.steps is not None:
        config.steps = args.steps
    train_base(args.out, config, resume=args.resume, progress=lambda line: print(line, flush=True))
    return 0


def run_lora_or_distill(args: argparse.Namespace) -> int:
    from engine.train.data import CHARS_PER_TOKEN

    check_out(args, "lora")
    extra = {}
    if args.phase == "lora":
        from engine.train.lora import TrainLoRAConfig as Config
        from engine.train.lora import train_lora as train

        config = Config(
            k=args.k,
            rows=args.generate,
            steps=args.steps,
            continuations=args.continuations,
        )
        extra["rows_path"] = args.rows
        if args.rows is not None and os.path.lexists(args.rows):  # a FIFO blocks: before any work
            from engine import check_regular_file

            check_regular_file(args.rows)
        if args.batch is not None:
            config.batch, config.fit_batch = args.batch, False
        if args.teacher_top_k is not None:
            config.teacher_top_k, config.fit_teacher_top_k = args.teacher_top_k, False
    else:
        from engine.train.distill import TrainDistillConfig as Config
        from engine.train.distill import train_distill as train

        config = Config(k=args.k, steps=args.steps)
        if args.batch is not None:
            config.prompts_per_step = args.batch
    if args.lr is not None:
        config.lr = args.lr
    if args.continuation_tokens is not None:
        config.gen_tokens = args.continuation_tokens
    if args.checkpoint_every is not None:
        config.checkpoint_every = args.checkpoint_every
    train(
        args.model,
        args.teacher,
        # Read before --adapters resolves (its error comes first); only what is encoded.
        read_text(args.text, max_chars=CHARS_PER_TOKEN * config.max_corpus_tokens),
        config,
        out=args.out,
        out_dir=args.out_dir,
        log=lambda line: print(line, flush=True),
        bar=sys.stderr.isatty(),
        engine_config=EngineConfig(
            adapter_dirs=options.adapter_dirs(args.adapters),
            data_dir=options.data_dir(),
            **options.expert_cache_config(args.expert_cache),
        ),
        streamed={"auto": None, "memory": False, "streamed": True}[args.student],
        **extra,
    )
    return 0
