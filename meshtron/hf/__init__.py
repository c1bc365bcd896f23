"""HuggingFace interop, an adapter over meshtron's parallel modules (not a second stack).

Checkpoints in and out: ``convert.py`` (meshtron's names and transformers'), ``io.py`` (safetensors
folders, read per rank by ``slices.py``). Any transformers causal LM parallelized: ``parallelize.py``
finds the model's parts (``discover.py``) and composes tp (``tp_plan.py``; ``infer.py`` infers a plan
for a config that has none), experts (``experts.py``; ``router.py`` the load-balancing loss over ranks), cp
(``context.py``), pp (``pipeline.py``) and FSDP; ``prove.py`` checks each kind of block, split, against
itself whole; ``loss.py`` and ``runner.py`` give the trainer its step (``[model] hf_model``) and export.
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
