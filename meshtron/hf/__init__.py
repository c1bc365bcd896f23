"""HuggingFace interop, an adapter over meshtron's parallel modules (not a second stack).

Checkpoints in and out (``convert.py``, ``io.py``, ``slices.py``), and any transformers causal LM parallelized by
``parallelize.py`` with the same composition as meshtron's own models. See docs/hf.md ('Files' maps the modules).
"""

from meshtron.hf.convert import from_hf, hf_config_dict, model_config_from_hf, to_hf
from meshtron.hf.io import (
    CheckpointError,
    check_hf_files,
    load_hf_model,
    load_hf_state_dict,
    read_hf_config,
    save_hf,
    weight_map,
)
from meshtron.hf.slices import load_native_sharded, load_sharded_weights

__all__ = [
    "CheckpointError",
    "check_hf_files",
    "from_hf",
    "hf_config_dict",
    "load_hf_model",
    "load_hf_state_dict",
    "load_native_sharded",
    "load_sharded_weights",
    "model_config_from_hf",
    "read_hf_config",
    "save_hf",
    "to_hf",
    "weight_map",
]
