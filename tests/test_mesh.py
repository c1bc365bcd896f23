"""The 5-D mesh: exact group members and communication on 2, 4 and 8 ranks; layout validation."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from meshtron import env
from meshtron.config import Config, ConfigError
from meshtron.mesh import batch_mesh, build_mesh, dense_data_mesh
from meshtron.parallel.layout import validate_layout
from meshtron.testing import launch_tests

ORDER = ("pp", "dp", "cp", "ep", "tp")
# What each group spans, written out here rather than taken from meshtron.mesh.
GROUPS = {
    "pp": {"pp"},
    "dp": {"dp"},
    "cp": {"cp"},
    "ep": {"ep"},
    "tp": {"tp"},
    "dp_ep": {"dp", "ep"},
    "dp_ep_cp": {"dp", "ep", "cp"},
}
HELPERS = {"dp_ep": batch_mesh, "dp_ep_cp": dense_data_mesh}
# The experts' own split of each stage's ranks (edp, ep, etp): folded, and unfolded with etp.
EXPERT_SHAPES = [
    dict(dp=2, tp=4, ep=8, fold_ep=True),
    dict(dp=2, tp=4, ep=4, etp=2, fold_ep=True),
    dict(dp=2, cp=2, tp=2, ep=4, etp=2, fold_ep=True),
    dict(pp=2, tp=4, ep=4, fold_ep=True),
    dict(dp=2, ep=2, tp=2, etp=2),
    dict(dp=2, ep=2, tp=2),
    dict(dp=4, tp=2),
]

SHAPES = {
    8: [
        dict(dp=8),
        dict(tp=8),
        dict(pp=2, tp=4),
        dict(dp=2, cp=2, tp=2),
        dict(pp=2, dp=2, ep=2),
        dict(pp=2, cp=2, ep=2),
    ],
    4: [dict(tp=2, cp=2), dict(dp=2, ep=2), dict(pp=2, dp=2)],
    2: [dict(dp=2), dict(tp=2), dict(ep=2)],
}


def _coords(rank: int, sizes: list[int]) -> list[int]:
    """Row-major coordinates of ``rank`` over (pp, dp, cp, ep, tp)."""
    out = []
    for size in reversed(sizes):
        out.append(rank % size)
        rank //= size
    return out[::-1]


def _expected_members(rank: int, sizes: list[int], spans: set[str]) -> list[int]:
    """Ranks that agree with ``rank`` on every dimension outside ``spans``."""
    mine = _coords(rank, sizes)
    fixed = [i for i, name in enumerate(ORDER) if name not in spans]
    return [q for q in range(math.prod(sizes)) if all(_coords(q, sizes)[i] == mine[i] for i in fixed)]


def check_layouts(shapes):
    rank = dist.get_rank()
    for shape in shapes:
        sizes = [shape.get(name, 1) for name in ORDER]
        mesh = build_mesh(**shape)
        assert tuple(mesh.shape) == tuple(sizes), (shape, mesh.shape)
        assert list(mesh.get_coordinate()) == _coords(rank, sizes), (shape, mesh.get_coordinate())
        for name, spans in GROUPS.items():
            with warnings.catch_warnings():  # torch warns that slicing a flattened name is being phased out
                warnings.simplefilter("ignore")
                sub = mesh[name]
            if name in HELPERS:
                assert HELPERS[name](mesh).get_group() is sub.get_group(), (shape, name)
            expected = _expected_members(rank, sizes, spans)
            group = sub.get_group()
            assert dist.get_process_group_ranks(group) == expected, (shape, name, expected)
            assert sub.get_local_rank() == expected.index(rank), (shape, name)
            # Powers of two make the sum name the exact member set.
            value = torch.tensor([2**rank], dtype=torch.int64, device=env.local_device())
            dist.all_reduce(value, group=group)
            assert value.item() == sum(2**q for q in expected), (shape, name, value.item(), expected)


def _expert_index(rank: int, shape: dict) -> tuple[int, int, int, int]:
    """(stage, edp, ep, etp) indices of ``rank``, from the rule as the docs state it: folded, a stage's
    ranks in mesh order reshaped into (edp, ep, etp); unfolded, ep is the mesh's ep, etp the
    innermost etp ranks of tp and edp the rest."""
    sizes = [shape.get(name, 1) if name != "ep" or not shape.get("fold_ep") else 1 for name in ORDER]
    pp, dp, cp, ep, tp = _coords(rank, sizes)
    etp = shape.get("etp", 1)
    if shape.get("fold_ep"):
        flat = (dp * sizes[2] + cp) * sizes[4] + tp
        return pp, flat // (shape["ep"] * etp), flat // etp % shape["ep"], flat % etp
    return pp, (dp * sizes[2] + cp) * (sizes[4] // etp) + tp // etp, ep, tp % etp


def check_expert_layouts(_shapes):
    """Every expert group holds exactly the ranks the rule names, in order, and communicates."""
    from meshtron.mesh import expert_meshes

    rank, world = dist.get_rank(), dist.get_world_size()
    for shape in EXPERT_SHAPES:
        meshes = expert_meshes(build_mesh(**shape))
        mine = _expert_index(rank, shape)
        index = [_expert_index(q, shape) for q in range(world)]
        for varies, group in ((1, meshes.data), (2, meshes.model["ep"]), (3, meshes.model["etp"])):
            expected = [q for q in range(world) if all(index[q][i] == mine[i] for i in range(4) if i != varies)]
            assert dist.get_process_group_ranks(group.get_group()) == expected, (shape, varies, expected)
            assert group.get_local_rank() == mine[varies], (shape, varies)
            value = torch.tensor([2**rank], dtype=torch.int64, device=env.local_device())
            dist.all_reduce(value, group=group.get_group())
            assert value.item() == sum(2**q for q in expected), (shape, varies)


def check_errors_before_collectives(shapes):
    world = dist.get_world_size()
    # Only rank 0 asks for a bad mesh: had it started any collective, it would wait on the others forever.
    if dist.get_rank() == 0:
        with pytest.raises(ConfigError, match=rf"dp=3 x cp=1 x ep=1 x tp=1 = 3, but the world size is {world}"):
            build_mesh(dp=3)
        with pytest.raises(ConfigError, match=r"etp = 3 must divide tp = 2 .*valid etp: 1, 2"):
            build_mesh(dp=world // 2, tp=2, etp=3)
        with pytest.raises(ConfigError, match=rf"fold_ep = true needs ep x etp = 3 x 1 to divide .* = {world}"):
            build_mesh(dp=world, ep=3, fold_ep=True)
        with pytest.raises(ConfigError, match="tp must be an integer >= 1, got 0"):
            build_mesh(dp=world, tp=0)
    dist.barrier()
    with pytest.raises(ConfigError, match=rf"= {2 * world}, but the world size is {world}.*launch {2 * world} ranks"):
        build_mesh(pp=2, dp=world)
    dist.barrier()


def check_init_from_launcher_env(port):
    """As under torchrun: no process group yet, only the launcher's environment variables."""
    world = dist.get_world_size()
    dist.destroy_process_group()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    mesh = build_mesh(dp=world)
    assert dist.is_initialized() and dist.get_backend() == env.backend()
    assert dist.get_process_group_ranks(mesh["dp"].get_group()) == list(range(world))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@launch_tests(8, [check_layouts, check_errors_before_collectives, check_expert_layouts], timeout=120)
def test_groups_and_errors_8_ranks():
    return (SHAPES[8],)


@launch_tests(4, [check_layouts, check_errors_before_collectives], timeout=120)
def test_groups_and_errors_4_ranks():
    return (SHAPES[4],)


@launch_tests(2, [check_layouts], timeout=120)
def test_groups_two_ranks():
    return (SHAPES[2],)


@launch_tests(2, [check_init_from_launcher_env], timeout=120)
def test_init_from_launcher_env():
    return (_free_port(),)


def test_build_mesh_single_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="= 2, but the world size is 1"):
        build_mesh(tp=2)
    assert not dist.is_initialized()
    mesh = build_mesh()
    try:
        assert tuple(mesh.shape) == (1, 1, 1, 1, 1)
        assert dist.get_process_group_ranks(dense_data_mesh(mesh).get_group()) == [0]
    finally:
        dist.destroy_process_group()


# ---- validate_layout: pure, no process group --------------------------------------------------


def _cfg(model=None, parallel=None, train=None) -> Config:
    cfg = Config()
    for section, values in (("model", model), ("parallel", parallel), ("train", train)):
        for key, value in (values or {}).items():
            setattr(getattr(cfg, section), key, value)
    return cfg


QWEN_7B = dict(num_attention_heads=28, num_key_value_heads=4, hidden_size=3584, num_hidden_layers=28)
MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=64)


@pytest.mark.parametrize(
    "world, cfg",
    [
        (1, _cfg()),
        (8, _cfg(parallel=dict(dp=8))),
        (8, _cfg(QWEN_7B, dict(tp=4, dp=2, sp=True), dict(seq_len=64))),
        (8, _cfg(dict(num_attention_heads=16, num_key_value_heads=2), dict(tp=8))),  # KV heads replicated
        (8, _cfg(MOE, dict(pp=2, dp=2, ep=2, microbatches=2), dict(global_batch_size=8))),
        (
            8,
            _cfg(
                parallel=dict(pp=2, cp=2, tp=2, schedule="interleaved", virtual_stages=2, microbatches=2),
                train=dict(seq_len=8),
            ),
        ),
        (2, _cfg(parallel=dict(tp=2, sp=True), train=dict(seq_len=130))),
        (1, _cfg(parallel=dict(sp=True), train=dict(seq_len=127))),  # sp without tp does nothing
        (4, _cfg(parallel=dict(dp=4, microbatches=3), train=dict(global_batch_size=24))),  # accumulation
    ],
)
def test_valid_layouts_pass(world, cfg):
    validate_layout(cfg, world)


def _message(cfg: Config, world: int) -> str:
    with pytest.raises(ConfigError) as err:
        validate_layout(cfg, world)
    return str(err.value)


INVALID = [
    (8, _cfg(parallel=dict(dp=2, tp=2)), ["pp=1 x dp=2 x cp=1 x ep=1 x tp=2 = 4", "world size is 8", "launch 4 ranks"]),
    (8, _cfg(parallel=dict(dp=8, cp=0)), ["[parallel] cp must be an integer >= 1, got 0"]),
    (
        8,
        _cfg(QWEN_7B, dict(tp=8)),
        ["tp = 8 does not divide", "num_attention_heads = 28", "Valid tp up to 8 for this model: 1, 2, 4."],
    ),
    (
        6,
        _cfg(dict(num_attention_heads=12, num_key_value_heads=4), dict(tp=6)),
        ["tp = 6 and num_key_value_heads = 4 do not divide one another", "Valid tp up to 8 for this model: 1, 2, 4."],
    ),
    (8, _cfg(MOE, dict(ep=4, dp=2)), ["ep = 4 does not divide", "num_experts = 6", "Valid ep up to 8: 1, 2, 3, 6."]),
    (
        2,
        _cfg(parallel=dict(pp=2, schedule="interleaved")),
        ["needs pp >= 2 and virtual_stages >= 2", "virtual_stages = 1"],
    ),
    (1, _cfg(parallel=dict(schedule="interleaved", virtual_stages=2)), ["got pp = 1"]),
    (
        2,
        _cfg(dict(num_hidden_layers=3), dict(pp=2, schedule="interleaved", virtual_stages=2)),
        ["[model] num_hidden_layers = 3", "pp * virtual_stages = 4 pipeline stages"],
    ),
    (8, _cfg(parallel=dict(cp=4, dp=2), train=dict(seq_len=100)), ["seq_len = 100", "2 x cp = 8", "Use seq_len = 104"]),
    (
        8,
        _cfg(dict(num_attention_heads=16, num_key_value_heads=4), dict(cp=2, tp=4, sp=True), dict(seq_len=20)),
        ["cp x tp = 8 with sp = true", "Use seq_len = 24"],
    ),
    (
        4,
        _cfg(parallel=dict(dp=4), train=dict(global_batch_size=6)),
        ["global_batch_size = 6", "dp x ep = 4", "Use global_batch_size = 8"],
    ),
    (
        8,
        _cfg(parallel=dict(pp=2, dp=4, microbatches=4), train=dict(global_batch_size=8)),
        ["microbatches = 4", "8 / 4 = 2", "Valid microbatches: 1, 2."],
    ),
]


@pytest.mark.parametrize("world, cfg, fragments", INVALID)
def test_invalid_layouts_name_the_values_and_fix(world, cfg, fragments):
    message = _message(cfg, world)
    for fragment in fragments:
        assert fragment in message, (fragment, message)


_EXIT_SCRIPT = """
import atexit, sys
from meshtron.mesh import exit_process

class Finalized:
    def __del__(self):
        print("finalized", flush=True)

kept = Finalized()
atexit.register(print, "atexit ran")
print("buffered", end="")
{end}(3)
"""


@pytest.mark.parametrize("end, finalized", [("exit_process", False), ("sys.exit", True)])
def test_exit_process_runs_atexit_handlers_and_skips_finalization(end, finalized):
    """A finished job ends through ``exit_process``: gloo's worker threads may still release the last
    collective's tensors, which aborts the process if the interpreter is finalizing. sys.exit is the
    control: the same script is finalized."""
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT.format(end=end)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
        timeout=120,
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout.startswith("bufferedatexit ran\n")
    assert ("finalized" in done.stdout) == finalized
