"""meshtron: PyTorch-native LLM training on DeviceMesh and DTensor."""

from meshtron.config import Config, ConfigError, load_config
from meshtron.mesh import build_mesh

__all__ = ["Config", "ConfigError", "build_mesh", "load_config"]
__version__ = "0.1.0"
