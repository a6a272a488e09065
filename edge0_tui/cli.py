"""The `edge0` command: argument parsing and printing only; the work is in `engine`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import NoReturn

from engine import (
    MAX_SEED,
    MODES,
    Edge0Error,
    EngineConfig,
    GenerationConfig,
    format_bytes,
    parse_size,
)

# The exit status of a process killed by SIGPIPE (128 + 13), as shells report `yes | head`.
BROKEN_PIPE_STATUS = 141


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (`edge0: error: argument --x: ...`, exit status 2) like every
    other edge0 error; the usage text stays with --help. Subcommand parsers share this class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"edge0: error: {' '.join(message.split())}\n")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except Edge0Error as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _page_cache(text: str) -> int | str:
    """--page-cache: a SIZE, or "off" (the OS decides what stays cached)."""
    if text.strip().lower() in ("off", "none"):
        return "off"
    return _size(text)


PAGE_CACHE_HELP = (
    "at most SIZE of the checkpoint's expert bytes stay in the OS page cache (the least recently "
    "read are dropped; on macOS expert reads bypass the cache): a memory wall on a machine whose "
    "RAM holds the checkpoint; off lets the OS decide"
)


def _utf8(text: str) -> str:
    """Command-line text as given. Python hands over bytes that are not UTF-8 as surrogate escapes
    (U+DC80..U+DCFF), which the tokenizer cannot encode: refuse them here, naming the byte."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = ord(text[e.start]) & 0xFF
        raise argparse.ArgumentTypeError(
            f"not valid UTF-8 (byte 0x{byte:02x} at character {e.start})"
        ) from None
    return text


def _count(least: int):
    """An argparse type: a whole number of at least `least` (rounds, tokens, turns, samples)."""

    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} must be at least {least}")
        return value

    return count


def _int_between(low: int, high: int):
    """An argparse type: a whole number from `low` to `high` (a seed as MLX takes it, a port)."""

    def between(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} must be between {low} and {high}")
        return value

    return between


_seed = _int_between(0, MAX_SEED)  # an unsigned 64-bit integer
_port = _int_between(0, 65535)  # 0: a free one


# `edge0 serve`'s API key when --api-key is not given (keeps it out of the process list).
API_KEY_ENV = "EDGE0_API_KEY"
# edge0's user data folder (trained adapters, chats) when set; read here, at the top, only.
DATA_DIR_ENV = "EDGE0_DATA_DIR"
CONFIG_DIR_ENV = "EDGE0_CONFIG_DIR"
ADAPTERS_HELP = (
    "an adapter folder or a Hugging Face repo id (owner/name: only its prerouter_*/lora_* files "
    "are downloaded), searched for K profiles before the model folder and the automatic folder; "
    "repeatable"
)


EXACT_HELP = (
    "today's kernels only (4-bit products everywhere; on-demand token-identical to resident); "
    "default: on the CPU with a fast BLAS, a prefill's routed experts with several tokens are "
    "dequantized and multiplied in fp32 (GEMM speed, logits within a tested bound)"
)


def _add_exact(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--exact", action="store_true", help=EXACT_HELP)


def _add_adapters(parser: argparse.ArgumentParser, help: str = ADAPTERS_HELP) -> None:
    parser.add_argument(
        "--adapters", action="append", default=[], metavar="DIR|REPO_ID", type=_utf8, help=help
    )


def _config_dir() -> Path | None:
    """edge0's user config folder (kept settings) from EDGE0_CONFIG_DIR; None: the platform's."""
    value = os.environ.get(CONFIG_DIR_ENV)
    return Path(value).expanduser() if value else None


def _data_dir() -> Path | None:
    """edge0's user data folder from EDGE0_DATA_DIR; None: the platform's."""
    value = os.environ.get(DATA_DIR_ENV)
    return Path(value).expanduser() if value else None


def _adapter_dirs(specs: list[str]) -> tuple[Path, ...]:
    """The folders `--adapters` names, Hub repos downloaded first (progress on stderr)."""
    from edge0_tui.model_source import resolve_adapters

    def on_progress(what: str, done: float, total: float | None) -> None:
        if sys.stderr.isatty():
            shown = f"{format_bytes(done)} / {format_bytes(total)}" if total else ""
            print(f"\r\x1b[2Kedge0: {what} {shown}", end="", file=sys.stderr, flush=True)

    dirs = tuple(resolve_adapters(spec, on_progress) for spec in specs)
    if specs and sys.stderr.isatty():
        print("\r\x1b[2K", end="", file=sys.stderr, flush=True)
    return dirs


def _version() -> str:
    """The installed package's version (a source tree that is not installed has none)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("edge0")
    except PackageNotFoundError:
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="edge0",
        description="Run Mixture-of-Experts models whose experts stream from disk.",
    )
    parser.add_argument("--version", action="version", version=f"edge0 {_version()}")
    # No command runs `chat`.
    commands = parser.add_subparsers(dest="command", required=False)

    gen = commands.add_parser("generate", help="generate text from a prompt, with per-step metrics")
    gen.add_argument("model", type=Path, help="local mlx-lm checkpoint directory")
    gen.add_argument(
        "--prompt",
        type=_utf8,
        required=True,
        help="the user's message, wrapped in the model's chat template when it has one (as "
        "mlx_lm.generate does; see --raw)",
    )
    template = gen.add_mutually_exclusive_group()
    template.add_argument(
        "--raw", action="store_true", help="encode the prompt as is, without the chat template"
    )
    # The default since the chat template became the default; kept so that scripts still run.
    template.add_argument("--chat", action="store_true", help=argparse.SUPPRESS)
    gen.add_argument("--max-tokens", type=int, default=64, help="at least 1")
    gen.add_argument("--temp", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--mode", choices=MODES, default="on-demand")
    gen.add_argument(
        "--expert-cache", type=_size, default="1G", help="routed-expert budget, e.g. 400K, 512M, 2G"
    )
    gen.add_argument(
        "--page-cache", type=_page_cache, default=None, metavar="SIZE|off", help=PAGE_CACHE_HELP
    )
    gen.add_argument("--eviction", choices=("lfu-aging", "lru"), default="lfu-aging")
    gen.add_argument("--k", type=int, default=None, help="routing width (default: the model's)")
    gen.add_argument("--no-lora", action="store_true", help="prerouter mode without the LoRA")
    _add_exact(gen)
    _add_adapters(gen)
    gen.add_argument(
        "--shadow-router",
        action="store_true",
        help="also run the true routers to report the prediction's recall@K (costs compute)",
    )
    gen.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    gen.add_argument(
        "--trace",
        type=Path,
        default=None,
        metavar="FILE",
        help="write a step timeline (Chrome/Perfetto trace JSON: compute, reads, blocked waits)",
    )

    bench = commands.add_parser("bench", help="same-session rotated A/B of modes on this machine")
    bench.add_argument("model", type=Path)
    bench.add_argument(
        "--arms",
        default="resident,on-demand,prerouter",
        help="comma-separated: resident, on-demand, prerouter, compute-only (every expert "
        "resident before the replay, no limits: the compute a step cannot go below, for the "
        "overlap-limit table; needs every expert in memory)",
    )
    bench.add_argument("--k", type=int, default=None)
    bench.add_argument("--rounds", type=_count(1), default=3)
    bench.add_argument("--tokens", type=_count(1), default=64)
    bench.add_argument("--prompt-file", type=Path, default=None)
    bench.add_argument("--expert-cache", type=_size, default="1G")
    bench.add_argument("--ram-limit", type=_size, default=None)
    bench.add_argument(
        "--read-limit",
        type=_size,
        default=None,
        metavar="BW",
        help="throttle each arm's disk reads to BW per second, e.g. 100M (Linux cgroups); "
        "implies --cold unless --warm",
    )
    bench.add_argument(
        "--read-limit-by",
        choices=("cgroup", "pacing"),
        default="cgroup",
        help="how --read-limit is applied: the kernel's throttle (Linux; lets an idle reader "
        "burst above the limit) or pacing in edge0's reader threads (any OS; one device of that "
        "bandwidth for cold bytes, no bursts)",
    )
    bench.add_argument(
        "--trace",
        type=Path,
        default=None,
        metavar="DIR",
        help="write each arm's step timeline to DIR/<arm>-round<N>.json (Perfetto)",
    )
    warmth = bench.add_mutually_exclusive_group()
    warmth.add_argument("--cold", action="store_true", help="evict the checkpoint before each arm")
    warmth.add_argument(
        "--warm",
        action="store_true",
        help="read the checkpoint once first (default, except with --read-limit)",
    )
    _add_exact(bench)
    _add_adapters(bench)
    bench.add_argument("--json", type=Path, default=None, dest="json_out")
    bench.add_argument("--markdown", type=Path, default=None)

    soak = commands.add_parser(
        "soak", help="a long conversation: memory, threads and files stay flat"
    )
    soak.add_argument("model", type=Path)
    soak.add_argument("--turns", type=_count(1), default=20)
    soak.add_argument("--steps", type=_count(1), default=2000)
    soak.add_argument("--mode", choices=MODES, default="on-demand")
    soak.add_argument("--expert-cache", type=_size, default="1G")
    soak.add_argument(
        "--fresh", action="store_true", help="a new conversation every turn (no growing KV cache)"
    )
    soak.add_argument("--json", action="store_true")

    info = commands.add_parser("info", help="family, layers, experts, expert bytes, K profiles")
    info.add_argument("model", type=Path)
    _add_adapters(info)
    info.add_argument("--json", action="store_true")

    train = commands.add_parser("train", help="training phases")
    phases = train.add_subparsers(dest="phase", required=True)
    heads = phases.add_parser("heads", help="phase 1: distill prerouter heads for width K")
    heads.add_argument("model", type=Path)
    heads.add_argument("--k", type=int, required=True)
    heads.add_argument(
        "--text",
        type=Path,
        default=None,
        help="UTF-8 text to run the model over (default: Python's own documentation, in every "
        "Python install, as chat exchanges in the model's chat template: role tokens and "
        "assistant turns as in a chat, explanatory English with code; no download)",
    )
    heads.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the heads file (default ADAPTERS/prerouter_k{K}.safetensors)",
    )
    heads.add_argument(
        "--adapters",
        type=Path,
        default=None,
        metavar="DIR",
        help="the adapter folder to write to, traces and training state in DIR/work (default: "
        "the model's automatic folder, $EDGE0_DATA_DIR or the user data folder, "
        "adapters/<fingerprint>); a rerun resumes there",
    )
    heads.add_argument(
        "--expert-cache",
        type=_size,
        default="1G",
        help="routed-expert budget while collecting, e.g. 512M, 2G (the model runs on-demand)",
    )
    heads.add_argument(
        "--window",
        type=_count(2),
        default=128,
        metavar="N",
        help="tokens per teacher-forced forward while collecting (default 128); a window that "
        "touches most experts reads each layer whole, so on a model that does not fit, larger "
        "windows read the checkpoint fewer times",
    )
    heads.add_argument("--start-layer", type=int, default=None)
    heads.add_argument("--steps", type=int, default=400)
    heads.add_argument("--max-tokens", type=int, default=60_000)
    corpus = phases.add_parser(
        "corpus", help="the demo corpus: OUT/train.txt and OUT/held_out.txt (the phases' --text)"
    )
    corpus.add_argument("out", type=Path)
    base = phases.add_parser("base", help="phase 0: train the demo teacher (resumable)")
    base.add_argument("out", type=Path, help="training directory: state, loss.csv, teacher/, base/")
    base.add_argument("--steps", type=int, default=None, help="total steps (default 720)")
    base.add_argument("--resume", action="store_true", help="require a saved state in OUT")
    base.add_argument("--seed", type=int, default=0)

    lora = phases.add_parser("lora", help="phase 2: SFT of the recovery LoRA on teacher text")
    distill = phases.add_parser("distill", help="phase 3: on-policy distillation (reverse KL)")
    for phase, steps, out_dir in ((lora, 300, "lora"), (distill, 40, "distill")):
        phase.add_argument("model", type=Path)
        phase.add_argument("--k", type=int, required=True)
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
        phase.add_argument("--steps", type=int, default=steps)
        phase.add_argument("--lr", type=float, default=None, help="AdamW learning rate")
        phase.add_argument(
            "--batch", type=int, default=None, help="rows (lora) or rollouts (distill) per step"
        )
        phase.add_argument(
            "--out",
            type=Path,
            default=None,
            help="default lora_k{K}.safetensors in the folder of the K profile's heads",
        )
        phase.add_argument(
            "--out-dir",
            type=Path,
            default=None,
            help=f"checkpoints (default HEADS_FOLDER/train/{out_dir}_k{{K}}); a rerun resumes "
            "there",
        )
        _add_adapters(phase)
    lora.add_argument(
        "--generate", type=int, default=1600, help="teacher continuations (cached, see --rows)"
    )
    lora.add_argument(
        "--rows",
        type=Path,
        default=None,
        help="teacher rows cache (default HEADS_FOLDER/train/teacher_rows.npz, shared by every K)",
    )

    evaluate = commands.add_parser(
        "eval", help="held-out perplexity, recall@K, distinct-4, LoRA merge retention"
    )
    evaluate.add_argument("model", type=Path)
    evaluate.add_argument("--text", type=Path, required=True, help="held-out UTF-8 text")
    evaluate.add_argument("--k", type=int, default=None)
    evaluate.add_argument(
        "--mode", choices=MODES, default=None, help="default: prerouter when heads exist"
    )
    evaluate.add_argument("--no-lora", action="store_true")
    _add_exact(evaluate)
    _add_adapters(evaluate)
    evaluate.add_argument("--max-tokens", type=_count(1), default=16_384)
    evaluate.add_argument(
        "--samples", type=_count(1), default=8, help="continuations for distinct-4"
    )
    evaluate.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    synth = commands.add_parser(
        "synth",
        help="write a random-weight 4-bit checkpoint, or (--from) a trained one with wider experts",
    )
    synth.add_argument("out", type=Path)
    synth.add_argument("--family", default=None, help="default qwen3_moe")
    synth.add_argument("--preset", default=None, help="tiny (default), small or wall")
    synth.add_argument(
        "--from",
        type=Path,
        default=None,
        dest="from_model",
        metavar="MODEL",
        help="copy this trained checkpoint with its routed experts zero-padded (same outputs)",
    )
    synth.add_argument(
        "--expert-width",
        type=int,
        default=None,
        metavar="N",
        help="with --from: the experts' new intermediate width (6144 makes the demo's 2.5 MiB)",
    )
    synth.add_argument("--seed", type=_seed, default=0)
    synth.add_argument(
        "--heads",
        default=None,
        help="comma-separated K values to train quick prerouter heads for (default: 4 for wall)",
    )

    chat = commands.add_parser("chat", help="chat in the terminal app (the default command)")
    chat.add_argument(
        "model",
        nargs="?",
        default="demo",
        help="checkpoint directory, Hugging Face repo id, or demo (the default)",
    )
    chat.add_argument(
        "--expert-cache",
        type=_size,
        default=None,
        help="routed-expert budget, e.g. 512M, 2G (default 1G; 4M for demo, to show the wall)",
    )
    chat.add_argument(
        "--page-cache",
        type=_page_cache,
        default=argparse.SUPPRESS,  # absent: the per-model default below
        metavar="SIZE|off",
        help=PAGE_CACHE_HELP + " (default: off; 4M for demo)",
    )
    chat.add_argument(
        "--mode", choices=MODES, default=None, help="default: the last one used, else on-demand"
    )
    _add_exact(chat)
    _add_adapters(chat)
    chat.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="where chats and trained adapters live (default: $EDGE0_DATA_DIR, else the user "
        "data dir)",
    )
    serve = commands.add_parser(
        "serve", help="an OpenAI-compatible HTTP server, with the memory wall at /metrics"
    )
    serve.add_argument(
        "model", help="checkpoint directory, Hugging Face repo id, or demo (the model's id)"
    )
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: loopback only)"
    )
    serve.add_argument("--port", type=_port, default=8080, help="0 picks a free port")
    serve.add_argument("--mode", choices=MODES, default="on-demand")
    serve.add_argument("--k", type=int, default=None, help="routing width (default: the model's)")
    serve.add_argument(
        "--expert-cache",
        type=_size,
        default=None,
        metavar="SIZE",
        help="routed-expert budget, e.g. 512M, 2G (default 1G; 4M for demo, as the chat)",
    )
    serve.add_argument(
        "--page-cache",
        type=_page_cache,
        default=None,
        metavar="SIZE|off",
        help=PAGE_CACHE_HELP + " (default: off; 4M for demo, as the chat)",
    )
    serve.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        metavar="KEY",
        help=f"require `Authorization: Bearer KEY` on /v1 and /metrics (default: ${API_KEY_ENV})",
    )
    serve.add_argument(
        "--queue-limit",
        type=_count(0),
        default=16,
        metavar="N",
        help="requests that may wait behind the one generating; more get 429 (default 16)",
    )
    _add_exact(serve)
    _add_adapters(serve)
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    from engine import NO_TRACE, Engine, Tracer

    config = EngineConfig(
        mode=args.mode,
        expert_cache_bytes=args.expert_cache,
        page_cache_bytes=None if args.page_cache == "off" else args.page_cache,
        eviction=args.eviction,
        k=args.k,
        lora=not args.no_lora,
        shadow_router=args.shadow_router,
        exact_kernels=args.exact,
        adapter_dirs=_adapter_dirs(args.adapters),
        data_dir=_data_dir(),
    )
    gen = GenerationConfig(
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    tracer = Tracer() if args.trace is not None else NO_TRACE
    with Engine(args.model, config, tracer=tracer) as engine:
        _print_warnings(engine.warnings)
        if note := engine.quality_note():
            print(f"edge0: note: {note}", file=sys.stderr)
        # Like mlx_lm.generate: the chat template when the tokenizer has one, unless --raw.
        chat = not args.raw and engine.tokenizer.has_chat_template
        prompt = engine.encode(args.prompt, chat=chat)
        printed = 0

        def stream(token: int, step) -> None:
            nonlocal printed
            if args.json:
                return
            result_tokens.append(token)
            text = engine.reply_text(result_tokens)
            # A token may end inside a multi-byte character: hold it back until it completes.
            stable = len(text.rstrip("\ufffd"))
            sys.stdout.write(text[printed:stable])
            sys.stdout.flush()
            printed = stable

        result_tokens: list[int] = []
        try:
            result = engine.generate(prompt, gen, on_token=stream)
        finally:
            if tracer.enabled:  # also the steps before a failure: they may show why
                write_trace(tracer, args.trace)
        engine_k = engine.k
    if args.json:
        print(
            json.dumps(
                {
                    "mode": args.mode,
                    "k": engine_k,
                    "prompt_tokens": result.prompt_tokens,
                    "tokens": result.tokens,
                    "text": result.text,
                    "stopped_by": result.stopped_by,
                    "steps": [s.as_dict() for s in result.steps],
                    "summary": result.summary,
                }
            )
        )
    else:
        print(result.text[printed:], flush=True)  # before the summary on stderr
        print(summary_line(result.summary), file=sys.stderr)
    if repaired := result.summary.get("nonfinite_repaired", 0):
        # The guard kept the reply going, but a reply that needed repair is not to be trusted.
        _print_warnings(
            [
                f"{repaired} NaN or overflowing hidden values were repaired while generating this "
                "reply; the output may be garbage (numerically broken weights or adapters?)"
            ]
        )
    return 0


def write_trace(tracer, path: Path) -> None:
    events = tracer.events
    try:
        tracer.write(path, events)
    except OSError as e:
        raise Edge0Error(f"{path}: cannot write the trace ({e.strerror or e})") from None
    print(f"edge0: trace written to {path} (open it in https://ui.perfetto.dev)", file=sys.stderr)
    from engine import compute_waits, largest_waits

    waits = compute_waits(events)
    if waits is not None and waits.steps:
        print(
            f"edge0: MLX compute waited {waits.waited_ms:.1f} of a {waits.step_ms:.1f} ms decode "
            f"step; the engine thread meanwhile (ms a step): {largest_waits(waits.by_engine_span)}",
            file=sys.stderr,
        )


def _print_warnings(warnings: list[str]) -> None:
    for warning in warnings:
        print(f"edge0: warning: {warning}", file=sys.stderr)


def summary_line(s: dict) -> str:
    prerouter = ""
    if s.get("median_predicted"):
        prerouter = (
            f" | prerouter: {s['median_predicted']:.0f} layers predicted, "
            f"{s['median_prefetch_issued']:.0f} reads ahead/step "
            f"({s['median_prefetch_in_time']:.0f} in time, {s['median_prefetch_late']:.0f} late), "
            f"dropped {s['dropped']}"
        )
        if "shadow_recall" in s:
            prerouter += f", recall {s['shadow_recall']:.2f}"
    if "prefetch_hit_rate" in s:
        prerouter = (
            f" | prefetch: {s['median_prefetch_issued']:.0f} reads ahead/step, "
            f"{s['prefetch_hit_rate']:.0%} of routed experts were read ahead"
        )
    return (
        f"[{s['prompt_tokens']} prompt tokens, TTFT {s['ttft_ms']:.0f} ms, "
        f"prefill {s['prefill_tok_per_s']:.1f} tok/s | decode {s['decode_tok_per_s']:.2f} tok/s, "
        f"blocked {s['median_blocked_ms']:.1f} ms/step, {s['median_loads']:.0f} loads/step, "
        f"{s['median_mib_read']:.1f} MiB/step, cold {s['median_cold_fraction']:.0%} | "
        f"peak MLX {format_bytes(s['peak_mlx_bytes'])}, RSS {format_bytes(s['peak_rss_bytes'])}"
        f"{prerouter}]"
    )


def cmd_bench(args: argparse.Namespace) -> int:
    from engine import check_checkpoint
    from engine.measure.bench import DEFAULT_PROMPT, BenchConfig, markdown, run_bench, terminal_plot

    check_checkpoint(args.model)  # in this process: the arms' processes would each say it again
    prompt = DEFAULT_PROMPT
    if args.prompt_file is not None:
        prompt = _read_text(args.prompt_file, "the prompt")
    config = BenchConfig(
        model=args.model,
        arms=[a.strip() for a in args.arms.split(",") if a.strip()],
        k=args.k,
        rounds=args.rounds,
        tokens=args.tokens,
        prompt=prompt,
        expert_cache_bytes=args.expert_cache,
        ram_limit_bytes=args.ram_limit,
        # A throttle acts on cold reads only: with a warm page cache it would measure nothing.
        cold=args.cold or (args.read_limit is not None and not args.warm),
        read_limit_bps=args.read_limit,
        read_limit_by=args.read_limit_by,
        trace_dir=args.trace,
        exact_kernels=args.exact,
        adapter_dirs=_adapter_dirs(args.adapters),
        data_dir=_data_dir(),
    )
    if args.trace is not None:
        try:
            args.trace.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise Edge0Error(
                f"{args.trace}: cannot make the trace folder ({e.strerror or e})"
            ) from None
    report = run_bench(config, progress=lambda line: print(line, file=sys.stderr, flush=True))
    table = markdown(report)
    print(table)
    print(terminal_plot(report))
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=1))
    if args.markdown:
        args.markdown.write_text(table)
    return 0


def cmd_soak(args: argparse.Namespace) -> int:
    from engine.measure.soak import soak

    config = EngineConfig(mode=args.mode, expert_cache_bytes=args.expert_cache)
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else print
    report = soak(args.model, config, args.turns, args.steps, progress=log, fresh=args.fresh)
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"{report['decode_steps']} decode steps: MLX active drift {report['mlx_active_drift']:+.1%} "
            f"({report['mlx_active_without_kv_drift']:+.1%} without the growing KV cache), "
            f"RSS drift {report['rss_drift']:+.1%} (after warm-up -> end), threads "
            f"{report['thread_growth']:+d}, open files {report['open_file_growth']:+d}"
        )
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from engine import Engine

    config = EngineConfig(
        mode="on-demand", adapter_dirs=_adapter_dirs(args.adapters), data_dir=_data_dir()
    )
    with Engine(args.model, config) as engine:
        info = engine.info()
        search = engine.adapter_search
    info["adapter_folders"] = [{"path": str(f.path), "origin": f.origin} for f in search.folders]
    for p in info["profiles"]:
        files = search.profiles.get(p["k"])
        p["origin"] = files.origin if files is not None else None
        p["files"] = [str(f) for f in (files.prerouter, files.lora) if f] if files else []
    info["shadowed"] = [
        {"k": f.k, "origin": f.origin, "files": [str(x) for x in (f.prerouter, f.lora) if x]}
        for f in search.shadowed
    ]
    _print_warnings(info["warnings"])
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"{info['model']}: {info['family']}, {info['layers']} layers ({info['moe_layers']} MoE)")
    print(f"  {info['family_description']}; modes: {', '.join(info['family_modes'])}")
    print(f"  experts stored {info['expert_format']}")
    print(
        f"  {info['experts']} routed experts per layer, native K={info['native_k']}, hidden {info['hidden']}"
    )
    print(
        f"  routed-expert bytes {format_bytes(info['expert_bytes'])}, fingerprint {info['fingerprint']}"
    )
    print(f"  BLAS: {info['blas']['text']}; prefill experts: {info['prefill_kernels']}")
    for p in info["profiles"]:
        parts = [name for name in ("prerouter", "lora") if p[name]]
        quality = "recovered" if p["recovered"] else "quality not recovered"
        where = f", {p['origin']} folder: {', '.join(p['files'])}" if p["files"] else ""
        print(f"  K={p['k']}: {' + '.join(parts) or 'true router'} ({quality}{where})")
    for s in info["shadowed"]:
        print(f"  K={s['k']} shadowed (an earlier folder has K={s['k']}): {', '.join(s['files'])}")
    for folder in info["adapter_folders"]:
        print(f"  adapters searched: {folder['origin']} {folder['path']}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    if args.phase == "corpus":
        return cmd_train_corpus(args)
    if args.phase == "base":
        return cmd_train_base(args)
    if args.phase in ("lora", "distill"):
        return cmd_train_lora_or_distill(args)
    from engine.train.heads import TrainHeadsConfig, train_heads

    text = _read_text(args.text) if args.text is not None else None
    config = TrainHeadsConfig(
        k=args.k,
        start_layer=args.start_layer,
        steps=args.steps,
        max_tokens=args.max_tokens,
        window=args.window,
    )
    engine_config = EngineConfig(expert_cache_bytes=args.expert_cache, data_dir=_data_dir())
    train_heads(
        args.model,
        text,
        config,
        out=args.out,
        progress=lambda line: print(line, flush=True),
        engine_config=engine_config,
        adapters_dir=args.adapters,
        bar=sys.stderr.isatty(),
    )
    return 0


def cmd_train_corpus(args: argparse.Namespace) -> int:
    from engine.train.corpus import write_split_texts

    split = write_split_texts(args.out)
    print(
        f"wrote {args.out / 'train.txt'} ({len(split.train)} works) and "
        f"{args.out / 'held_out.txt'} (held out: {', '.join(split.held_out)})"
    )
    return 0


def cmd_train_base(args: argparse.Namespace) -> int:
    from engine.train.base import TrainBaseConfig, train_base

    config = TrainBaseConfig(seed=args.seed)
    if args.steps is not None:
        config.steps = args.steps
    train_base(args.out, config, resume=args.resume, progress=lambda line: print(line, flush=True))
    return 0


def _read_text(path: Path, what: str = "text") -> str:
    if path.exists() and not path.is_file():  # a FIFO would block forever, a device never end
        raise Edge0Error(f"{path}: cannot read {what} (not a regular file)")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise Edge0Error(f"{path}: cannot read {what} ({e})") from None


def cmd_train_lora_or_distill(args: argparse.Namespace) -> int:
    extra = {}
    if args.phase == "lora":
        from engine.train.lora import TrainLoRAConfig as Config
        from engine.train.lora import train_lora as train

        config = Config(k=args.k, rows=args.generate, steps=args.steps)
        extra["rows_path"] = args.rows
        if args.batch is not None:
            config.batch = args.batch
    else:
        from engine.train.distill import TrainDistillConfig as Config
        from engine.train.distill import train_distill as train

        config = Config(k=args.k, steps=args.steps)
        if args.batch is not None:
            config.prompts_per_step = args.batch
    if args.lr is not None:
        config.lr = args.lr
    train(
        args.model,
        args.teacher,
        _read_text(args.text),
        config,
        out=args.out,
        out_dir=args.out_dir,
        log=lambda line: print(line, flush=True),
        bar=sys.stderr.isatty(),
        engine_config=EngineConfig(adapter_dirs=_adapter_dirs(args.adapters), data_dir=_data_dir()),
        **extra,
    )
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from engine.measure.evaluate import EvalConfig, evaluate, format_report

    config = EvalConfig(
        k=args.k,
        mode=args.mode,
        lora=not args.no_lora,
        max_tokens=args.max_tokens,
        samples=args.samples,
        exact_kernels=args.exact,
        adapter_dirs=_adapter_dirs(args.adapters),
        data_dir=_data_dir(),
    )
    log = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    report = evaluate(args.model, _read_text(args.text), config, log=log)
    print(json.dumps(report) if args.json else format_report(report))
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    if args.from_model is not None:
        return _synth_from(args)
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
    heads = args.heads if args.heads is not None else ("4" if preset == "wall" else "")
    for k in [int(k) for k in heads.split(",") if k.strip()]:
        _quick_heads(out, k)
    return 0


def _synth_from(args: argparse.Namespace) -> int:
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


def cmd_chat(args: argparse.Namespace) -> int:
    # Imported here so that the other commands never import Textual.
    from platformdirs import user_config_path

    from edge0_tui.app import DEFAULT_SETTINGS, Edge0App
    from edge0_tui.model_source import check_model
    from edge0_tui.preferences import KeptPreferences, PreferenceStore, model_key

    # A model that cannot be opened is a one-line error here, not a notification in an app.
    check_model(args.model)

    # What the user chose for this model last time; the command line wins for this run.
    store = PreferenceStore(_config_dir() or user_config_path("edge0"))
    key = model_key(args.model)
    kept = KeptPreferences(
        store,
        key,
        store.load(key, DEFAULT_SETTINGS),
        mode_from_command_line=args.mode is not None,
    )
    stored = kept.current
    # The demo model's experts are ~13 MB in all and its file fits any page cache: a 4 MB expert
    # cache and a 4 MB page-cache budget make the memory wall visible (cold reads every step).
    demo = args.model == "demo"
    mode = args.mode or "on-demand"  # a kept mode is applied once the model is loaded
    expert_cache = (
        args.expert_cache or stored.expert_cache_bytes or parse_size("4M" if demo else "1G")
    )
    page_cache = getattr(args, "page_cache", stored.page_cache)
    if mode == "resident" and not hasattr(args, "page_cache"):
        page_cache = "off"  # every expert is read into memory at start: no page cache to budget
    if page_cache is None:  # neither given nor kept
        page_cache = parse_size("4M") if demo and mode != "resident" else "off"
    data_dir = args.data_dir or _data_dir()  # one folder for chats and trained adapters
    config = EngineConfig(
        mode=mode,
        expert_cache_bytes=expert_cache,
        page_cache_bytes=None if page_cache == "off" else page_cache,
        exact_kernels=args.exact,
        adapter_dirs=tuple(args.adapters),  # the session fetches Hub repos on its thread
        data_dir=data_dir,
    )
    Edge0App(model=args.model, engine_config=config, data_dir=data_dir, preferences=kept).run()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """`edge0 serve`: the model loads on the engine thread while the server already answers
    (503 until it is ready); SIGINT or SIGTERM stops it."""
    from platformdirs import user_cache_path

    from edge0_tui.model_source import check_model
    from edge0_tui.server import open_engine_for, serve_model

    check_model(args.model)  # a one-line error before anything listens
    if args.api_key is not None and not args.api_key.strip():
        raise Edge0Error("--api-key is empty")
    # The demo as the chat serves it: a 4 MB expert cache and page-cache budget show the wall.
    demo = args.model == "demo"
    expert_cache = args.expert_cache or parse_size("4M" if demo else "1G")
    page_cache = args.page_cache
    if page_cache is None:
        page_cache = parse_size("4M") if demo and args.mode != "resident" else "off"
    config = EngineConfig(
        mode=args.mode,
        expert_cache_bytes=expert_cache,
        page_cache_bytes=None if page_cache == "off" else page_cache,
        k=args.k,
        exact_kernels=args.exact,
        adapter_dirs=tuple(args.adapters),  # Hub repos are fetched on the engine thread
        data_dir=_data_dir(),
    )
    open_engine = open_engine_for(args.model, config, user_cache_path("edge0"))
    serve_model(
        args.model,
        open_engine,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        queue_limit=args.queue_limit,
    )
    return 0


STDOUT_CLOSED = "stdout is closed (use >/dev/null to discard output)"


class StdoutError(Edge0Error):
    """stdout cannot take the command's output (a full device, a descriptor closed under us)."""


class _CheckedStdout:
    """sys.stdout while a command runs: a write or flush that fails is a one-line `StdoutError`
    instead of an OSError traceback. BrokenPipeError passes through as it is: the reader went away
    (`| head`), which is not an error."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise StdoutError(f"cannot write to stdout ({e.strerror or e})") from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as e:
            raise StdoutError(f"cannot write to stdout ({e.strerror or e})") from None

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _run_checked(handler, args: argparse.Namespace) -> int:
    """Run a command with stdout checked, and flush it before returning: output still buffered
    would otherwise fail in the interpreter's exit flush, after every handler here is gone."""
    stdout, sys.stdout = sys.stdout, _CheckedStdout(sys.stdout)
    try:
        status = handler(args)
        sys.stdout.flush()
        return status
    finally:
        sys.stdout = stdout


def _discard_stdout() -> None:
    """Point stdout's descriptor at /dev/null once stdout has failed: the output still in its
    buffer then goes nowhere instead of failing again (with a message) when Python exits."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a real file (tests capture stdout in memory): nothing to flush at exit
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    stdout = sys.stdout
    try:  # --help and --version write to stdout; argparse ignores an OSError there, not this
        if stdout is not None:
            sys.stdout = _CheckedStdout(stdout)
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:
            if e.code == 0 and stdout is not None:  # (with stdout closed, argparse uses stderr)
                sys.stdout.flush()
            raise
    except StdoutError as e:
        _discard_stdout()
        print(f"edge0: error: {e}", file=sys.stderr)
        return 2
    finally:
        sys.stdout = stdout
    if args.command is None:
        args = parser.parse_args(["chat"])
    if sys.stdout is None:  # started with stdout closed (`>&-`): Python then has no sys.stdout
        print(f"edge0: error: {STDOUT_CLOSED}", file=sys.stderr)
        return 2
    handlers = {
        "chat": cmd_chat,
        "generate": cmd_generate,
        "info": cmd_info,
        "bench": cmd_bench,
        "soak": cmd_soak,
        "train": cmd_train,
        "synth": cmd_synth,
        "eval": cmd_eval,
        "serve": cmd_serve,
    }
    handler = handlers[args.command]
    try:
        if args.command == "chat":
            return handler(args)  # the app draws on the terminal itself
        return _run_checked(handler, args)
    except StdoutError as e:
        _discard_stdout()
        print(f"edge0: error: {e}", file=sys.stderr)
        return 2
    except Edge0Error as e:
        print(f"edge0: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        _discard_stdout()  # quietly, as Unix tools stop when their reader goes away
        return BROKEN_PIPE_STATUS
    except KeyboardInterrupt:
        return 130


def entry() -> int:
    """The `edge0` command: `main` in a process of its own. On Linux every command first
    re-executes itself once with a fast BLAS preloaded (`engine.runtime.blas`: MLX's bundled one is
    10-20x slower for dense products); only the command may replace its process, so this is not
    in `main`, which tests call in-process."""
    from engine import preload_fast_blas

    preload_fast_blas()
    return main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(entry())
