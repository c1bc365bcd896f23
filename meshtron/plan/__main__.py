"""``python -m meshtron.plan --recipe R --gpus N [--gpus-per-node 8] [--gpu-memory 80] [--json]
[--section.key value ...]``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from meshtron.config import Config, ConfigError, infer_dp, load_config
from meshtron.parallel.data_parallel import gathers_once_per_step
from meshtron.parallel.layout import validate_layout
from meshtron.plan.memory import GIB
from meshtron.plan.muon import muon_work
from meshtron.plan.search import LayoutPlan, evaluate, rank_layouts, ranks_per_node
from meshtron.plan.speed import Hardware


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m meshtron.plan", description=__doc__)
    parser.add_argument("--recipe", required=True, help="TOML recipe (see recipes/)")
    parser.add_argument("--gpus", type=int, required=True, help="devices in the job")
    parser.add_argument("--gpus-per-node", type=int, default=Hardware.gpus_per_node)
    parser.add_argument("--gpu-memory", type=float, default=Hardware.memory_gib, help="GiB per device")
    parser.add_argument(
        "--mfu",
        type=float,
        default=Hardware.mfu,
        help="pin compute at this model FLOPs utilization (default: the GEMM-size model)",
    )
    parser.add_argument("--peak-tflops", type=float, default=Hardware.peak_tflops, help="per device, dense")
    parser.add_argument("--intra-gbps", type=float, default=Hardware.intra_gbps, help="GB/s inside a node")
    parser.add_argument("--inter-gbps", type=float, default=Hardware.inter_gbps, help="GB/s between nodes")
    parser.add_argument(
        "--host-link-gbps",
        type=float,
        default=Hardware.host_link_gbps,
        help="GB/s per direction between host and device (offload)",
    )
    parser.add_argument(
        "--host-memory", type=float, default=Hardware.host_memory_gib, help="GiB of host memory per node"
    )
    parser.add_argument(
        "--host-memory-gbps",
        type=float,
        default=Hardware.host_memory_gbps,
        help="GB/s of host memory bandwidth per rank (the offloaded optimizer step)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    return parser.parse_known_args(argv)


def hardware(args: argparse.Namespace) -> Hardware:
    return Hardware(
        gpus_per_node=args.gpus_per_node,
        memory_gib=args.gpu_memory,
        peak_tflops=args.peak_tflops,
        mfu=args.mfu,
        intra_gbps=args.intra_gbps,
        inter_gbps=args.inter_gbps,
        host_link_gbps=args.host_link_gbps,
        host_memory_gib=args.host_memory,
        host_memory_gbps=args.host_memory_gbps,
    )


def recipe_plan(cfg: Config, gpus: int, hw: Hardware) -> LayoutPlan | str:
    """The recipe's own layout on ``gpus`` devices, or why it cannot run there."""
    try:
        cfg = infer_dp(cfg, gpus)
        validate_layout(cfg, gpus)
    except ConfigError as err:
        return str(err)
    return evaluate(cfg, hw)


def _layout_text(plan: LayoutPlan) -> str:
    p = plan.cfg.parallel
    dims = dict(pp=p.pp, dp=p.dp, cp=p.cp, ep=p.mesh_ep, tp=p.tp)
    sizes = " x ".join(f"{k} {v}" for k, v in dims.items() if v > 1) or "1 rank"
    if p.fold_ep or p.etp > 1:  # the experts' own split of each stage
        sizes += f"; experts {'folded ' if p.fold_ep else ''}ep {p.ep} x etp {p.etp}"
    gather = " gathered per step" if p.pp == 1 and gathers_once_per_step(p) else ""
    extras = [
        p.data_parallel + gather,
        f"ac {p.activation_checkpointing}"
        + (f" {p.ac_policy}" if p.activation_checkpointing == "op" else "")
        + (f" {'+'.join(p.ac_parts)}" if p.ac_parts else ""),
        f"mb {p.microbatches}",
    ]
    if p.sp and p.tp > 1:
        extras.insert(0, "SP")
    if p.pp > 1:
        extras.append(p.schedule)
    offloaded = [
        what for what, on in (("optimizer", p.offload == "optimizer"), ("activations", p.offload_activations)) if on
    ]
    if offloaded:
        extras.append(f"offload {' + '.join(offloaded)}")
    return f"{sizes} ({', '.join(extras)})"


def breakdown_text(plan: LayoutPlan, hw: Hardware) -> list[str]:
    gib = plan.memory.gib()
    lines = [
        f"  {term:<16}{value:9.2f}{'  <- largest' if term == plan.memory.dominant else ''}"
        for term, value in gib.items()
    ]
    verdict = "fits" if plan.fits else "does NOT fit"
    lines.append(
        f"  {'total':<16}{plan.memory.total / GIB:9.2f}  {verdict} in {hw.memory_gib:g} GiB "
        f"(busiest pipeline rank {plan.memory.pp_rank}, peak in {plan.memory.phase})"
    )
    host = plan.memory.host_total
    ranks = ranks_per_node(plan.cfg, hw)
    lines.append(
        f"  host memory {host / GIB:.2f} GiB per rank, {ranks * host / GIB:.1f} GiB per node of "
        f"{hw.host_memory_gib:g} ({', '.join(f'{k} {v / GIB:.2f}' for k, v in plan.memory.host.items() if v)})"
    )
    t = plan.time
    lines.append(
        f"  step {t.seconds:.2f} s, {t.tokens_per_second:,.0f} tokens/s (compute {t.compute:.2f} s, "
        f"exposed communication {t.exposed_comm:.2f} s"
        + (
            f", of it host copies {t.exposed_by.get('host', 0.0):.2f} s, optimizer on the host {t.host_optimizer:.2f} s"
            if t.host_optimizer or "host" in t.exposed_by
            else ""
        )
        + (
            f", adding later micro-batches' gradients on the host {t.host_accumulate:.2f} s"
            if t.host_accumulate
            else ""
        )
        + f", pipeline bubble {t.bubble:.0%})"
    )
    muon = muon_work(plan.cfg)
    if muon.matrices:
        lines.append(
            f"  Muon: the busiest rank orthogonalizes {muon.matrices} matrices per step, "
            f"{muon.flops / 1e12:.2f} TFLOP of Newton–Schulz (not in the step time above)"
        )
    return lines


def ranking_text(plans: list[LayoutPlan]) -> list[str]:
    rows = [f"  {'#':>3}  {'layout':<52}{'GiB':>8}  {'fits':<5}{'step s':>8}{'tokens/s':>12}"]
    for i, plan in enumerate(plans, 1):
        rows.append(
            f"  {i:>3}  {_layout_text(plan):<52}{plan.memory.total / GIB:8.1f}  "
            f"{'yes' if plan.fits else 'no':<5}{plan.time.seconds:8.2f}{plan.time.tokens_per_second:12,.0f}"
        )
    return rows


def header(recipe: str, gpus: int, hw: Hardware) -> str:
    """Every hardware figure the predictions rest on, as the flags set them, so a misread flag shows."""
    compute = "GEMM-size compute model" if hw.mfu is None else f"MFU {hw.mfu:g}"
    return (
        f"{recipe} on {gpus} x {hw.memory_gib:g} GiB ({hw.gpus_per_node} per node), {compute} on "
        f"{hw.peak_tflops:g} TFLOP/s and {hw.memory_tbps:g} TB/s, {hw.intra_gbps:g} GB/s inside a node, "
        f"{hw.inter_gbps:g} between nodes; host: {hw.host_memory_gib:g} GiB per node, {hw.host_link_gbps:g} "
        f"GB/s to each device, {hw.host_memory_gbps:g} GB/s of memory per rank assumed"
    )


def report(recipe: str, cfg: Config, gpus: int, hw: Hardware, as_json: bool) -> str:
    own = recipe_plan(cfg, gpus, hw)
    ranked = rank_layouts(cfg, gpus, hw)
    if as_json:
        return json.dumps(
            {
                "recipe": recipe,
                "hardware": dataclasses.asdict(hw) | {"gpus": gpus},
                "recipe_layout": own.to_json() if isinstance(own, LayoutPlan) else {"error": own},
                "layouts": [plan.to_json() for plan in ranked],
            },
            indent=1,
        )
    lines = [header(recipe, gpus, hw), ""]
    if isinstance(own, LayoutPlan):
        lines += [f"recipe layout: {_layout_text(own)}, per-rank memory (GiB):"] + breakdown_text(own, hw)
    else:
        lines.append(f"recipe layout cannot run on {gpus} devices: {own}")
    lines += ["", f"layouts for {gpus} devices, fitting ones first, by predicted tokens/s:"] + ranking_text(ranked)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.gpus < 1 or args.gpus_per_node < 1 or args.gpu_memory <= 0:
            raise ConfigError("--gpus and --gpus-per-node must be >= 1 and --gpu-memory > 0.")
        cfg = load_config(args.recipe, overrides)
        print(report(args.recipe, cfg, args.gpus, hardware(args), args.json))
    except ConfigError as err:
        print(f"meshtron: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
