"""meshtron: PyTorch-native LLM training on DeviceMesh and DTensor."""

from meshtron.config import Config, ConfigError, load_config

__all__ = ["Config", "ConfigError", "load_config"]
__version__ = "0.1.0"
