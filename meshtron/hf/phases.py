"""The last line of defence of :func:`meshtron.hf.parallelize_hf_model`: each phase of it ends with every rank
agreeing whether any rank failed, and a failure anywhere leaves as one ConfigError on every rank naming the
family, the layout, the phase, the module and the rank, instead of a raw traceback on one rank while the others
wait in their next collective. See docs/hf.md, 'When a split fails'.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshtron import env
from meshtron.config import ConfigError


class PhaseGuard:
    """``with guard("tensor parallelism"): ...`` for each phase of splitting ``model`` over ``mesh``."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, sp: bool):
        self.family = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
        self.model_class = type(model).__name__
        sizes = " x ".join(f"{name} {mesh[name].size()}" for name in mesh.mesh_dim_names if mesh[name].size() > 1)
        self.layout = (sizes or "one rank") + (" + SP" if sp else "")
        self.names = {id(m): name or "the model" for name, m in model.named_modules()}
        self.whole_world = dist.is_initialized() and mesh.size() == dist.get_world_size()

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        failure: BaseException | None = None
        try:
            yield
        except Exception as err:  # decided below, together with the other ranks
            failure = err
        message = None if failure is None else self._describe(phase, failure)
        first = _first_failure(message) if self.whole_world else message
        if first is None:
            return
        if isinstance(failure, ConfigError):
            raise failure  # already names what to change, and every rank that took it raises it
        raise ConfigError(first) from failure

    def _describe(self, phase: str, err: BaseException) -> str:
        if isinstance(err, ConfigError):
            return str(err)
        rank = dist.get_rank() if dist.is_initialized() else 0
        where = self._module_in(err.__traceback__)
        return (
            f"parallelize_hf_model could not split {self.family} ({self.model_class}) at {self.layout}: {phase} "
            f"failed on rank {rank} at {where}: {type(err).__name__}: {err}. That layout is not supported for this "
            "model; try another layout (docs/hf.md lists what each family runs), and report the model and the "
            "layout."
        )

    def _module_in(self, tb) -> str:
        """The module of the model the failure was working on: of the innermost frame holding any in its locals,
        the most specific one (the longest name)."""
        found = "an unknown module"
        while tb is not None:
            held = [v for v in tb.tb_frame.f_locals.values() if isinstance(v, nn.Module) and id(v) in self.names]
            if held:
                module = max(held, key=lambda m: len(self.names[id(m)]) if self.names[id(m)] != "the model" else 0)
                found = f"{self.names[id(module)]} ({type(module).__name__})"
            tb = tb.tb_next
        return found


def _first_failure(message: str | None) -> str | None:
    """The lowest failing rank's message on every rank of the job (None when every rank passed the phase): one
    flag all-reduce, and the messages gathered only when some rank failed. A mesh on part of the job's ranks
    (a test's) is split by those ranks alone, so they raise on their own."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return message  # a dry run's ranks are traced one at a time and never meet
    flag = torch.tensor([0.0 if message is None else 1.0], device=env.local_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() == 0.0:
        return None
    messages: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    return next(m for m in messages if m is not None)


__all__ = ["PhaseGuard"]
