"""Micro-benchmarks behind engine design choices; each prints figures, none asserts a speed.

    python -m engine.measure.microbench compute   [--hidden 512] [--moe-int 256] [--k 8] [--rounds 7]
    python -m engine.measure.microbench eviction MODEL [--tokens 200] [--budgets 0.1,0.25,0.5]
    python -m engine.measure.microbench products  [--hidden 256] [--moe-int 6144] [--tokens 1,4,16,64,256]
    python -m engine.measure.microbench prefill MODEL [--prompt-tokens 256] [--chat] [--modes ...]
                                            [--expert-cache SIZE] [--page-cache SIZE]
    python -m engine.measure.microbench formats   [--shapes gpt-oss-120b,wall] [--hidden H --moe-int W]
                                            [--rows 16,64] [--repeats 5] [--copies N] [--dtype bfloat16]

One module per benchmark, each saying what it measures: `compute` (microbench_compute),
`eviction` (microbench_eviction), `products` (microbench_products), `prefill` (microbench_prefill),
`formats` (microbench_formats). This module is the command line, and the child processes'
entry (`products --child`, `prefill-child`, `formats-child`).
"""

from __future__ import annotations

import argparse
import json

from .microbench_compute import bench_compute
from .microbench_eviction import bench_eviction
from .microbench_formats import EXPERT_SHAPES, bench_formats, formats_child
from .microbench_prefill import bench_prefill, prefill_child
from .microbench_products import bench_products, product_times


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.measure.microbench")
    sub = parser.add_subparsers(dest="what", required=True)
    c = sub.add_parser("compute")
    c.add_argument("--hidden", type=int, default=512)
    c.add_argument("--moe-int", type=int, default=256)
    c.add_argument("--k", type=int, default=8)
    c.add_argument("--slots", type=int, default=16)
    c.add_argument("--rounds", type=int, default=7)
    p = sub.add_parser("products")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--moe-int", type=int, default=6144)
    p.add_argument("--tokens", default="1,2,4,16,64,256")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    f = sub.add_parser("prefill")
    f.add_argument("model")
    f.add_argument("--prompt-tokens", type=int, default=256)
    f.add_argument("--decode-tokens", type=int, default=16)
    f.add_argument("--modes", default="resident,on-demand")
    f.add_argument("--rounds", type=int, default=3)
    f.add_argument("--chat", action="store_true", help="the prompt as one chat turn")
    f.add_argument("--expert-cache", default="1G", help="streamed modes' expert budget")
    f.add_argument("--page-cache", default=None, help="streamed modes' page-cache budget")
    child = sub.add_parser("prefill-child")
    child.add_argument("spec")
    m = sub.add_parser("formats")
    m.add_argument(
        "--shapes", default=",".join(EXPERT_SHAPES), help="of " + ", ".join(EXPERT_SHAPES)
    )
    m.add_argument("--hidden", type=int, default=None, help="with --moe-int: this shape instead")
    m.add_argument("--moe-int", type=int, default=None)
    m.add_argument("--rows", default="16,64", help="prefill rows routed to the expert")
    m.add_argument("--repeats", type=int, default=5)
    m.add_argument("--copies", type=int, default=None, help="distinct experts (default: 64 MiB)")
    m.add_argument("--dtype", default="bfloat16", help="affine scales and biases, and the weights")
    mchild = sub.add_parser("formats-child")
    mchild.add_argument("spec")
    e = sub.add_parser("eviction")
    e.add_argument("model")
    e.add_argument("--tokens", type=int, default=200)
    e.add_argument("--budgets", default="0.1,0.25,0.5")
    args = parser.parse_args()
    if args.what == "compute":
        bench_compute(args.hidden, args.moe_int, args.k, args.slots, args.rounds)
    elif args.what == "products":
        tokens = [int(t) for t in args.tokens.split(",")]
        if args.child:
            from ..runtime.blas import blas_in_use

            ms = product_times(args.hidden, args.moe_int, tokens)
            print(json.dumps({"blas": blas_in_use().describe(), "ms": ms}))
        else:
            bench_products(args.hidden, args.moe_int, tokens, args.rounds)
    elif args.what == "prefill":
        bench_prefill(args)
    elif args.what == "prefill-child":
        print(json.dumps(prefill_child(json.loads(args.spec))))
    elif args.what == "formats":
        if (args.hidden is None) != (args.moe_int is None):
            parser.error("formats: --hidden and --moe-int go together")
        unknown = set(args.shapes.split(",")) - set(EXPERT_SHAPES)
        if unknown:
            parser.error(f"formats: unknown shape {', '.join(sorted(unknown))}")
        bench_formats(args)
    elif args.what == "formats-child":
        print(json.dumps(formats_child(json.loads(args.spec))))
    else:
        bench_eviction(args.model, args.tokens, [float(b) for b in args.budgets.split(",")])


if __name__ == "__main__":
    from ..runtime.open_file_limit import fit_mlx_lm_to_the_open_file_limit

    fit_mlx_lm_to_the_open_file_limit()
    main()
