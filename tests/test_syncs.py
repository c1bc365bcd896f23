"""Host syncs of a training step, counted on CPU ranks (``meshtron.watch.syncs.HostSyncCounter``).

What is allowed, exactly:

* ``meshtron.train.training_step`` (forward, backward, clipping, optimizer update) of a dense model: none,
  pipelined or not;
* with expert parallelism: one per MoE layer and micro-batch, the dispatch's split sizes (the
  backward reuses them and adds none, a checkpointed layer's recomputation included);
* with context parallelism over packed documents (``[data] document_mask``): one per micro-batch, the
  document-start bounds that decide which attention blocks run (every layer reuses them);
* ``Trainer.train_step`` adds, on a step it logs, one read after the step is queued (every unread step's
  loss and grad norm and the aux loss in one copy), besides the data pipeline, which works on host tensors
  before they are copied to the device; on the first step after a read, the barrier its step clock starts
  at (no tensor op: on CUDA it waits for a device the read left idle); on the other steps nothing.

On CUDA, ``benchmarks/mfu.py`` runs the step under ``torch.cuda.set_sync_debug_mode("error")``,
which also catches host/device copies (every tensor is a host tensor on CPU).

Also here: the ops the trainer adds on one rank to the model's own step, bounded per parameter, per
FSDP unit and per step (on one GPU each op is host dispatch and a kernel launch).
"""

from __future__ import annotations

import collections
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from meshtron.config import load_config
from meshtron.testing import count_calls, launch_tests
from meshtron.torch_private import TorchDispatchMode
from meshtron.watch.syncs import HostSyncCounter

ROOT = Path(__file__).resolve().parents[1]


def test_counter_sees_every_kind_of_sync():
    x = torch.randn(16)
    with HostSyncCounter() as pure:
        y = torch.where(x > 0, x * 2, x.exp()).cumsum(0)
        y[y < 0] = 0.0  # one mask and a host scalar: masked_fill, no sizes needed
        torch.repeat_interleave(torch.arange(3), torch.tensor([1, 2, 3]), output_size=6)
    assert pure.count == 0, pure
    with HostSyncCounter() as syncs:
        y.sum().item()
        bool(y[0] > 0)
        float(y.max())
        (y > 0).nonzero()
        y[y > 0]
        y.tolist()
        torch.repeat_interleave(torch.arange(3), torch.tensor([1, 2, 3]))
        torch.unique(y)
    assert syncs.by_op() == {
        "_local_scalar_dense": 3,
        "nonzero": 1,
        "index": 1,
        "tolist": 1,
        "repeat_interleave": 1,
        "_unique2": 1,
    }, syncs
    assert all(s.where.startswith(__file__) for s in syncs.syncs), syncs


def test_a_counter_without_methods_sees_every_read_of_a_fake_tensor():
    """The dry run's counter (``methods=False``, no torch-function mode): a fake tensor's ``tolist`` and ``item``
    reach the dispatcher, where it counts them before the fake tensor refuses them; its ``numpy`` fails
    outright."""
    from meshtron.host import fake_tensors, simulated

    with simulated(), fake_tensors():
        x = torch.ones(4, dtype=torch.long)
        with HostSyncCounter(methods=False) as syncs:
            for read in (x.tolist, x[0].item):
                with pytest.raises(Exception, match="_local_scalar_dense"):
                    read()
            with pytest.raises(RuntimeError, match=r"\.numpy\(\) is not supported for tensor subclasses"):
                x.numpy()
    assert syncs.by_op() == {"_local_scalar_dense": 2}, syncs


def _trainer(recipe: str, root: str, layout: dict, extra: list[str] = ()):
    from meshtron.train import Trainer, recipe_mesh

    args = [
        "--train.output_dir",
        f"{root}/{recipe}",
        "--data.cache_dir",
        f"{root}/token_cache",
        "--parallel.microbatches",
        "2",
    ]
    for key, value in layout.items():
        args += [f"--parallel.{key}", str(value).lower()]
    cfg = load_config(ROOT / "recipes" / f"{recipe}.toml", args + list(extra))
    return Trainer(cfg, recipe_mesh(cfg))


def _counted_step(trainer, step: int) -> tuple[HostSyncCounter, HostSyncCounter]:
    """Syncs of ``training_step`` alone, then of a whole ``Trainer.train_step`` (after a warm-up step)."""
    from meshtron.train import training_step

    ids, labels, *positions = trainer.dataset.batch_for_step(  # positions with [data] document_mask
        step, trainer.batch_mesh.get_local_rank(), trainer.batch_mesh.size(), trainer.cfg.parallel.microbatches
    )
    with HostSyncCounter() as inner:
        training_step(trainer.runner, trainer.optimizer, ids, labels, trainer.cfg.train.max_grad_norm, *positions)
    with HostSyncCounter() as whole:
        record = trainer.train_step(step + 1)
    assert record["loss"] > 0 and record["grad_norm"] > 0
    return inner, whole


def _outside_data(syncs: HostSyncCounter) -> list[str]:
    return [s.where for s in syncs.syncs if "/meshtron/data/" not in s.where]


def dense_step_has_no_sync(root: str) -> None:
    trainer = _trainer("debug_dense", root, {"dp": 2, "ep": 1, "tp": 2, "sp": True})
    trainer.train_step(0)
    inner, whole = _counted_step(trainer, 1)
    assert inner.count == 0, inner
    (read,) = _outside_data(whole)
    assert "read_scalars" in read, whole


def trainer_reads_the_device_on_logged_steps_only(root: str) -> None:
    """With ``log_every = 3``: per step (device reads outside the data pipeline, barriers, a record returned)."""
    trainer = _trainer(
        "debug_dense", f"{root}/every_3", {"dp": 2, "ep": 1, "tp": 2, "sp": True}, ["--train.log_every", "3"]
    )
    seen = []
    for step in range(6):
        with HostSyncCounter() as syncs, count_calls(dist, "barrier") as barriers:
            record = trainer.train_step(step)
        seen.append((len(_outside_data(syncs)), len(barriers), record is not None))
    assert seen == [(0, 1, False), (0, 0, False), (1, 0, True)] * 2, seen
    assert record["step"] == 6 and record["loss"] > 0 and record["step_time"] > 0


@pytest.mark.full
def pipelined_step_has_no_sync(root: str) -> None:
    for layout in (
        {"pp": 2, "dp": 2, "ep": 1, "tp": 1, "schedule": "1f1b"},
        {"pp": 2, "dp": 1, "ep": 1, "tp": 2, "sp": True, "schedule": "interleaved", "virtual_stages": 2},
    ):
        trainer = _trainer("debug_dense", root, layout)
        trainer.train_step(0)
        inner, whole = _counted_step(trainer, 1)
        assert inner.count == 0, (layout, inner.by_op(), [s.where for s in inner.syncs])
        (read,) = _outside_data(whole)
        assert "read_scalars" in read, (layout, whole)


@pytest.mark.full
def moe_step_syncs_once_per_moe_layer(root: str) -> None:
    # Checkpointed layers too: their recomputation takes the split sizes its forward read (it read them
    # again, a second sync per layer, until meshtron.host.KeptReads).
    for checkpointing in ("none", "full"):
        trainer = _trainer(
            "debug_moe",
            root,
            {"dp": 2, "ep": 2, "tp": 1, "sp": False, "activation_checkpointing": f'"{checkpointing}"'},
        )
        trainer.train_step(0)
        inner, _ = _counted_step(trainer, 1)
        moe_layers = sum(trainer.cfg.model.is_moe_layer(i) for i in range(trainer.cfg.model.num_hidden_layers))
        assert moe_layers > 0 and inner.count == moe_layers * trainer.cfg.parallel.microbatches, (checkpointing, inner)
        # The dispatch's split sizes, read where every host read of the step is named (meshtron.host).
        assert all("split_sizes" in s.where for s in inner.syncs), inner


@pytest.mark.full
def document_masked_cp_step_syncs_once_per_microbatch(root: str) -> None:
    for comm in ("p2p", "a2a"):
        trainer = _trainer(
            "debug_dense",
            root,
            {"dp": 2, "cp": 2, "ep": 1, "tp": 1, "cp_comm_type": f'"{comm}"'},
            ["--data.document_mask", "true"],
        )
        trainer.train_step(0)
        inner, _ = _counted_step(trainer, 1)
        assert inner.count == trainer.cfg.parallel.microbatches, (comm, inner.by_op(), [s.where for s in inner.syncs])
        # The documents' start bounds, read where every host read of the step is named (meshtron.host).
        assert all("document_starts" in s.where for s in inner.syncs), inner


def transformers_step_has_no_sync(root: str) -> None:
    """A transformers model (``[model] hf_model``) at dp 2 x tp 2 + SP: its mask builder's check for sequences
    packed into a row, which reads the device once per forward, is answered by meshtron.hf's runner (it
    passes whole sequences only): two reads a step until it was."""
    import transformers

    folder = f"{root}/qwen2_hf"
    if dist.get_rank() == 0:
        transformers.Qwen2Config(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
        ).save_pretrained(folder)
    dist.barrier()
    trainer = _trainer("debug_dense", root, {"dp": 2, "ep": 1, "tp": 2, "sp": True}, ["--model.hf_model", folder])
    trainer.train_step(0)
    inner, _ = _counted_step(trainer, 1)
    assert inner.count == 0, (inner.by_op(), [s.where for s in inner.syncs])


@launch_tests(
    4,
    [
        dense_step_has_no_sync,
        trainer_reads_the_device_on_logged_steps_only,
        pipelined_step_has_no_sync,
        moe_step_syncs_once_per_moe_layer,
        document_masked_cp_step_syncs_once_per_microbatch,
        transformers_step_has_no_sync,
    ],
    timeout=300,
)
def test_training_step_syncs(tmp_path):
    return (str(tmp_path),)


class _OpCounter(TorchDispatchMode):
    """aten (and c10d, fsdp) ops dispatched while entered, by name; a DTensor op counts once."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _ops_per_step(step) -> collections.Counter:
    step()  # warm-up: the optimizer state is created in the first step
    with _OpCounter() as counter:
        step()
    return counter.ops


def test_one_rank_trainer_adds_few_ops_to_the_models_step():
    """``training_step`` on one rank against the bare model's step (forward / token count, backward,
    fused AdamW, under autocast for bf16), both from ``benchmarks/cpu_step_vs_transformers.py``.

    Allowed extra ops: per parameter 3 (FSDP2's one-rank unshard copies the cast parameter into its
    unsharded buffer in the forward and again in the backward; its gradient is a view of the unit's
    reduce buffer); per FSDP unit 20 (its hooks' record_function pairs, the reduce buffer filled and
    copied once); per step 100 (micro-batch split, token count, loss sum, clipping with one foreach norm
    and one foreach scale per dtype, the non-finite guard). Clipping per tensor (a norm and a scale per
    parameter) or dividing every gradient by a factor of 1 exceeds it."""
    spec = importlib.util.spec_from_file_location("cpu_step", ROOT / "benchmarks" / "cpu_step_vs_transformers.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from meshtron.mesh import init_default_group

    args = bench.parse_args(["--tiny"])
    cfg = bench.model_config(args)
    own_group = not dist.is_initialized()
    init_default_group()
    try:
        for dtype in ("bfloat16", "float32"):
            batch = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
            steps = bench.contestants(cfg, dtype, batch, seed=0)
            trainer, model = _ops_per_step(steps["meshtron trainer"]), _ops_per_step(steps["meshtron model"])
            params = sum(1 for _ in bench.transformers_model(cfg, 0).parameters())
            units = cfg.num_hidden_layers + 3  # each block, the embedding, the LM head, the root
            extra = sum(trainer.values()) - sum(model.values())
            assert extra <= 3 * params + 20 * units + 100, (dtype, extra, trainer - model)
            assert trainer["aten._foreach_norm"] == 1 and "aten.linalg_vector_norm" not in trainer, (dtype, trainer)
            assert "aten.div" not in trainer - model, (dtype, trainer - model)  # no divide by one data rank
    finally:
        if own_group:
            dist.destroy_process_group()
