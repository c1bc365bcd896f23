"""transformers' causal-LM loss and MoE aux loss made the global batch's: thin adapters over the native pieces.

:func:`hf_loss_function` replaces the model's ``loss_function`` with the vocab-parallel token-loss sum over the
data ranks, and :func:`global_aux_loss` the aux loss with the global batch's. Each rank back-propagates only its
own share, so gradients summed by the data-parallel wrapper are the unparallelized model's on the concatenated
batch. See docs/hf.md, 'The loss, and MoE gradients'.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshtron.hf.router import aux_loss_share
from meshtron.parallel.step import sum_over_ranks
from meshtron.parallel.vocab_loss import parallel_token_loss_sum


def hf_loss_function(data_mesh: DeviceMesh):
    """HF's causal-LM loss (shifted labels, mean over non-ignored tokens) on vocab-sharded logits,
    averaged over the tokens of all data ranks. ``num_items_in_batch``, when given (gradient
    accumulation), is the global token count of the whole step and replaces the counted one."""

    def loss(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **_):
        if shift_labels is None:
            shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        total = parallel_token_loss_sum(logits, shift_labels, ignore_index)
        count = (shift_labels != ignore_index).sum().to(total.dtype)
        if data_mesh.size() > 1:
            group = data_mesh.get_group()
            total = sum_over_ranks(total, group)
            if num_items_in_batch is None:
                dist.all_reduce(count, group=group)
        if num_items_in_batch is not None:  # the caller's global count (gradient accumulation)
            count = torch.as_tensor(num_items_in_batch, dtype=total.dtype, device=total.device)
        return total / count

    return loss


def global_aux_loss(data_mesh: DeviceMesh):
    """Forward hook making ``aux_loss`` (``output_router_logits=True``) the global batch's, on every rank,
    and ``loss`` = global token loss + ``router_aux_loss_coef`` x global aux loss, as unparallelized.

    transformers computes both from this rank's router logits only; the hook swaps its aux term for
    the global one (value summed over the data ranks, gradient this rank's share: gradients summed
    over data ranks are then exact).
    """
    group = data_mesh.get_group()

    def hook(model, args, kwargs, out):
        if getattr(out, "aux_loss", None) is None or not isinstance(out.router_logits, tuple):
            return None
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        aux = sum_over_ranks(aux_loss_share(out.router_logits, model.num_experts_per_tok, mask, group), group)
        if out.loss is not None:
            out.loss = out.loss + model.router_aux_loss_coef * (aux - out.aux_loss)
        out.aux_loss = aux
        return out

    return hook


__all__ = ["global_aux_loss", "hf_loss_function"]
