"""Context parallelism: ring attention over the ``cp`` mesh dimension with load-balanced sharding.

Layout. The sequence is cut into ``2 * cp`` equal chunks and cp rank ``i`` holds chunks ``i`` and
``2*cp - 1 - i`` (in that order). Under a causal mask a late chunk attends to many more keys than an
early one, so pairing the i-th earliest with the i-th latest chunk gives every rank the same work.

Ring. Each rank keeps its queries; key/value blocks (with their own, possibly smaller, GQA head
count) travel one hop around the cp ring per step with async send/recv, so the next block is in
flight while the current one is computed. From the chunk ids of the query and the visiting key
block every (query chunk, key chunk) pair is either fully visible, diagonal (causal inside the
chunk) or fully masked; masked pairs are never computed. Partial results are merged with their
log-sum-exp in fp32 (online softmax). The backward recomputes every block from the saved
log-sum-exp and sends the dK/dV accumulators around the ring with the key/value blocks, so that
after ``cp`` hops each rank holds the gradient of its own keys and values. Nothing ever gathers
the full sequence: per-rank memory is O(seq / cp).

Documents. With ``[data] document_mask`` the attention also receives the queries' packed
positions (restarting at 0 at every document): a query at global index ``i`` with position ``p``
sees keys ``i - p .. i``. A (query chunk, key chunk) pair whose keys all lie before every query's
document start is skipped, one whose keys all lie inside every query's document is computed
unmasked, and only the rest builds an explicit mask (:func:`document_blocks`).

Communication types (``[parallel] cp_comm_type``, Megatron's names; one table, :data:`CP_COMM_TYPES`,
read by the checks, both apply paths and the planner), one block engine for all:

* ``p2p``: the ring above.
* ``a2a`` (Ulysses): an all-to-all turns this rank's sequence shard of all heads into all tokens of
  ``heads / cp`` heads; attention then runs locally (a ring of one) and a second all-to-all turns the
  output back. KV heads fewer than cp are repeated first, as tensor parallelism replicates them.
* ``allgather``: K/V are all-gathered once (backward: their gradients reduce-scattered); queries
  keep the load-balanced layout and visit the gathered blocks in the ring's order.
* ``a2a+p2p``: cp ranks form groups of ``a`` consecutive ranks (:func:`a2a_group_size`); an
  all-to-all inside each group, then a ring across the groups, each ring member holding the
  chunks of its whole group.

Loss. With the sequence sharded, each cp rank sees only its tokens. The training loop must sum
the per-token losses of its local tokens and divide by the *global* token count (all-reduced over
cp, and over the data-parallel ranks of the same global batch), and the gradients of the dense
parameters must be *summed* over cp (not averaged): with a gradient reduction that averages over
``dp x ep x cp`` (FSDP/DDP default), multiply the local loss by the number of ranks in that
reduction. Labels must be shifted to next-token targets *before* sharding, because a chunk's last
target lives on another rank.

Files: ``sharding.py`` (chunks, sharding, the comm types and layout checks: what the rest of meshtron
imports),
``blocks.py`` (block schedule, kernels and engine: compute only), ``comm.py`` (every collective and
its autograd function), ``transform.py`` (:class:`RingAttention`, the cp groups, the model transform).
"""

from meshtron.parallel.context.blocks import (
    _empty_result,
    _kernel_name,
    _merge,
    attention_block,
    attention_block_backward,
    block_plan,
    causal_score_elements,
    document_blocks,
    ring_schedule,
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
    "block_plan",
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
