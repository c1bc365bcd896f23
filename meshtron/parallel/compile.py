"""``torch.compile`` per transformer block (``[parallel] compile = true``).

Each block's ``forward`` is compiled, not the module, after TP/EP/CP and activation checkpointing and before
FSDP2, so their hooks stay eager and parameter names unchanged; a dense block is one graph, a MoE block's MoE
layer runs eagerly. Why each of these: docs/benchmarks.md, "Compile".
"""

from __future__ import annotations

import torch
from torch import nn

from meshtron.models.moe import moe_layers
from meshtron.models.qwen2 import CausalAttention
from meshtron.torch_private import is_view


def _single_graph(block: nn.Module) -> bool:
    """Dense attention and MLP only: no communication the compiler cannot trace (``sends_p2p``: a
    module whose forward posts point-to-point transfers, as tp_overlap's rings do)."""
    attention = getattr(getattr(block, "self_attn", None), "core_attention", None)
    return (
        isinstance(attention, CausalAttention)
        and not moe_layers(block)
        and not any(getattr(m, "sends_p2p", False) for m in block.modules())
    )


def apply_compile(model: nn.Module, backend: str = "inductor") -> list[int]:
    """Compile the ``forward`` of every block in ``model.layers`` (in place); returns the layer ids.

    ``backend``: a ``torch.compile`` backend; ``inductor`` generates Triton kernels on GPUs and C++
    on CPUs. Call before :func:`meshtron.parallel.data_parallel.apply_data_parallel`.
    """
    for block in model.layers.values():
        for moe in moe_layers(block):
            moe.forward = torch.compiler.disable(moe.forward)  # eager: docs/benchmarks.md, Compile
        block.forward = _compiled_forward(block, backend)
    return [int(key) for key in model.layers]


def _compiled_forward(block: nn.Module, backend: str):
    compiled = torch.compile(block.forward, backend=backend, fullgraph=_single_graph(block))

    def forward(x: torch.Tensor, *args, **kwargs):
        # torch 2.13 misroutes the gradient of a compiled region's input that is a view, such as
        # tensor parallelism's ``to_local()`` of the embedding output: we saw the embedding gradient
        # come back as zeros (under FSDP) or as a plain tensor where the DTensor redistribution's
        # backward expects a DTensor. A copy of the [B, S, H] input, cheap next to a block, avoids it.
        return compiled(x.clone() if is_view(x) else x, *args, **kwargs)

    forward.compiled = True
    return forward


def is_compiled(block: nn.Module) -> bool:
    """Whether :func:`apply_compile` compiled ``block``'s forward."""
    return getattr(block.forward, "compiled", False)
