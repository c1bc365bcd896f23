"""How the gradient of a tensor replicated over tp combines across the tp ranks, for a module that runs
on its local view (:class:`TpGradient`: whole on every rank, a partial sum, or decided on the first
backward from what the ranks computed), and the local view that applies it (:func:`local_view`).

Used by the tp styles of ``parallel/tp_styles.py`` and by the HF path (``hf/tp_plan.py``), whose modules
the plan does not name. See docs/hf.md, 'Parameters no plan entry places'.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate

from meshtron.config import ConfigError
from meshtron.host import simulating


class TpGradient:
    """How the per-rank gradients of one parameter replicated over tp combine, for a module that runs on
    its local view.

    ``"replicate"``: every rank computed the whole gradient (same tokens, same features), so nothing
    is communicated; it is verified on the first backward: tp ranks whose gradients differ raise a
    :class:`ConfigError` naming the parameter (it acts on a tp-split activation and would drift apart).
    ``"partial"``: each rank computed its part (its tokens under SP, its heads or features after a
    column-split projection): summed over tp. ``"infer"`` (parameters no plan names): decided on the first
    backward with nonzero gradients from what the ranks computed: identical gradients mean the module
    ran replicated, pairwise different ones that each rank ran on its own part of the activation.
    Equal gradients on some ranks and different on others fit neither and are refused by name.
    Deciding and verifying cost one all-gather of three numbers per parameter, once. ``what`` names the
    tensor's kind in errors: a replicated activation's local view (a module input) follows the same rule.
    """

    def __init__(self, mode: str, name: str = "", what: str = "parameter"):
        if mode not in ("replicate", "partial", "infer"):
            raise ValueError(f"TpGradient mode must be replicate, partial or infer, got {mode!r}")
        self.mode, self.name, self.what = mode, name, what
        self.decided: Placement | None = {"replicate": Replicate(), "partial": Partial()}.get(mode)
        self.verified = mode != "replicate"

    def placement(self, grad: torch.Tensor, mesh: DeviceMesh) -> Placement:
        if self.decided is not None and self.verified:
            return self.decided
        if simulating():  # a dry run has no values to compare: it assumes a part (one all-reduce)
            return self.decided or Partial()
        if torch.compiler.is_compiling():  # traced once ahead of time: no data to look at
            if self.decided is None:
                raise ConfigError(
                    f"{self.what} '{self.name}': how its gradient combines over tp is decided on an eager "
                    "first step; run one step without torch.compile first."
                )
            return self.decided
        ranks = _gradient_classes(grad, mesh)
        if self.mode == "replicate":
            return self._verify(ranks)
        return self._infer(ranks, mesh.size())

    def _verify(self, ranks: list[list[int]]) -> Placement:
        if ranks and ranks[0][0] == -1:
            return self.decided  # no gradient on any rank yet: verified on a later backward
        if len(ranks) > 1:
            raise ConfigError(
                f"parameter '{self.name}' is declared replicated over tp with a complete gradient on every rank, but "
                f"the tp ranks computed different gradients (ranks with equal ones: {ranks}): it acts on a tp-split "
                "activation, and its copies would drift apart after one optimizer step. Declare it partial "
                "(ReplicateParallel(grad='partial'), plan style 'replicated_with_grad_allreduce') or leave it "
                "unplanned (parallelize_hf_model then decides)."
            )
        self.verified = True
        return self.decided

    def _infer(self, ranks: list[list[int]], tp: int) -> Placement:
        nonzero = [group for group in ranks if group[0] >= 0]
        if not nonzero:
            return Replicate()  # no gradient anywhere yet: either rule gives zero
        if len(nonzero) == 1 and len(nonzero[0]) == tp:
            self.decided = Replicate()
        elif all(len(group) == 1 for group in nonzero):
            if sum(map(len, nonzero)) < tp:
                return Partial()  # some ranks hold none of it yet: sum this one, decide later
            self.decided = Partial()
        else:
            raise ConfigError(
                f"{self.what} '{self.name}' (replicated over tp, no tp plan entry): cannot decide how its gradient "
                f"combines over tp: ranks {nonzero} computed equal gradients within each group and different ones "
                "across groups (a replicated computation on part of a tp-split activation). Give it a plan entry "
                "or run it with tp = 1."
            )
        return self.decided


# Relative difference below which two ranks' gradient fingerprints count as the same gradient:
# replicated computations agree to the bit, parts of a split activation differ in every figure.
_SAME_GRADIENT = 1e-6


def _gradient_classes(grad: torch.Tensor, mesh: DeviceMesh) -> list[list[int]]:
    """tp ranks grouped by equal gradients (one all-gather of three float64 numbers per rank); ranks
    whose gradient is all zero form a group listed as ``[-1, ...ranks]``."""
    flat = grad.detach().flatten().double()
    weights = torch.linspace(1.0, 2.0, flat.numel(), dtype=flat.dtype, device=flat.device)
    mine = torch.stack([flat.abs().sum(), flat.square().sum(), (flat * weights).sum()])
    gathered = [torch.empty_like(mine) for _ in range(mesh.size())]
    dist.all_gather(gathered, mine, group=mesh.get_group())
    prints = torch.stack(gathered).cpu()
    groups: list[list[int]] = []
    zero = [r for r in range(mesh.size()) if prints[r, 0] == 0]
    for rank in range(mesh.size()):
        if rank in zero:
            continue
        for group in groups:
            ref = prints[group[0]]
            if ((prints[rank] - ref).abs() <= _SAME_GRADIENT * (prints[rank].abs() + ref.abs())).all():
                group.append(rank)
                break
        else:
            groups.append([rank])
    return groups + ([[-1, *zero]] if zero else [])


class _LocalView(torch.autograd.Function):
    """Local view of a replicated DTensor parameter; backward labels this rank's gradient as its
    :class:`TpGradient` says (``Partial()``: summed over the mesh; ``Replicate()``: already whole)."""

    @staticmethod
    def forward(ctx, param: DTensor, rule: TpGradient) -> torch.Tensor:
        ctx.mesh, ctx.rule = param.device_mesh, rule
        local = param.to_local()
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        placement = ctx.rule.placement(grad, ctx.mesh)
        return DTensor.from_local(grad, ctx.mesh, [placement]).redistribute(ctx.mesh, [Replicate()]), None


def local_view(tensor: DTensor, rule: TpGradient) -> torch.Tensor:
    """The local view of a Replicate DTensor (a parameter, or an activation), its gradient combined
    over tp as ``rule`` says."""
    return _LocalView.apply(tensor, rule)


def name_tp_gradients(model: nn.Module) -> None:
    """Label every :class:`TpGradient` of ``model`` with its parameter's (or input's module's) name, for
    the errors it raises."""
    for path, module in model.named_modules():
        for pname, rule in getattr(module, "tp_gradients", {}).items():
            rule.name = f"{path}.{pname}" if path else pname
        if (rule := getattr(module, "tp_input_gradient", None)) is not None:
            rule.name = path


__all__ = ["TpGradient", "local_view", "name_tp_gradients"]
