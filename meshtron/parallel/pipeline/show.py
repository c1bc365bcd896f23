"""Gantt charts of pipeline schedules, simulated or measured.

``python -m meshtron.parallel.pipeline.show --pp 4 --microbatches 8 --schedule interleaved --virtual 2`` simulates
the schedule, draws it to a PNG and prints the costs it used, the bubble next to the analytic one and the peak
in-flight micro-batches; :func:`render_timeline` draws timelines measured in a real run. matplotlib is optional
(``pip install 'meshtron[plot]'``) and imported only when drawing. See docs/pipeline.md, 'Zero-bubble schedules'.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence

from meshtron.extras import MissingExtra, require
from meshtron.parallel.pipeline.schedules import SCHEDULES, V_SHAPED, VIRTUAL, B, F, W, build_schedule, peak_in_flight
from meshtron.parallel.pipeline.simulate import analytic_bubble, simulate, unit_cost_bubble

# The schedules whose backward is split into B (input gradients) and W (weight gradients).
SPLIT_BACKWARD = ("zb1p",) + V_SHAPED

# Colours of each pass for even and odd virtual stages, so chunks are told apart.
_COLOURS = {F: ("#4c72b0", "#8fb0dd"), B: ("#dd8452", "#f0b98f"), W: ("#55a868", "#9fd3ad")}
_NAMES = {F: "forward", B: "backward", W: "weight gradients"}


def _figure_class():
    return require("matplotlib.figure", "drawing a pipeline timeline").Figure


def render_timeline(spans: Iterable[Sequence], path: str, title: str = "", pp: int | None = None) -> None:
    """Write a PNG Gantt chart of compute spans to ``path``.

    Each span is ``(rank, kind, mb, start, end)`` with ``kind`` ``"F"``, ``"B"`` or ``"W"``, optionally
    followed by the global stage (its virtual stage picks the shade when ``pp`` is given);
    :class:`~meshtron.parallel.pipeline.simulate.Span` tuples have this layout.
    """
    rows = [tuple(s) for s in spans]
    if not rows:
        raise ValueError("render_timeline: no spans to draw")
    ranks = 1 + max(r[0] for r in rows)
    begin, end = min(r[3] for r in rows), max(r[4] for r in rows)
    fig = _figure_class()(figsize=(max(8.0, min(40.0, len(rows) / ranks * 0.5)), 0.6 * ranks + 1.2))
    ax = fig.add_subplot()
    shades, kinds = set(), set()
    for rank, kind, mb, start, stop, *stage in rows:
        shade = (stage[0] // pp) % 2 if stage and pp else 0
        shades.add(shade)
        kinds.add(kind)
        colour = _COLOURS[kind][shade]
        ax.barh(rank, stop - start, left=start, height=0.8, color=colour, edgecolor="black", linewidth=0.4)
        ax.text((start + stop) / 2, rank, str(mb), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_xlim(begin, end)
    ax.set_xlabel("time")
    ax.set_title(title, loc="left")
    ax.legend(handles=_legend(kinds, len(shades) > 1), loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=6, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _legend(kinds: set[str], two_shades: bool) -> list:
    from matplotlib.patches import Patch

    shown = [k for k in (F, B, W) if k in kinds]
    handles = [Patch(color=_COLOURS[k][0], label=_NAMES[k]) for k in shown]
    if two_shades:
        handles += [Patch(color=_COLOURS[k][1], label=f"{_NAMES[k]}, 2nd chunk") for k in shown]
    return handles


def summary(schedule: str, pp: int, m: int, v: int = 1, f: float = 1, b: float = 2, p2p: float = 0, w: float = 0):
    """Simulate one schedule under the executor's model; returns (result, text line for humans).

    ``b`` is the input-gradient part of a backward and ``w`` its weight part (a whole backward
    costs ``b + w``).
    """
    entries = build_schedule(schedule, pp, m, v)
    result = simulate(entries, f, b, p2p, w_cost=w, rendezvous=False)
    peaks = [peak_in_flight(rank_entries) for rank_entries in entries]
    if schedule in SPLIT_BACKWARD:
        analytic = f"{unit_cost_bubble(schedule, pp, m):.4f} (analytic for f = b = w)"
    else:
        analytic = f"{analytic_bubble(pp, m, v):.4f} (analytic (pp-1)/(v*m+pp-1))"
    text = (
        f"{schedule} pp={pp} microbatches={m} virtual={v} f={f} b={b} w={w} p2p={p2p}: "
        f"bubble {result.bubble:.4f} (simulated), {analytic}; makespan {result.makespan:g}; "
        f"peak in-flight microbatches per rank {peaks}"
    )
    return result, text


def _default_costs(args: argparse.Namespace) -> str:
    """Fill the costs not given and say where they came from. A split backward's W is drawn only with
    w > 0, so its schedules default to the zero-bubble papers' unit costs (B and W a forward each);
    the others to a backward of two forwards."""
    defaulted = [name for name in ("b", "w") if getattr(args, name) is None]
    if args.w is None:
        args.w = 1.0 if args.schedule in SPLIT_BACKWARD else 0.0
    if args.b is None:
        args.b = 1.0 if args.w else 2.0
    costs = f"costs per chunk: f={args.f:g} b={args.b:g} w={args.w:g} p2p={args.p2p:g}"
    if not defaulted:
        return costs
    split = ", a split backward" if args.schedule in SPLIT_BACKWARD else ""
    return f"{costs} ({' and '.join(defaulted)}: the defaults for {args.schedule}{split}; --b and --w set them)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m meshtron.parallel.pipeline.show", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--pp", type=int, required=True, help="pipeline stages (ranks)")
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    parser.add_argument(
        "--virtual", type=int, help="virtual stages per rank (interleaved: 2 or more, default 2; zbv and dualpipev: 2)"
    )
    parser.add_argument("--out", default="timeline.png", help="PNG path")
    parser.add_argument("--f", type=float, default=1.0, help="forward cost of one chunk")
    parser.add_argument(
        "--b",
        type=float,
        help="backward cost of one chunk (input-gradient part when --w > 0; default 1 when w > 0, else 2)",
    )
    parser.add_argument(
        "--w", type=float, help="weight-gradient cost of one chunk (default 1 for zb1p, zbv and dualpipev, else 0)"
    )
    parser.add_argument("--p2p", type=float, default=0.0, help="cost of one p2p batch")
    args = parser.parse_args(argv)
    if args.virtual is None:
        args.virtual = 2 if args.schedule in VIRTUAL else 1
    costs = _default_costs(args)
    if args.virtual != 1 and args.schedule not in VIRTUAL:
        parser.error(f"--virtual {args.virtual} needs --schedule interleaved, zbv or dualpipev")
    try:
        result, text = summary(
            args.schedule, args.pp, args.microbatches, args.virtual, args.f, args.b, args.p2p, args.w
        )
    except ValueError as err:
        parser.error(str(err))
    title = f"{args.schedule}: pp={args.pp}, m={args.microbatches}, v={args.virtual}, bubble {result.bubble:.1%}"
    print(costs)
    print(text)
    try:
        render_timeline([s for line in result.timelines for s in line], args.out, title, pp=args.pp)
    except MissingExtra as err:
        print(f"meshtron: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
