"""Context parallelism: ring attention over the ``cp`` mesh dimension with load-balanced sharding.

The package owns the sequence layout and its checks (``sharding.py``), the block engine (``blocks.py``), the
collectives (``comm.py``) and the model transform (``transform.py``). See docs/context_parallel.md and its
section 'Ring attention'.
"""

from meshtron.parallel.context.blocks import (
    _empty_result,
    _kernel_name,
    _merge,
    attention_block,
    attention_block_backward,
    causal_score_elements,
    document_blocks,
    ring_schedule,
    visible_blocks,
)
from meshtron.parallel.context.comm import _KV_TAG, RingExchange, RingStats, unshard_sequence
from meshtron.parallel.context.sharding import (
    CP_COMM_TYPES,
    CpCommType,
    a2a_group_size,
    check_context_parallel,
    chunk_ids,
    cp_comm,
    cp_ranks_per_node,
    sequence_index,
    shard_batch,
    shard_sequence,
    unbalanced_seq_len,
)
from meshtron.parallel.context.transform import RingAttention, apply_context_parallel, cp_groups

__all__ = [
    "CP_COMM_TYPES",
    "CpCommType",
    "RingAttention",
    "RingExchange",
    "RingStats",
    "apply_context_parallel",
    "attention_block",
    "attention_block_backward",
    "visible_blocks",
    "a2a_group_size",
    "causal_score_elements",
    "check_context_parallel",
    "chunk_ids",
    "cp_comm",
    "cp_groups",
    "cp_ranks_per_node",
    "document_blocks",
    "ring_schedule",
    "sequence_index",
    "shard_batch",
    "shard_sequence",
    "unbalanced_seq_len",
    "unshard_sequence",
]
# Private, re-exported for the tests that reach into the engine (kernel choice, merge, the ring's kv tag).
__all__ += ["_KV_TAG", "_empty_result", "_kernel_name", "_merge"]
