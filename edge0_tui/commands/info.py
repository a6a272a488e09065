"""`edge0 info`: a checkpoint's family, layers, experts, expert bytes and K profiles.

`edge0 info OWNER/NAME --memory` for a Hub repo with no copy here plans it without downloading
it: from its config.json, safetensors index and shard headers (`engine.plan_hub_model`), the
plan printed as for a local copy."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import TYPE_CHECKING

from edge0_tui.commands import options
from edge0_tui.commands.common import print_warnings
from engine import Edge0Error, format_bytes

if TYPE_CHECKING:
    from edge0_tui.machine_speed import MeasuredSpeed
    from engine import MemoryPlan
    from engine.measure.speed_estimate import DecodeEstimate

NAME = "info"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(NAME, help="family, layers, experts, expert bytes, K profiles")
    options.add_model(parser)
    parser.set_defaults(resolve_model=False)  # `run` resolves it: a Hub repo may be planned
    options.add_adapters(parser)
    parser.add_argument(
        "--memory",
        action="store_true",
        help="the memory plan of a run with these options: every term, the total, and what "
        "this machine (or its memory cgroup) leaves",
    )
    options.add_mode(parser)
    options.add_k(parser)
    options.add_expert_cache(
        parser, default=options.AUTO, auto=True, metavar="SIZE|auto", help="as for generate"
    )
    options.add_exact(parser)
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from edge0_tui.model_source import needs_hub_plan
    from engine import Engine

    if args.memory and needs_hub_plan(args.model):
        return _run_hub_plan(args)
    args.model = options.model_path(args.model)
    # A plan that does not fit is shown, not refused.
    config = options.engine_config(args, refuse_over_plan=False)
    with Engine(args.model, config) as engine:
        info = engine.info()
        search = engine.adapter_search
        plan = engine.memory_plan
    info["memory_plan"] = plan.as_dict()
    info["adapter_folders"] = [{"path": str(f.path), "origin": f.origin} for f in search.folders]
    for p in info["profiles"]:
        files = search.profiles.get(p["k"])
        p["origin"] = files.origin if files is not None else None
        p["files"] = [str(f) for f in (files.prerouter, files.lora) if f] if files else []
    info["shadowed"] = [
        {"k": f.k, "origin": f.origin, "files": [str(x) for x in (f.prerouter, f.lora) if x]}
        for f in search.shadowed
    ]
    print_warnings(info["warnings"])
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
    if args.memory:
        _print_plan(args, plan)
        print(speed_line(args.mode, plan, info["expert_bytes"], info["experts"]))
    else:
        print(f"  {plan.line()}")
    return 0 if plan.fits or not args.memory else 2


def _print_plan(args: argparse.Namespace, plan: MemoryPlan) -> None:
    cache = args.expert_cache if args.expert_cache == options.AUTO else "as given"
    print(f"memory plan ({args.mode}, K={plan.k}, expert cache {cache}):")
    print(plan.table())


def _run_hub_plan(args: argparse.Namespace) -> int:
    """The memory plan of a Hub repo from its headers: what the model is, and the plan."""
    from engine import plan_hub_model

    config = options.engine_config(args, refuse_over_plan=False)
    planned = plan_hub_model(args.model, config)
    if args.json:
        report = {**planned.__dict__, "model": args.model}
        report.pop("plan")
        estimate = speed_estimate(args.mode, planned.plan, planned.expert_bytes, planned.experts)
        speed = {**asdict(estimate[0]), "measured": asdict(estimate[1])} if estimate else None
        print(json.dumps({**report, "memory_plan": planned.plan.as_dict(), "speed": speed}))
        return 0 if planned.plan.fits else 2
    print(
        f"{args.model}: {planned.family}, {planned.layers} layers ({planned.moe_layers} MoE), "
        f"planned from the Hub's headers ({format_bytes(planned.bytes_read)} read of "
        f"{format_bytes(planned.checkpoint_bytes)}; nothing downloaded)"
    )
    print(
        f"  {planned.experts} routed experts per layer, native K={planned.native_k}, "
        f"hidden {planned.hidden}"
    )
    print(f"  routed-expert bytes {format_bytes(planned.expert_bytes)}")
    _print_plan(args, planned.plan)
    print(speed_line(args.mode, planned.plan, planned.expert_bytes, planned.experts))
    return 0 if planned.plan.fits else 2


NO_SPEED = "expected speed: run `edge0 doctor` for a speed estimate"


def speed_estimate(
    mode: str, plan: MemoryPlan, expert_bytes: int, experts: int
) -> tuple[DecodeEstimate, MeasuredSpeed] | None:
    """The decode speed `plan` leads to with the doctor's figures for this machine (None: the
    doctor has not run here). A token computes through the resident weights and K routed
    experts a MoE layer; the expert cache holds its share of all the routed experts (a uniform
    routing's hit share: a real model's skewed routing hits more)."""
    from platformdirs import user_data_path

    from edge0_tui.machine_speed import load_speed
    from engine.measure.speed_estimate import estimate_decode_speed

    measured = load_speed(options.data_dir() or user_data_path("edge0"))
    if measured is None or not experts:
        return None
    resident = mode == "resident"
    dense = plan.resident_bytes - (expert_bytes if resident else 0)
    per_token = expert_bytes * plan.k // experts
    hit = 1.0 if resident else plan.expert_cache_bytes / max(expert_bytes, 1)
    return estimate_decode_speed(dense, per_token, hit, measured.speed), measured


def speed_line(mode: str, plan: MemoryPlan, expert_bytes: int, experts: int) -> str:
    """`expected speed at K=...`: cold and warm tokens a second, and where the figures are from;
    or what to run for them. A speed file that cannot be read says so, and why."""
    try:
        found = speed_estimate(mode, plan, expert_bytes, experts)
    except Edge0Error as e:
        return f"{NO_SPEED} ({e})"
    if found is None:
        return NO_SPEED
    estimate, measured = found
    source = f"from edge0 doctor on {measured.machine}, {measured.date}"
    if mode == "resident":
        return f"expected speed at K={plan.k}: {_rate(estimate.warm_tok_per_s)} tok/s ({source})"
    disk = measured.speed.disk_bytes_per_s
    return (
        f"expected speed at K={plan.k} (on-demand): {_rate(estimate.cold_tok_per_s)} tok/s cold "
        f"(every routed expert read: {format_bytes(estimate.expert_bytes_per_token)} a token at "
        f"{format_bytes(disk)}/s), {_rate(estimate.warm_tok_per_s)} tok/s warm (the expert cache "
        f"holds {estimate.hit_share:.0%} of the experts) ({source})"
    )


def _rate(tok_per_s: float) -> str:
    """Tokens a second, with two decimals below one (a slow model is not all "0.0")."""
    return f"{tok_per_s:.1f}" if tok_per_s >= 1 else f"{tok_per_s:.2f}"
