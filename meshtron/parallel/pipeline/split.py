"""Split a decoder's layers over pipeline stages (and virtual stages for interleaving): which rank runs each
chunk and how many layers each gets. See docs/pipeline.md#stages-and-placement.
"""

from __future__ import annotations


def chunk_rank(chunk: int, pp: int, v_shape: bool = False) -> int:
    """pp-rank that runs model chunk (global stage) ``chunk``.

    ``v_shape`` (ZBV, DualPipeV; two chunks per rank): the model goes down the ranks and back up,
    so rank ``r`` runs chunks ``r`` and ``2 pp - 1 - r`` and rank 0 holds both ends.
    """
    if v_shape and chunk >= pp:
        return 2 * pp - 1 - chunk
    return chunk % pp


def too_few_layers(num_layers: int, num_chunks: int) -> str | None:
    """Why ``num_layers`` layers cannot fill ``num_chunks`` chunks (None: they can). The rule's one owner:
    :func:`chunk_sizes` and the recipe check (``parallel/layout.py``) call it."""
    if num_layers >= num_chunks:
        return None
    return (
        f"num_hidden_layers = {num_layers} is fewer than pp * virtual_stages = {num_chunks} pipeline stages; "
        "every stage needs at least one layer: lower pp or virtual_stages, or use a deeper model."
    )


def chunk_sizes(num_layers: int, num_chunks: int) -> list[int]:
    """Layers per chunk for ``num_layers`` layers over ``num_chunks`` chunks (the rule:
    docs/pipeline.md#stages-and-placement)."""
    if num_chunks < 1:
        raise ValueError(f"number of pipeline chunks must be >= 1, got {num_chunks}")
    refused = too_few_layers(num_layers, num_chunks)
    if refused:
        raise ValueError(refused)
    sizes = [num_layers // num_chunks] * num_chunks
    receivers = list(range(1, num_chunks - 1)) + [0]
    for chunk in receivers[: num_layers % num_chunks]:
        sizes[chunk] += 1
    return sizes


def chunk_layer_ranges(num_layers: int, pp: int, virtual: int = 1) -> list[range]:
    """Layer indices of every model chunk, in model order (length ``pp * virtual``)."""
    if pp < 1 or virtual < 1:
        raise ValueError(f"pp and virtual_stages must be >= 1, got pp={pp}, virtual_stages={virtual}")
    ranges, start = [], 0
    for size in chunk_sizes(num_layers, pp * virtual):
        ranges.append(range(start, start + size))
        start += size
    return ranges


def split_layers(num_layers: int, pp: int, virtual: int = 1, v_shape: bool = False) -> list[list[range]]:
    """``result[rank][virtual_stage]`` is the range of layer indices that virtual stage runs."""
    chunks = chunk_layer_ranges(num_layers, pp, virtual)
    by_rank: list[list[range]] = [[] for _ in range(pp)]
    for chunk, layers in enumerate(chunks):
        by_rank[chunk_rank(chunk, pp, v_shape)].append(layers)
    return by_rank
