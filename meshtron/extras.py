"""Optional dependencies: pyproject's extras, imported only by the commands that need them.

A command run without its extra ends with one line naming what to install (``pip install
'meshtron[plot]'``) and exit code 2, not an ImportError's traceback. See docs/failures.md, 'No hangs'.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# The extra of each optional top-level package (pyproject.toml's [project.optional-dependencies]).
EXTRAS = {"matplotlib": "plot", "tensorboard": "tensorboard", "torchao": "fp8", "wandb": "wandb", "mlflow": "mlflow"}


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message is the one line to show."""


def require(module: str, purpose: str) -> ModuleType:
    """Import ``module`` (of a package in ``EXTRAS``) for ``purpose``, e.g. "drawing a timeline"."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        package = module.split(".")[0]
        raise MissingExtra(f"{purpose} needs {package}: pip install 'meshtron[{EXTRAS[package]}]'") from err
