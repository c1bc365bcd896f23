"""Each kind of decoder block proven right before training: split as the plan made it, against itself whole.

Translated tp plans, SP and ep's dispatch can be wrong for a family nobody has tried, and a wrong split trains
without an error. :func:`record_references` runs the first block of each kind whole on a probe batch before
anything is split; :func:`prove_blocks` runs it split and compares output, input gradient and parameter
gradients, and every rank raises the same :class:`ConfigError`. See docs/hf.md, 'Every split block proven
before training'.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from meshtron.config import ConfigError
from meshtron.hf.discover import HFParts, calls_attention_interface, layer_config
from meshtron.host import simulating
from meshtron.mesh import batch_mesh, dense_data_mesh, expert_data_mesh, expert_split
from meshtron.parallel.context import shard_sequence
from meshtron.parallel.float8 import gemms_in_training_dtype

# Errors are relative to the largest reference value; a gradient that is zero analytically (a key bias
# under softmax) is compared against this share of the block's largest gradient instead.
_FLOOR = 1e-3
_TOLERANCE = {torch.float32: (1e-4, 1e-3), torch.float64: (1e-9, 1e-8)}  # (activations, parameter gradients)
_LOW_PRECISION = (2e-2, 5e-2)
_PROBE_ROWS_PER_RANK = 1


class _InputsCaptured(Exception):
    """Stops the probe forward once every kind's first block has its inputs."""


@dataclass
class _Reference:
    index: int  # the block's global index
    hidden: torch.Tensor  # [rows, S, H] of this rank's probe rows
    grad_out: torch.Tensor
    out: torch.Tensor = None
    hidden_grad: torch.Tensor = None
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    causes: list[str] = field(default_factory=list)  # what the layout cannot serve: :func:`_known_causes`


def block_kinds(blocks: list[tuple[int, nn.Module]], config=None) -> list[tuple[int, nn.Module]]:
    """The first of ``(index, block)`` of each kind: what makes two blocks split differently, their class and
    their submodules' names and classes (Qwen2-MoE's dense and sparse layers share a class), their parameters'
    shapes (Gemma 4's full-attention layers have a head_dim of their own) and, from ``config``, the layer's
    attention type (sliding or full) and its own per-layer config."""
    seen, first = set(), []
    for index, block in blocks:
        kind = (
            type(block),
            tuple((name, type(m)) for name, m in block.named_modules()),
            tuple((name, tuple(p.shape)) for name, p in block.named_parameters()),
            _layer_kind(config, index),
        )
        if kind not in seen:
            seen.add(kind)
            first.append((index, block))
    return first


def _layer_kind(config, index: int) -> tuple:
    """What the config says of layer ``index`` alone: its entry of ``layer_types`` and its per-layer overrides."""
    if config is None:
        return ()
    types = getattr(config, "layer_types", None)
    own = layer_config(config, index)
    overrides = sorted((k, repr(v)) for k, v in vars(own).items() if own is not config and vars(config).get(k) != v)
    return (types[index] if types else None, tuple(overrides))


def probe_length(mesh: DeviceMesh) -> int:
    """A sequence cp splits into 2 x cp equal chunks and tp (under SP) into equal shards of each rank's."""
    return 8 * mesh["tp"].size() * mesh["cp"].size()


def _probe_ids(model: nn.Module, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's probe rows of a global batch that is the same on every rank (dp x ep ranks read different rows)."""
    readers = batch_mesh(mesh)
    gen = torch.Generator().manual_seed(20261126)
    ids = torch.randint(
        0, model.config.vocab_size, (readers.size() * _PROBE_ROWS_PER_RANK, probe_length(mesh)), generator=gen
    )
    row = readers.get_local_rank() * _PROBE_ROWS_PER_RANK
    return ids[row : row + _PROBE_ROWS_PER_RANK]


def _hidden_of(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _with_hidden(args: tuple, kwargs: dict, hidden: torch.Tensor) -> tuple[tuple, dict]:
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def _call(module: nn.Module, args: tuple, kwargs: dict, hidden: torch.Tensor):
    """``module`` called as it was with ``args`` / ``kwargs``, on ``hidden`` in place of their hidden states;
    on copies of their containers, which a block may write into."""
    args, kwargs = _with_hidden(*_snapshot((args, kwargs)), hidden)
    return module(*args, **kwargs)


def _snapshot(value):
    """``value`` with its mappings, lists and tuples copied (the tensors in them shared): Gemma 4's blocks write
    their keys and values into the ``shared_kv_states`` dict the decoder hands every block, so a block run
    alone would otherwise leave its graph there for the next one to backward through."""
    if isinstance(value, MutableMapping):  # a dict, or transformers' KVSharingDict (a UserDict)
        copied = copy.copy(value)
        for key, item in value.items():
            copied[key] = _snapshot(item)
        return copied
    if isinstance(value, (list, tuple)):
        return type(value)(_snapshot(v) for v in value)
    return value


def _first_output(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _raised(err: Exception) -> str:
    return f"forward and backward (the split block raised {type(err).__name__}: {str(err).splitlines()[0][:200]})"


def _capture_inputs(blocks: list[tuple[int, nn.Module]], forward: Callable[[], object]) -> dict[int, tuple]:
    """(args, kwargs) ``forward()`` (the model's, or a stage's) hands each of ``blocks``."""
    captured: dict[int, tuple] = {}

    def hook(index):
        def capture(_module, args, kwargs):
            captured[index] = _snapshot((args, kwargs))  # as handed to this block, before later blocks write
            if len(captured) == len(blocks):
                raise _InputsCaptured

        return capture

    handles = [block.register_forward_pre_hook(hook(index), with_kwargs=True, prepend=True) for index, block in blocks]
    try:
        with torch.no_grad():
            forward()
    except _InputsCaptured:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return captured


@contextmanager
def _eval_mode(model: nn.Module):
    """Eval mode (no dropout) for the probe, the model's own mode restored after; float8 linears ([train] fp8)
    in the training dtype (:func:`~meshtron.parallel.float8.gemms_in_training_dtype`)."""
    training = model.training
    model.eval()
    try:
        with gemms_in_training_dtype():
            yield
    finally:
        model.train(training)


def _run(block: nn.Module, args: tuple, kwargs: dict, hidden: torch.Tensor, grad_out: torch.Tensor):
    """Forward and backward of ``block`` on ``hidden`` (a fresh leaf): (output, input gradient)."""
    leaf = hidden.detach().clone().requires_grad_()
    out = _first_output(_call(block, args, kwargs, leaf))
    out.backward(grad_out)
    return out.detach(), leaf.grad


def _model_forward(model: nn.Module, mesh: DeviceMesh) -> Callable[[], object]:
    """The model's own forward on this rank's probe rows (under cp its hook keeps this rank's chunks)."""
    ids = _probe_ids(model, mesh).to(next(model.parameters()).device)
    return lambda: model(input_ids=ids, use_cache=False)


def record_references(
    model: nn.Module, kinds: list[tuple[int, nn.Module]], mesh: DeviceMesh, sp: bool
) -> list[_Reference]:
    """Each of ``kinds`` (:func:`block_kinds`) run whole on this rank's probe rows (docs/hf.md)."""
    with _eval_mode(model):
        captured = _capture_inputs(kinds, _model_forward(model, mesh))
        references = []
        for index, block in kinds:
            args, kwargs = captured[index]
            hidden = _hidden_of(args, kwargs).detach()
            gen = torch.Generator().manual_seed(index)
            ref = _Reference(index, hidden, torch.randn(hidden.shape, generator=gen).to(hidden))
            ref.out, ref.hidden_grad = _run(block, args, kwargs, hidden, ref.grad_out)
            ref.grads = {name: p.grad.detach().clone() for name, p in block.named_parameters() if p.grad is not None}
            block.zero_grad(set_to_none=True)
            ref.causes = _known_causes(block, args, kwargs, hidden, mesh, sp)
            references.append(ref)
    return references


def _known_causes(
    block: nn.Module, args: tuple, kwargs: dict, hidden: torch.Tensor, mesh: DeviceMesh, sp: bool
) -> list[str]:
    """What in ``block`` this layout is known not to serve, for the block check's refusal to name when the
    split block differs: under SP a second input shaped like the residual stream (SP splits the stream
    only), under cp the token mixers the ring does not serve."""
    causes = []
    if sp and mesh["tp"].size() > 1 and (streams := _stream_twins(block, args, kwargs, hidden)):
        causes.append(
            f"{type(block).__name__} takes {', '.join(streams)} beside its hidden states {list(hidden.shape)}, "
            "along the same tokens: under SP the stream is split along the sequence, that input is not. Set "
            "[parallel] sp = false for this family"
        )
    if mesh["cp"].size() > 1 and (mixers := _unserved_mixers(block, args, kwargs, hidden)):
        causes.append(
            f"{', '.join(mixers)} {'mix' if len(mixers) > 1 else 'mixes'} tokens along the sequence and "
            f"{'are' if len(mixers) > 1 else 'is'} not softmax attention, the only mixer cp's ring "
            "attention serves: under cp it would see only this rank's chunks of each sequence. Set "
            "[parallel] cp = 1 for this family"
        )
    return causes


def _stream_twins(block: nn.Module, args: tuple, kwargs: dict, hidden: torch.Tensor) -> list[str]:
    """``block``'s inputs other than its hidden states (the first argument, or ``hidden_states``) along the
    same tokens, named with their shapes: Zamba2's hybrid layers also take the embedding output
    (``original_hidden_states``), Gemma 4's a ``per_layer_input`` of its own width."""
    names = list(inspect.signature(block.forward).parameters)
    named = [(names[i] if i < len(names) else f"argument {i}", a) for i, a in enumerate(args)][1:]
    named += [(k, v) for k, v in kwargs.items() if args or k != "hidden_states"]
    return [
        f"'{name}' {list(value.shape)}"
        for name, value in named
        if isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and value.dim() == hidden.dim()
        and value.shape[:-1] == hidden.shape[:-1]
    ]


def _unserved_mixers(block: nn.Module, args: tuple, kwargs: dict, hidden: torch.Tensor) -> list[str]:
    """The outermost parts of ``block`` ("path (Class)") that mix tokens along the sequence and are not
    attention cp's ring serves (a module calling transformers' attention interface, or one holding such):
    mamba, convolution and linear-attention mixers, which under cp would see only this rank's chunks.
    Found by what they do, not by name: each part is run again on the input the block handed it with its
    first token changed; a part whose output at a later token moves mixes tokens."""
    calls: dict[int, tuple] = {}

    def record(module, a, kw):
        calls.setdefault(id(module), (a, kw))

    parts = [(path, m) for path, m in block.named_modules() if path]
    handles = [m.register_forward_pre_hook(record, with_kwargs=True) for _, m in parts]
    try:
        with torch.no_grad():
            _call(block, args, kwargs, hidden)
    finally:
        for handle in handles:
            handle.remove()
    served = {id(m) for _, m in parts if any(calls_attention_interface(sub) for sub in m.modules())}
    found: list[tuple[str, nn.Module]] = []
    for path, module in parts:
        inside_found = any(path.startswith(f"{outer}.") for outer, _ in found)
        if id(module) in served or id(module) not in calls or inside_found:
            continue
        if _mixes_tokens(module, *calls[id(module)], hidden.shape[1]):
            found.append((path, module))
    return [f"'{path}' ({type(module).__name__})" for path, module in found]


def _mixes_tokens(module: nn.Module, args: tuple, kwargs: dict, length: int) -> bool:
    """Whether ``module``'s output at tokens 1.. changes with its input's token 0 (inputs [rows, length, ...]
    only: a part called on anything else, or that cannot run again alone, is not judged)."""
    x = args[0] if args else kwargs.get("hidden_states")
    if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() >= 2 and x.shape[1] == length > 1):
        return False
    changed = x.clone()
    changed[:, 0] += 1.0 + changed[:, 0].abs()
    try:
        with torch.no_grad():
            outs = [_first_output(_call(module, args, kwargs, t)) for t in (x.clone(), changed)]
    except Exception:  # noqa: BLE001 - a part that only runs inside its parent's forward is not judged
        return False
    a, b = outs
    if not (isinstance(a, torch.Tensor) and a.dim() >= 2 and a.shape[1] == length):
        return False
    return bool((a[:, 1:] - b[:, 1:]).abs().max() > 1e-6 * a[:, 1:].abs().max().clamp_min(1e-30))


def _held(t: torch.Tensor, mesh: DeviceMesh, sp_shard: bool) -> torch.Tensor:
    """What this rank holds of a whole-sequence [rows, S, ...] tensor: its cp chunks, and their tp shard
    under SP."""
    cp = mesh["cp"]
    if cp.size() > 1:
        t = shard_sequence(t, cp.get_local_rank(), cp.size())
    return t.chunk(mesh["tp"].size(), dim=1)[mesh["tp"].get_local_rank()] if sp_shard else t


def _summed(tensors: list[torch.Tensor], group_mesh: DeviceMesh) -> list[torch.Tensor]:
    """Each of ``tensors`` summed over ``group_mesh``: one all-reduce of them all (a block has dozens)."""
    if group_mesh.size() == 1 or not tensors:
        return tensors
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    dist.all_reduce(flat, group=group_mesh.get_group())
    return [part.view(t.shape).to(t.dtype) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


def _whole(grad: torch.Tensor) -> torch.Tensor:
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def _error(actual: torch.Tensor, expected: torch.Tensor, floor: float) -> float:
    if actual.shape != expected.shape:
        return math.inf
    scale = max(expected.detach().abs().max().item(), floor)
    return ((actual.detach().float() - expected.detach().float()).abs().max() / scale).item() if scale > 0 else 0.0


def _layout_text(mesh: DeviceMesh, sp: bool) -> str:
    sizes = [f"{name} {mesh[name].size()}" for name in mesh.mesh_dim_names if mesh[name].size() > 1]
    return " x ".join(sizes or ["1 rank"]) + (" + SP" if sp else "")


def _placements(p: torch.Tensor) -> str:
    if not isinstance(p, DTensor):
        return "whole"
    return ", ".join(f"{name} {placement}" for name, placement in zip(p.device_mesh.mesh_dim_names, p.placements))


def _comparisons(
    block: nn.Module, ref: _Reference, inputs: tuple, mesh: DeviceMesh, sp: bool, first: bool, experts: set[int]
) -> list[tuple[str, float, float]]:
    """(what, error, tolerance) of the split block against ``ref``, in one order on every rank; ``inputs``:
    the (args, kwargs) the split model's forward hands the block."""
    shard_in = sp and not first  # the first block slices its (replicated) input itself under SP
    hidden, grad_out = _held(ref.hidden, mesh, shard_in), _held(ref.grad_out, mesh, sp)
    act_tol, grad_tol = _TOLERANCE.get(ref.out.dtype, _LOW_PRECISION)
    params = dict(block.named_parameters())
    named = [(name, params.get(name)) for name in ref.grads]  # a parameter renamed by the split is missing
    try:
        out, hidden_grad = _run(block, *inputs, hidden, grad_out)
    except Exception as err:  # noqa: BLE001 - a split that cannot run is refused like one that computes wrong
        block.zero_grad(set_to_none=True)
        what = _raised(err)
        return [(what, math.inf, act_tol)] + [("output", math.inf, act_tol)] * (1 + len(named))
    expected_out, expected_hidden_grad = _held(ref.out, mesh, sp), _held(ref.hidden_grad, mesh, shard_in)
    found = [
        ("output", _error(out, expected_out, 0.0), act_tol),
        ("input gradient", _error(hidden_grad, expected_hidden_grad, 0.0), act_tol),
    ]
    expected = dict(zip(ref.grads, _summed(list(ref.grads.values()), batch_mesh(mesh))))
    floor = _FLOOR * max((g.abs().max().item() for g in expected.values()), default=0.0)
    actual = _gradients_summed(named, experts, mesh)
    for name, p in named:
        if p is None:
            found.append((f"gradient of '{name}' (no parameter of that name after splitting)", math.inf, grad_tol))
            continue
        found.append(
            (
                f"gradient of '{name}' ({type(block.get_submodule(name.rpartition('.')[0])).__name__}, "
                f"{_placements(p)})",
                _error(actual[name], expected[name], floor),
                grad_tol,
            )
        )
    block.zero_grad(set_to_none=True)
    return found


def _gradients_summed(
    named: list[tuple[str, torch.Tensor | None]], experts: set[int], mesh: DeviceMesh
) -> dict[str, torch.Tensor]:
    """The split block's parameter gradients made whole and summed as the data-parallel wrappers will:
    dense ones over dp x ep x cp, experts over their edp ranks."""
    whole = {name: _whole(p.grad if p.grad is not None else torch.zeros_like(p)) for name, p in named if p is not None}
    summed = {}
    for is_expert, group in ((False, dense_data_mesh(mesh)), (True, expert_data_mesh(mesh))):
        names = [name for name, p in named if p is not None and (id(p) in experts) == is_expert]
        summed.update(zip(names, _summed([whole[name] for name in names], group)))
    return summed


def _capture_or_refuse(
    model: nn.Module,
    blocks: dict[int, nn.Module],
    references: list[_Reference],
    forward: Callable[[], object],
    mesh: DeviceMesh,
    sp: bool,
) -> dict[int, tuple]:
    """:func:`_capture_inputs` of the split model; a split block that raises on the way to a later kind's block
    (HY-V4's dense block 0 before its MoE block 1) is refused naming it, as a proved block that raises is."""
    entered: list[int] = []
    handles = [
        block.register_forward_pre_hook(lambda *_, i=index: entered.append(i)) for index, block in blocks.items()
    ]
    try:
        return _capture_inputs([(ref.index, blocks[ref.index]) for ref in references], forward)
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - any error of a split block is the layout's refusal
        if not entered:  # before the blocks: not theirs to explain
            raise
        index = entered[-1]
        _refuse(model, index, type(blocks[index]).__name__, mesh, sp, _raised(err), "failed", _cause(references, index))
    finally:
        for handle in handles:
            handle.remove()


def _split_inputs(
    model: nn.Module,
    blocks: dict[int, nn.Module],
    references: list[_Reference],
    mesh: DeviceMesh,
    sp: bool,
    first: int | None,
    run_block: Callable | None,
) -> dict[int, tuple]:
    """(args, kwargs) the split model hands each reference's block: from the model's own forward, or under
    pp from ``run_block(index, hidden, position_ids)`` on the hidden states as the stage holds them."""
    targets = [(ref.index, blocks[ref.index]) for ref in references]
    if run_block is None:
        return _capture_or_refuse(model, blocks, references, _model_forward(model, mesh), mesh, sp)
    rows, length = references[0].hidden.shape[:2]
    positions = _held(torch.arange(length).expand(rows, length), mesh, sp_shard=False)
    found = {}
    for index, block in targets:
        ref = next(r for r in references if r.index == index)
        hidden = _held(ref.hidden, mesh, sp and index != first)
        found.update(
            _capture_inputs(
                [(index, block)],
                lambda: run_block(index, hidden, positions.to(hidden.device)),  # noqa: B023 - called at once
            )
        )
    return found


def prove_blocks(
    model: nn.Module,
    parts: HFParts,
    mesh: DeviceMesh,
    references: list[_Reference],
    sp: bool,
    experts: list[nn.Module],
    run_block: Callable | None = None,
) -> None:
    """Each kind's first block, split, against its reference; a :class:`ConfigError` on every rank at the
    first part whose error (the largest over its stage's ranks) exceeds its tolerance. ``run_block``: a
    pipeline stage's (:func:`meshtron.hf.pipeline.stage_block`), None for a whole model."""
    blocks = dict(parts.block_items())
    # Under SP the model's first block slices its (replicated) input itself; a later stage's first block
    # receives a slice.
    first = parts.block_items()[0][0] if parts.embed is not None else None
    expert_params = {id(p) for module in experts for p in module.parameters()}
    with _eval_mode(model):
        inputs = _split_inputs(model, blocks, references, mesh, sp, first, run_block)
        found = [
            (
                ref.index,
                type(blocks[ref.index]).__name__,
                _comparisons(blocks[ref.index], ref, inputs[ref.index], mesh, sp, ref.index == first, expert_params),
            )
            for ref in references
        ]
    failure = _first_failure(found, mesh)
    if failure is not None:
        index, cls, what, err, tolerance = failure
        how = "failed" if math.isinf(err) else f"differs by {err:.2e} (relative; tolerance {tolerance:g})"
        _refuse(model, index, cls, mesh, sp, what, how, _cause(references, index))


def _cause(references: list[_Reference], index: int) -> str | None:
    """What :func:`_known_causes` found in block ``index`` (None when nothing, or not a reference's block)."""
    return "; ".join(next((ref.causes for ref in references if ref.index == index), [])) or None


def _refuse(
    model: nn.Module, index: int, cls: str, mesh: DeviceMesh, sp: bool, what: str, how: str, cause: str | None = None
):
    """The block check's ConfigError; ``cause``: what the check found splits the block wrong, when it knows."""
    fix = (
        f"{cause}, or prove_blocks=False to train anyway."
        if cause
        else "How this layout splits the block is wrong for this family (its tp plan or meshtron's translation of "
        "it, SP, ep or cp); use another layout (e.g. without SP, tp = 1 or cp = 1), or prove_blocks=False to "
        "train anyway."
    )
    raise ConfigError(
        f"parallelize_hf_model: {type(model).__name__} block {index} ({cls}) split at {_layout_text(mesh, sp)} "
        f"does not compute what it computes whole: its {what} {how} on a probe batch. {fix}"
    )


def _first_failure(
    found: list[tuple[int, str, list[tuple[str, float, float]]]], mesh: DeviceMesh
) -> tuple[int, str, str, float, float] | None:
    """The first (block index, class, what, error, tolerance) whose error, the largest over its stage's ranks,
    exceeds its tolerance, in pp stage order (NaN fails); the same on every rank (one gather)."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (mesh["pp"].get_local_rank(), found))
    stages: dict[int, list] = {}
    for stage, rank_found in sorted(everyone, key=lambda item: item[0]):
        stages.setdefault(stage, []).append(rank_found)
    for ranks in stages.values():  # a stage's ranks compare the same blocks and parts in the same order
        for blocks in zip(*ranks):
            index, cls, _ = blocks[0]
            for parts in zip(*(comparisons for _, _, comparisons in blocks)):
                what, _, tolerance = parts[0]
                err = max(e if e == e else math.inf for _, e, _ in parts)
                if err > tolerance:
                    return index, cls, what, err, tolerance
    return None


def _first_block_input(model: nn.Module, parts: HFParts, length: int) -> tuple[nn.Module, torch.Size]:
    """The first block and the shape of the hidden states the model's forward hands it for one row of
    ``length`` tokens (the forward stops there: only the embedding runs)."""
    index, block = parts.block_items()[0]
    ids = torch.zeros(1, length, dtype=torch.long, device=parts.embed.weight.device)
    with _eval_mode(model):
        args, kwargs = _capture_inputs([(index, block)], lambda: model(input_ids=ids, use_cache=False))[index]
    return block, _hidden_of(args, kwargs).shape


def check_sequence_dim(model: nn.Module, parts: HFParts, mesh: DeviceMesh, sp: bool) -> None:
    """SP and cp split the residual stream along dim 1, features last (SP's slices, its norms' tokens at dim
    -2, cp's chunks), and pp sends it between stages as [batch, sequence, hidden_size]; families whose blocks
    carry more (DeepSeek-V4's [batch, sequence, hc_mult, hidden] hyper-connection streams) are refused those:
    a ConfigError naming the block class and the shape. The sequence dims are those that change between two
    probe lengths, so no other dim of the same size can pass for one. Needs the embedding's weights (on the
    meta device nothing runs: :func:`meshtron.hf.load_hf_checkpoint` checks its twin)."""
    tp, cp, pp = mesh["tp"].size(), mesh["cp"].size(), mesh["pp"].size()
    splits = {
        name: fix
        for name, fix, on in (("SP", "sp = false", sp and tp > 1), ("cp", "cp = 1", cp > 1), ("pp", "pp = 1", pp > 1))
        if on
    }
    if not splits or simulating() or parts.embed is None or parts.embed.weight.is_meta:
        return
    step = 2 * tp * cp  # lengths every split divides
    (block, shape), (_, longer) = (_first_block_input(model, parts, n * step) for n in (1, 2))
    seq = [dim for dim, (a, b) in enumerate(zip(shape, longer)) if a != b]
    if len(shape) == 3 and seq == [1]:
        return
    names = " and ".join(splits)
    raise ConfigError(
        f"parallelize_hf_model: {type(block).__name__} takes hidden states of shape {list(shape)} for one row of "
        f"{step} tokens (the sequence at dim {', '.join(map(str, seq)) or 'none'}), not [batch, sequence, hidden]; "
        f"{names} {'assume' if len(splits) > 1 else 'assumes'} that layout of the residual stream. Set "
        f"[parallel] {' and '.join(splits.values())} (tp without SP, ep and dp do not split the stream)."
    )


def split_layout(mesh: DeviceMesh) -> bool:
    """Whether this layout is probed: something split over tp, ep or cp, not a dry run's fake tensors."""
    split = mesh["tp"].size() > 1 or expert_split(mesh).ep > 1 or mesh["cp"].size() > 1
    return split and not simulating()


def provable(model: nn.Module, mesh: DeviceMesh) -> bool:
    """Whether this model is probed here: a layout :func:`split_layout` probes, and weights to run (not the
    meta device: :func:`meshtron.hf.load_hf_checkpoint` proves a twin holding the checkpoint's weights)."""
    return split_layout(mesh) and not any(p.is_meta for p in model.parameters())


__all__ = [
    "block_kinds",
    "check_sequence_dim",
    "probe_length",
    "provable",
    "prove_blocks",
    "record_references",
    "split_layout",
]
