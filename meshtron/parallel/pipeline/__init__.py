"""Hand-written pipeline parallelism: stage split, schedules as data, a clock simulator.

``torch.distributed.pipelining`` is a peer to measure against, not a dependency.
"""

from meshtron.parallel.pipeline.schedules import (
    B,
    F,
    P2P,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    Schedule,
    Step,
    build_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    peak_in_flight,
)
from meshtron.parallel.pipeline.simulate import (
    DeadlockError,
    SimResult,
    Span,
    analytic_bubble,
    match_p2p,
    simulate,
)
from meshtron.parallel.pipeline.split import chunk_layer_ranges, chunk_rank, chunk_virtual_stage, split_layers

__all__ = [
    "B",
    "F",
    "P2P",
    "RECV_B",
    "RECV_F",
    "SEND_B",
    "SEND_F",
    "Action",
    "DeadlockError",
    "Schedule",
    "SimResult",
    "Span",
    "Step",
    "analytic_bubble",
    "build_schedule",
    "chunk_layer_ranges",
    "chunk_rank",
    "chunk_virtual_stage",
    "gpipe",
    "interleaved_1f1b",
    "match_p2p",
    "one_f_one_b",
    "peak_in_flight",
    "simulate",
    "split_layers",
]
