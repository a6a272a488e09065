"""`edge0 bench`: a same-session rotated A/B of modes on this machine."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from edge0_tui.commands import options
from edge0_tui.commands.common import print_stderr, read_text
from engine import Edge0Error

NAME = "bench"
# The longest --prompt-file read: far beyond any context a desk run holds (a prompt of a million
# characters is ~250k tokens), and a bound on what a mistaken file (a disk image) costs.
MAX_PROMPT_CHARS = 1 << 20


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(NAME, help="same-session rotated A/B of modes on this machine")
    options.add_model(parser)
    parser.add_argument(
        "--arms",
        default="resident,on-demand,prerouter",
        help="comma-separated (default: resident,on-demand,prerouter): resident, on-demand, prefetch, prerouter, compute-only (every expert "
        "resident before the replay, no limits: the compute a step cannot go below, for the "
        "overlap-limit table; needs every expert in memory), compute-only:MODE (that mode so: "
        "what it costs a step with nothing to read), MODE+lookup (resident, on-demand or "
        "prefetch with speculative decoding: prompt-lookup drafts verified in one forward; "
        "then every arm decodes greedily instead of replaying sampled tokens, and the report "
        "says whether all gave the same tokens, as they must), MODE@N (a streamed mode as N ranks on this "
        "machine, each with its share of the experts; see --hosts)",
    )
    parser.add_argument(
        "--hosts",
        type=options.count(2),
        default=None,
        metavar="N",
        help="beside each streamed arm, the same mode as N ranks on this machine (MODE@N): "
        "tok/s against one process, the ranks' sum per layer, each rank's waits and reads",
    )
    options.add_k(parser, help=None)
    parser.add_argument("--rounds", type=options.count(1), default=3)
    parser.add_argument("--tokens", type=options.count(1), default=64)
    parser.add_argument("--prompt-file", type=Path, default=None)
    options.add_expert_cache(
        parser,
        default=None,
        auto=True,
        help='e.g. 112M, or "auto": what each arm\'s memory plan leaves (default: auto; 4M for the '
        "bundled demo, as the chat)",
    )
    options.add_page_cache(
        parser,
        help=options.PAGE_CACHE_HELP + " (default: off; 4M for the bundled demo, as the chat)",
    )
    parser.add_argument("--ram-limit", type=options.size, default=None)
    parser.add_argument(
        "--read-limit",
        type=options.positive_size,
        default=None,
        metavar="BW",
        help="throttle each arm's disk reads to BW per second, e.g. 100M (Linux cgroups); "
        "implies --cold unless --warm",
    )
    parser.add_argument(
        "--read-limit-by",
        choices=("cgroup", "pacing"),
        default="cgroup",
        help="how --read-limit is applied: the kernel's throttle (Linux; lets an idle reader "
        "burst above the limit) or pacing in edge0's reader threads (any OS; one device of that "
        "bandwidth for cold bytes, no bursts)",
    )
    parser.add_argument(
        "--sync-cost",
        type=options.sync_cost,
        default=0.0,
        metavar="DURATION",
        help="each host read of a device array waits DURATION more (e.g. 1ms): a model of the "
        "GPU queue drain each such wait costs on Metal (default: 0)",
    )
    parser.add_argument(
        "--trace",
        type=Path,
        default=None,
        metavar="DIR",
        help="write each arm's step timeline to DIR/<arm>-round<N>.json (Perfetto)",
    )
    warmth = parser.add_mutually_exclusive_group()
    warmth.add_argument("--cold", action="store_true", help="evict the checkpoint before each arm")
    warmth.add_argument(
        "--warm",
        action="store_true",
        help="read the checkpoint once first (default, except with --read-limit)",
    )
    options.add_exact(parser)
    options.add_adapters(parser)
    parser.add_argument("--json", type=Path, default=None, dest="json_out")
    parser.add_argument("--markdown", type=Path, default=None)


def run(args: argparse.Namespace) -> int:
    from edge0_tui.model_source import is_bundled_demo
    from edge0_tui.model_start import default_budgets
    from engine import check_checkpoint
    from engine.measure.bench import DEFAULT_PROMPT, BenchConfig, run_bench
    from engine.measure.bench_arms import with_ranked_twins
    from engine.measure.bench_markdown import markdown, terminal_plot

    check_checkpoint(args.model)  # in this process: the arms' processes would each say it again
    check_outputs(args)  # before the run: its results are written only at the end
    # The bundled demo fits any page cache: the chat's small budgets make its wall (cold reads).
    # (Its resident arm runs without the page-cache budget, and the report says so.)
    default_cache, default_page_cache = default_budgets(is_bundled_demo(args.model), "on-demand")
    expert_cache = args.expert_cache or default_cache
    page_cache = args.page_cache or default_page_cache
    prompt = DEFAULT_PROMPT
    if args.prompt_file is not None:
        prompt = read_prompt(args.prompt_file)
    config = BenchConfig(
        model=args.model,
        arms=with_ranked_twins([a.strip() for a in args.arms.split(",") if a.strip()], args.hosts),
        k=args.k,
        rounds=args.rounds,
        tokens=args.tokens,
        prompt=prompt,
        **options.expert_cache_config(expert_cache),
        page_cache_bytes=options.page_cache_bytes(page_cache),
        ram_limit_bytes=args.ram_limit,
        # A throttle acts on cold reads only: with a warm page cache it would measure nothing.
        cold=args.cold or (args.read_limit is not None and not args.warm),
        read_limit_bps=args.read_limit,
        read_limit_by=args.read_limit_by,
        sync_cost_s=args.sync_cost,
        trace_dir=args.trace,
        exact_kernels=args.exact,
        adapter_dirs=options.adapter_dirs(args.adapters),
        data_dir=options.data_dir(),
    )
    if args.trace is not None:
        try:
            args.trace.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise Edge0Error(
                f"{args.trace}: cannot make the trace folder ({e.strerror or e})"
            ) from None
    report = run_bench(config, progress=print_stderr)
    table = markdown(report)
    print(table)
    print(terminal_plot(report))
    if args.json_out:
        write_output(args.json_out, json.dumps(report, indent=1), "the JSON report")
    if args.markdown:
        write_output(args.markdown, table, "the markdown table")
    failed = [r for r in report["runs"] if not r["ok"]]
    if failed:
        # The table is printed; the status says it is not whole.
        print_stderr(f"edge0: {len(failed)} of {len(report['runs'])} arm runs failed (above)")
        return 1
    return 0


def read_prompt(path: Path) -> str:
    """--prompt-file, read only up to `MAX_PROMPT_CHARS` (one more, to tell a longer file)."""
    prompt = read_text(path, "the prompt", max_chars=MAX_PROMPT_CHARS + 1)
    if len(prompt) > MAX_PROMPT_CHARS:
        raise Edge0Error(f"{path}: the prompt is longer than {MAX_PROMPT_CHARS} characters")
    return prompt


def check_outputs(args: argparse.Namespace) -> None:
    """--json and --markdown name files that can be written (not a folder, not in a read-only
    one): found out after a whole run, the results were lost with a traceback."""
    from engine import check_output_file, check_output_folder

    for path, what in ((args.json_out, "the JSON report"), (args.markdown, "the markdown table")):
        if path is not None:
            check_output_file(path, what)
    if args.trace is not None:
        check_output_folder(args.trace, "the step timelines")


def write_output(path: Path, text: str, what: str) -> None:
    """One result file; a write that still fails (a full disk, /dev/full) is one line: the
    table is on stdout already."""
    try:
        path.write_text(text)
    except OSError as e:
        raise Edge0Error(f"{path}: cannot write {what} ({e.strerror or e})") from None
