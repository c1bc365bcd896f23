"""Gantt charts of pipeline schedules, simulated or measured.

``python -m meshtron.pipeline.show --pp 4 --microbatches 8 --schedule interleaved --virtual 2``
simulates the schedule, writes a PNG (rows = ranks, x = time, forwards and backwards in two
colours labelled with their microbatch, idle time blank) and prints the bubble fraction next
to the analytic one. :func:`render_timeline` draws timelines measured in a real run.
matplotlib is optional (``pip install meshtron[plot]``) and imported only when drawing.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence

from meshtron.parallel.pipeline.schedules import F, build_schedule, peak_in_flight
from meshtron.parallel.pipeline.simulate import analytic_bubble, simulate

# (forward, backward) colours for even and odd virtual stages, so chunks are told apart.
_COLOURS = (("#4c72b0", "#dd8452"), ("#8fb0dd", "#f0b98f"))


def _figure_class():
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(
            "drawing pipeline timelines needs matplotlib: pip install matplotlib (or meshtron[plot])"
        ) from err
    return Figure


def render_timeline(spans: Iterable[Sequence], path: str, title: str = "", pp: int | None = None) -> None:
    """Write a PNG Gantt chart of compute spans to ``path``.

    Each span is ``(rank, kind, mb, start, end)`` with ``kind`` ``"F"`` or ``"B"``, optionally
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
    shades = set()
    for rank, kind, mb, start, stop, *stage in rows:
        shade = (stage[0] // pp) % 2 if stage and pp else 0
        shades.add(shade)
        colour = _COLOURS[shade][kind != F]
        ax.barh(rank, stop - start, left=start, height=0.8, color=colour, edgecolor="black", linewidth=0.4)
        ax.text((start + stop) / 2, rank, str(mb), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_xlim(begin, end)
    ax.set_xlabel("time")
    ax.set_title(title, loc="left")
    ax.legend(handles=_legend(len(shades) > 1), loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=4, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _legend(two_shades: bool) -> list:
    from matplotlib.patches import Patch

    names = ("forward", "backward")
    handles = [Patch(color=_COLOURS[0][i], label=names[i]) for i in range(2)]
    if two_shades:
        handles += [Patch(color=_COLOURS[1][i], label=f"{names[i]}, odd virtual stage") for i in range(2)]
    return handles


def summary(schedule: str, pp: int, m: int, v: int = 1, f: float = 1, b: float = 2, p2p: float = 0):
    """Simulate one schedule; returns (result, text line for humans)."""
    steps = build_schedule(schedule, pp, m, v)
    result = simulate(steps, f, b, p2p)
    peaks = [peak_in_flight(rank_steps) for rank_steps in steps]
    text = (
        f"{schedule} pp={pp} microbatches={m} virtual={v} f={f} b={b} p2p={p2p}: "
        f"bubble {result.bubble:.4f} (simulated), {analytic_bubble(pp, m, v):.4f} "
        f"(analytic (pp-1)/(v*m+pp-1)); makespan {result.makespan:g}; "
        f"peak in-flight microbatches per rank {peaks}"
    )
    return result, text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m meshtron.pipeline.show", description=__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, required=True, help="pipeline stages (ranks)")
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved"), default="1f1b")
    parser.add_argument("--virtual", type=int, default=1, help="virtual stages per rank (interleaved)")
    parser.add_argument("--out", default="timeline.png", help="PNG path")
    parser.add_argument("--f", type=float, default=1.0, help="forward cost of one chunk")
    parser.add_argument("--b", type=float, default=2.0, help="backward cost of one chunk")
    parser.add_argument("--p2p", type=float, default=0.0, help="cost of one p2p batch")
    args = parser.parse_args(argv)
    if args.virtual != 1 and args.schedule != "interleaved":
        parser.error(f"--virtual {args.virtual} needs --schedule interleaved")
    try:
        result, text = summary(args.schedule, args.pp, args.microbatches, args.virtual, args.f, args.b, args.p2p)
    except ValueError as err:
        parser.error(str(err))
    title = f"{args.schedule}: pp={args.pp}, m={args.microbatches}, v={args.virtual}, bubble {result.bubble:.1%}"
    render_timeline([s for line in result.timelines for s in line], args.out, title, pp=args.pp)
    print(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
