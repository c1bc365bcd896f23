"""The recipe's runner for either kind of model, the trainer's and the dry run's: :func:`build_runner`.

Above ``meshtron.hf`` in the import order (``tests/test_structure.py: LEVELS``): a transformers model
(``[model] hf_model``) is built by ``meshtron.hf.runner`` and run by its runners, which ``meshtron.parallel``
cannot import. See docs/extending.md, 'Imports go one way'.
"""

from __future__ import annotations

import torch

from meshtron.config import Config
from meshtron.hf.runner import HF_RUNNERS, build_hf_model
from meshtron.models import build_model
from meshtron.parallel.runner import build_model_runner
from meshtron.parallel.step import Runner


def build_runner(cfg: Config, mesh, device: torch.device) -> Runner:
    """The recipe's model as its layout's runner: meshtron's own model built on the meta device, or with
    ``[model] hf_model`` the folder's transformers model; either way
    :func:`~meshtron.parallel.runner.build_model_runner` picks the runner."""
    if cfg.model.hf_model:
        return build_model_runner(build_hf_model(cfg, device), mesh, cfg, device, HF_RUNNERS)
    with torch.device("meta"):
        model = build_model(cfg.model)
    return build_model_runner(model, mesh, cfg, device)


__all__ = ["build_runner"]
