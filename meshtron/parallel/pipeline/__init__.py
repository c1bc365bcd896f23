"""Hand-written pipeline parallelism: stage split, schedules as data, a clock simulator, the executor.

The runner for ``pp > 1`` is ``meshtron.parallel.pipeline.pipelined_runner.PipelineRunner`` (built by
``meshtron.parallel.runner.build_model_runner``; not imported here: it composes the other parallelisms).

``torch.distributed.pipelining`` is a peer to measure against, not a dependency.
See docs/pipeline.md, from 'Stages and placement' to 'The pipelined runner'.
"""

from meshtron.parallel.pipeline.executor import PipelineExecutor
from meshtron.parallel.pipeline.schedules import (
    P2P,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    Entry,
    F,
    Schedule,
    W,
    build_schedule,
    dualpipev,
    gpipe,
    held_by_stage,
    held_counts,
    interleaved_1f1b,
    one_f_one_b,
    peak_in_flight,
    split_backwards,
    zb1p,
    zbv,
)
from meshtron.parallel.pipeline.simulate import (
    DeadlockError,
    SimResult,
    Span,
    analytic_bubble,
    match_p2p,
    simulate,
)
from meshtron.parallel.pipeline.split import chunk_layer_ranges, chunk_rank, split_layers
from meshtron.parallel.pipeline.stage import StageChunk, build_chunks, check_pipeline, prune_to_stage

__all__ = [
    "B",
    "F",
    "P2P",
    "RECV_B",
    "RECV_F",
    "SEND_B",
    "SEND_F",
    "W",
    "Action",
    "DeadlockError",
    "PipelineExecutor",
    "Schedule",
    "SimResult",
    "Span",
    "StageChunk",
    "Entry",
    "analytic_bubble",
    "build_chunks",
    "build_schedule",
    "check_pipeline",
    "chunk_layer_ranges",
    "chunk_rank",
    "dualpipev",
    "gpipe",
    "held_by_stage",
    "held_counts",
    "interleaved_1f1b",
    "match_p2p",
    "one_f_one_b",
    "peak_in_flight",
    "prune_to_stage",
    "simulate",
    "split_backwards",
    "split_layers",
    "zb1p",
    "zbv",
]
