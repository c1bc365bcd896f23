"""parallelize_hf_model's last line of defence (meshtron/hf/phases.py): a failure in a phase leaves as one
ConfigError on every rank naming the family, the layout, the phase, the module and the rank; a rank that did
not fail learns of it where the phase ends instead of waiting in its next collective."""

from __future__ import annotations

import contextlib

import pytest
import torch.distributed as dist

from meshtron.config import ConfigError
from meshtron.testing import HF_TINY_SIZES, cached_mesh, launch_tests


def _llama():
    import transformers

    config = transformers.LlamaConfig(**HF_TINY_SIZES, num_key_value_heads=2)
    return transformers.AutoModelForCausalLM.from_config(config)


@contextlib.contextmanager
def _failing(name: str, ranks: set[int], error: Exception):
    """meshtron/hf/parallelize.py's ``name`` raising ``error`` on ``ranks`` while it works on the second layer."""
    from meshtron.hf import parallelize

    original = getattr(parallelize, name)

    def fails(model, *args, **kwargs):
        for layer in model.model.layers:  # as a split walks the layers: the guard names the one it was on
            if dist.get_rank() in ranks and layer is model.model.layers[1]:
                raise error
        return original(model, *args, **kwargs)

    setattr(parallelize, name, fails)
    try:
        yield
    finally:
        setattr(parallelize, name, original)


def check_a_failure_is_one_error_on_every_rank():
    from meshtron import parallelize_hf_model

    prefix = r"^parallelize_hf_model could not split llama \(LlamaForCausalLM\) at tp 2 \+ SP: "
    cases = [
        # A structure the split cannot take fails alike on every rank, here inside tp's collectives.
        (
            "apply_hf_tensor_parallel",
            {0, 1},
            RuntimeError("an injected fault"),
            prefix + r"tensor parallelism failed on rank 0 at model\.layers\.1 \(LlamaDecoderLayer\): "
            r"RuntimeError: an injected fault\. That layout is not supported",
        ),
        # One rank alone, in a phase without collectives: the other learns of it as the phase ends.
        (
            "convert_float8",
            {1},
            KeyError("an injected key"),
            prefix + r"the float8 conversion failed on rank 1 at model\.layers\.1 \(LlamaDecoderLayer\): "
            r"KeyError: 'an injected key'\.",
        ),
        ("convert_float8", {1}, ConfigError("[train] fp8: an injected refusal."), r"^\[train\] fp8: an injected"),
    ]
    for name, ranks, error, expected in cases:
        with _failing(name, ranks, error), pytest.raises(ConfigError, match=expected):
            parallelize_hf_model(_llama(), cached_mesh(tp=2), sp=True, prove_blocks=False)
    parallelize_hf_model(_llama(), cached_mesh(tp=2), sp=True)  # without a fault the model splits, proved


@launch_tests(2, [check_a_failure_is_one_error_on_every_rank])
def test_phases_on_2_ranks():
    return ()
