"""``torch.compile`` per transformer block (``[parallel] compile = true``).

Why per block: every block runs the same code, so all blocks of one kind share one compiled graph
(a dense model compiles once, however deep) and the embedding, loss and optimizer stay eager. The
compiler fuses the elementwise work around the matmuls (RMSNorm, RoPE, SwiGLU, residual adds and
their backward), which is where an eager step spends its memory traffic.

Order: after TP/EP/CP and activation checkpointing, before data parallelism (FSDP2), as torchtitan
does. We compile each block's ``forward`` rather than the module (``torch.compile(block)`` or
``block.compile()``), because:

* FSDP2's all-gather/reshard and the composable activation checkpoint are module *hooks* that run
  around ``forward``; they stay eager and outside the graph (compiling the module's call would pull
  them in, where dynamo skips FSDP's hooks with graph breaks);
* parameter names are unchanged (no ``_orig_mod.`` wrapper), so checkpoints, HF export and the
  layout-independent initialisation see the same model;
* FSDP2 swaps a block's parameters between sharded and unsharded tensors around ``forward``;
  dynamo treats module parameters as graph inputs, so the swap costs no recompilation.

Tensor parallelism's input/output redistributions are hooks of the block's *submodules*, so they
are traced into the graph (DTensor collectives become functional collectives the compiler can
schedule). A dense block is one graph (``fullgraph=True``: a break is an error, not a silent slow
path). In MoE blocks the MoE layer runs eagerly and the attention half is compiled, because under
torch 2.13 (i) ``grouped_mm``'s compile-time rule accepts bf16 only, while it runs in any dtype;
(ii) the expert-parallel dispatch reads split sizes on the host; (iii) traced, the aux-loss
attachment (``moe._AttachAuxLoss``, which adds the router loss's gradient in backward) gives wrong
gradients: router weight relative error 3e-2 in one process and 0.24 on 4 ranks, exact with
``router_aux_loss_coef = 0``. Ring attention posts P2P transfers inside an autograd function, so a
context-parallel block compiles with graph breaks around it; so does a block under ``tp_overlap``, whose
rings run eagerly (their GEMMs with them) between the compiled pieces.
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
    on CPUs. Call before :func:`meshtron.parallel.data.apply_data_parallel`.
    """
    for block in model.layers.values():
        for moe in moe_layers(block):
            moe.forward = torch.compiler.disable(moe.forward)  # see the module docstring
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
