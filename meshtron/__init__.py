"""meshtron: PyTorch-native LLM training on DeviceMesh and DTensor."""

from meshtron.config import Config, ConfigError, load_config
from meshtron.hf.parallelize import load_hf_checkpoint, parallelize_hf_model, save_hf_checkpoint
from meshtron.hf.pipeline import HFPipelineRunner
from meshtron.mesh import build_mesh

__all__ = [
    "Config",
    "ConfigError",
    "HFPipelineRunner",
    "build_mesh",
    "load_config",
    "load_hf_checkpoint",
    "parallelize_hf_model",
    "save_hf_checkpoint",
]
__version__ = "0.2.0"
