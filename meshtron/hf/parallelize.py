"""Parallelize a HuggingFace ``*ForCausalLM`` over a meshtron mesh, and stream its weights in sharded.

:func:`parallelize_hf_model` finds the model's parts (:mod:`meshtron.hf.discover`), turns its tp plan (the
config's, or :mod:`meshtron.hf.infer`'s) into DTensor styles (:mod:`meshtron.hf.tp_plan`) and hands each
dimension's parallelism (``HFParallelisms``) to meshtron's composer; :func:`load_hf_checkpoint` builds the
model on the meta device and reads only this rank's slice of every tensor. See docs/hf.md.
"""

from __future__ import annotations

import inspect
import json
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from meshtron import env
from meshtron.checkpoint import gather_full_state_dict
from meshtron.config import ConfigError
from meshtron.hf import prove
from meshtron.hf.context import apply_hf_context_parallel
from meshtron.hf.discover import HFParts, hf_parts, is_rotary
from meshtron.hf.experts import adopt_router_scaled_blocks, apply_hf_expert_parallel, float8_experts, hf_expert_modules
from meshtron.hf.io import weight_map, write_safetensors_folder
from meshtron.hf.loss import global_aux_loss, hf_loss_function
from meshtron.hf.phases import PhaseGuard
from meshtron.hf.pipeline import HFStage, cut_to_stage, plan_stage, run_as_stage, stage_block, stage_chunks
from meshtron.hf.slices import load_sharded_weights, missing_tensors
from meshtron.hf.tp_plan import apply_hf_tensor_parallel, check_norm_on_embeddings, replicate_plain_params
from meshtron.mesh import dense_data_mesh, expert_data_mesh, expert_split
from meshtron.models.chunked_loss import DEFAULT_CHUNK_TOKENS
from meshtron.models.qwen2 import LMHead
from meshtron.parallel.compose import allocate_empty, compose
from meshtron.parallel.data_parallel import data_meshes, mixed_precision, offload_policy, wrap_units
from meshtron.parallel.float8 import apply_float8
from meshtron.parallel.offload import offload_blocks
from meshtron.parallel.pipeline.schedules import V_SHAPED
from meshtron.parallel.recompute import checkpoint_blocks


def _no_cache_in_training(model, args, kwargs):
    """Training forwards run without a KV cache, as under transformers' own checkpointing: nothing reads it,
    a checkpointed block's recomputation would add its keys a second time (its attention then sees 2 x S
    keys), and its first keys are ``torch.tensor([])`` copied from the host (which a fake CUDA device, with
    no driver, cannot take)."""
    if model.training:
        return args, {**kwargs, "use_cache": False}
    return None


def _apply_dp(
    model: nn.Module,
    parts: HFParts,
    mesh: DeviceMesh,
    mode: str,
    dtype: str,
    experts: list[nn.Module],
    offload: str = "none",
) -> None:
    """FSDP / replicate units (:func:`~meshtron.parallel.data_parallel.wrap_units`): ``experts`` (split over ep) on
    the expert data mesh, every layer, the untied embedding and lm_head, and the root, on the dense data
    mesh. With one dense data rank
    only the experts are wrapped (their edp ranks are tp ranks holding other tokens), in the
    model's own dtype like the rest; ``offload``: ``[parallel] offload`` (FSDP2's CPU offload)."""
    meshes = data_meshes(mesh, mode)
    dense = meshes[0].size() > 1
    policy = mixed_precision(dtype if dense else "float32")
    blocks = [layer for _, layer in parts.block_items()]
    host = offload_policy(offload, mode, mesh.device_type)
    wrap_units(model, blocks, experts, (parts.embed, parts.head), meshes, mode, policy, host, dense=dense)


class HFParallelisms:
    """:class:`~meshtron.parallel.compose.Parallelisms` for a transformers model (the whole model, or a pipeline
    stage's), composed in :func:`~meshtron.parallel.compose.compose`'s order like meshtron's own models."""

    def __init__(
        self,
        mesh: DeviceMesh,
        sp: bool,
        data_parallel: str,
        ac: tuple[str, int, str],
        dtype: str,
        cp_comm: tuple[str, int],
        pipelined: bool,
        references: list,
        offload: tuple[str, bool] = ("none", False),
        fp8: str = "none",
    ):
        """``ac``: the checkpointing mode, ``ac_every`` and ``ac_policy``; ``offload``: ``[parallel] offload``
        and ``offload_activations``; ``fp8``: the recipe the fused experts' grouped GEMMs run (the block
        linears are converted before, :func:`convert_float8`)."""
        self.mesh, self.sp, self.data_parallel, self.dtype = mesh, sp, data_parallel, dtype
        self.offload, self.fp8 = offload, fp8
        self.ac, self.cp_comm, self.pipelined = ac, cp_comm, pipelined
        self.references = references  # the block check's (meshtron.hf.prove), recorded on the whole model
        self.tp_mesh = mesh["tp"]
        self.experts: list[nn.Module] = []

    def setup(self, model: nn.Module) -> None:
        """The bias-free head becomes meshtron's fused one; the fused experts are found (before tp splits
        the blocks around them): under ep or tp, or in FP8 on any layout (one rank too), where meshtron's
        dispatch runs their grouped GEMMs in float8."""
        self.parts = hf_parts(model)
        self.shared = _shared_parameters(model)
        _as_meshtron_head(self.parts.head)
        ep = expert_split(self.mesh).ep
        dispatched = ep > 1 or self.tp_mesh.size() > 1 or self.fp8 != "none"
        self.expert_modules = hf_expert_modules(model, ep) if dispatched else {}
        if ep > 1 and not self.expert_modules:
            raise ConfigError(
                f"parallelize_hf_model: ep = {ep} needs a MoE model with fused experts; "
                f"{type(model).__name__} has none. Use ep = 1."
            )
        adopt_router_scaled_blocks(model, self.expert_modules)

    def tensor(self, model: nn.Module) -> None:
        if self.tp_mesh.size() > 1:
            apply_hf_tensor_parallel(model, self.parts, self.tp_mesh, self.sp)

    def expert(self, model: nn.Module) -> None:
        """The experts split over ep; then every parameter tp left plain becomes a Replicate DTensor."""
        self.experts = apply_hf_expert_parallel(model, self.mesh, self.expert_modules)
        float8_experts(self.experts, self.fp8)
        if self.tp_mesh.size() > 1:
            replicate_plain_params(model, self.parts, self.tp_mesh, self.experts)
        _share_again(self.shared)

    def context(self, model: nn.Module) -> None:
        if self.mesh["cp"].size() > 1:
            apply_hf_context_parallel(model, self.mesh, not self.pipelined, *self.cp_comm)

    def checkpointing(self, model: nn.Module) -> None:
        checkpoint_blocks(dict(self.parts.block_items()), *self.ac)
        if self.offload[1]:  # the blocks checkpointing left alone
            offload_blocks(self.parts.block_items())
        model.register_forward_pre_hook(_no_cache_in_training, with_kwargs=True)

    def compile(self, model: nn.Module) -> None:
        """transformers models run eagerly: ``[parallel] compile`` applies to meshtron's own models."""

    def prove(self, model: nn.Module) -> None:
        """The block check (:mod:`meshtron.hf.prove`) of the split blocks against the recorded references."""
        if self.references:
            run_block = partial(stage_block, model) if self.pipelined else None
            prove.prove_blocks(model, self.parts, self.mesh, self.references, self.sp, self.experts, run_block)
            self.references = []

    def data(self, model: nn.Module) -> None:
        """The loss and aux loss of the global batch (:mod:`meshtron.hf.loss`), then the data-parallel units."""
        self.prove(model)  # the split blocks, before the data-parallel wrappers take their gradients
        data_mesh = dense_data_mesh(self.mesh)
        model.loss_function = hf_loss_function(data_mesh)
        if data_mesh.size() > 1:
            model.register_forward_hook(global_aux_loss(data_mesh), with_kwargs=True)
        # Experts also sum gradients over their edp ranks, which include tp ranks holding other tokens; the
        # optimizer's host offload is FSDP2's, so it wraps one data rank too.
        offload = self.offload[0]
        if data_mesh.size() > 1 or (self.experts and expert_data_mesh(self.mesh).size() > 1) or offload != "none":
            _apply_dp(model, self.parts, self.mesh, self.data_parallel, self.dtype, self.experts, offload)


class _TwinParallelisms(HFParallelisms):
    """:func:`load_hf_checkpoint`'s twin (:func:`_check_twin`): split as the model will be and proved;
    neither checkpointed nor wrapped for data parallelism (it is dropped after the check)."""

    def checkpointing(self, model: nn.Module) -> None:
        """The probe needs no recomputation."""

    def data(self, model: nn.Module) -> None:
        self.prove(model)


def parallelize_hf_model(
    model: nn.Module,
    mesh: DeviceMesh,
    sp: bool = False,
    data_parallel: str = "fsdp",
    ac: str = "none",
    ac_every: int = 2,
    ac_policy: str = "save_matmuls",
    dtype: str = "float32",
    schedule: str = "1f1b",
    microbatches: int = 1,
    virtual_stages: int = 1,
    cp_comm_type: str = "p2p",
    cp_a2a_size: int = 0,
    prove_blocks: bool = True,
    offload: str = "none",
    offload_activations: bool = False,
    fp8: str = "none",
) -> nn.Module:
    """Parallelize a transformers decoder-only ``*ForCausalLM`` in place over ``mesh`` (from ``build_mesh``)
    and return it.

    tp shards the layers by the model's ``base_model_tp_plan``, or one inferred from its module types (plus
    vocab-parallel embedding/lm_head, the MoE shared expert and optional SP); MoE experts are split over ep by
    ``base_model_ep_plan`` and fed by all-to-all (:mod:`meshtron.hf.experts`); the batch is split over dp x ep, where
    dense parameters are FSDP-sharded (``data_parallel="fsdp"``), replicated or HSDP-sharded, and experts
    over dp. ``ac`` is ``none``, ``full``, ``selective`` (every ``ac_every``-th layer) or ``op`` (every
    layer keeps the op outputs ``ac_policy`` names, :mod:`meshtron.parallel.recompute`);
    ``dtype="bfloat16"`` makes the data-parallel wrapper compute in bf16 with fp32 master weights (only
    when the data mesh has more than one rank). ``offload="optimizer"`` keeps the sharded parameters, their
    gradients and the optimizer state on the host (FSDP2's CPU offload, one data rank included) and
    ``offload_activations`` each block's saved tensors not recomputed (:mod:`meshtron.parallel.offload`).
    ``fp8`` (``[train] fp8``'s recipes): the decoder blocks' linears as torchao ``Float8Linear`` (the MoE
    block's own router and gates, the embedding and head stay in the training dtype), converted first so that
    every split takes them as float8 linears (:func:`convert_float8`), and the fused experts' grouped GEMMs in
    float8 through meshtron's dispatch, on one rank too (:func:`meshtron.hf.experts.float8_experts`).
    Works on meta-device models (then ``to_empty`` and :func:`meshtron.hf.load_sharded_weights`, as
    :func:`load_hf_checkpoint` does). Each rank of dp x ep passes its own part of the batch; ``.loss`` (and
    ``.aux_loss``) are the global batch's and ``.logits`` a vocab-sharded DTensor. The dimensions compose in
    :mod:`meshtron.parallel.compose`'s order, as for meshtron's own models.

    cp > 1 (:mod:`meshtron.hf.context`): attention runs as meshtron's ring attention; each data rank
    passes whole sequences (length a multiple of 2 x cp, no ``attention_mask``) and the model keeps
    its cp share of them, so ``.logits`` holds this rank's tokens (in the load-balanced order).
    ``cp_comm_type`` (``p2p``, ``a2a``, ``allgather``, ``a2a+p2p``) and ``cp_a2a_size`` are
    ``[parallel]``'s keys of the same names.

    ``prove_blocks`` (on by default; ``[parallel] prove_blocks``): before returning, the first block of each
    kind (under pp: of each kind in each stage) is run split and whole on a probe batch and compared
    (:mod:`meshtron.hf.prove`); a block that differs is a ConfigError on every rank naming it, the layout
    and the first part that differs. Layouts with tp, ep or cp, on a model with weights; a model on the meta
    device is not probed here (:func:`load_hf_checkpoint` proves a twin with the checkpoint's weights).

    pp > 1 (:mod:`meshtron.hf.pipeline`): the model is pruned in place to this rank's stage(s) (for
    ``schedule`` ``1f1b``, ``interleaved``, ``gpipe`` ..., ``microbatches``, ``virtual_stages``) and that
    stage model is returned; ``HFPipelineRunner(model, mesh)`` runs its steps
    (``forward_backward(input_ids, next_token_labels)``).
    """
    guard = PhaseGuard(model, mesh, sp)
    with guard("finding the decoder's parts"):
        _without_hub_kernels(model)
        prove.check_sequence_dim(model, hf_parts(model), mesh, sp)  # also: a layout we can find the pieces of
        check_norm_on_embeddings(hf_parts(model), mesh["tp"].size(), sp)
    with guard("the float8 conversion"):
        convert_float8(model, mesh, fp8, offload)
        shared = _shared_parameters(model)
    pipelined = mesh["pp"].size() > 1
    with guard("the pipeline split"):
        stage = plan_stage(model, mesh, schedule, microbatches, virtual_stages, sp, dtype) if pipelined else None
        if pipelined:
            _check_shared_in_one_stage(model, shared, stage)
    with guard("the unsplit blocks' reference run"):
        references = _block_references(model, mesh, stage, sp) if prove_blocks else []
    with guard("the pipeline split"):
        if pipelined:
            cut_to_stage(model, stage)
    parallelisms = HFParallelisms(
        mesh,
        sp,
        data_parallel,
        (ac, ac_every, ac_policy),
        dtype,
        (cp_comm_type, cp_a2a_size),
        pipelined=pipelined,
        references=references,
        offload=(offload, offload_activations),
        fp8=fp8,
    )
    compose(model, GuardedParallelisms(parallelisms, guard))
    with guard("the final checks"):
        _check_still_shared(model, shared)
        if pipelined:
            run_as_stage(model)
    return model


def _without_hub_kernels(model: nn.Module) -> None:
    """The model's modules run their own torch forwards, not hub kernels: transformers 5.25 kernelizes every
    ``from_pretrained`` model where the ``kernels`` package is installed (its dependency now; ``use_kernels``
    defaults to on) and kernelizes again on each ``train()`` / ``eval()`` that changes the mode, which puts
    each decorated class's forward (``use_kernel_forward_from_hub``: RMSNorm ...) back over the one a tp style
    set on the instance (a replicated final norm run on its weights' local views), and a hub kernel takes
    neither DTensors nor split weights. Turned off here (transformers' ``reset_kernels``) before any style
    is applied. transformers 5.24 cannot turn them off once on (``use_kernels=True`` asked on load): refused."""
    if not getattr(model, "use_kernels", False):
        return
    model.use_kernels = False  # 5.25: reset_kernels (the torch forwards back, no re-kernelizing on train())
    if model.use_kernels:
        raise ConfigError(
            f"parallelize_hf_model: {type(model).__name__} runs hub kernels (from_pretrained(use_kernels=True)), "
            "which this transformers cannot turn off; load it without use_kernels."
        )


class GuardedParallelisms:
    """Each parallelism of ``compose``'s order as one phase of :class:`~meshtron.hf.phases.PhaseGuard`."""

    PHASES = {
        "setup": "finding the loss and the plans",
        "tensor": "tensor parallelism",
        "expert": "expert parallelism",
        "context": "context parallelism",
        "checkpointing": "activation checkpointing",
        "compile": "compilation",
        "data": "the block check and data parallelism",
    }

    def __init__(self, parallelisms: HFParallelisms, guard: PhaseGuard):
        self.parallelisms, self.guard = parallelisms, guard

    def __getattr__(self, name: str):
        method = getattr(self.parallelisms, name)

        def guarded(model: nn.Module) -> None:
            with self.guard(self.PHASES[name]):
                method(model)

        return guarded


def convert_float8(model: nn.Module, mesh: DeviceMesh, fp8: str, offload: str = "none") -> nn.Module:
    """The FP8-capable linears of the model's decoder blocks as ``Float8Linear`` (in place, meta or real;
    :func:`meshtron.parallel.float8.apply_float8` with the blocks :mod:`meshtron.hf.discover` finds), for the
    tp and data split ``mesh`` will give them; ``fp8`` "none" leaves the model as it is."""
    return apply_float8(
        model, fp8, mesh["tp"].size(), dense_data_mesh(mesh).size(), offload != "none", hf_parts(model).block_items()
    )


def _block_references(model: nn.Module, mesh: DeviceMesh, stage: HFStage | None, sp: bool) -> list:
    """The block check's references (:func:`meshtron.hf.prove.record_references`): the first block of each kind
    this rank will run (under pp, among its stage's blocks), run whole as transformers runs it."""
    if not prove.provable(model, mesh):
        return []
    blocks = hf_parts(model).block_items()
    if stage is not None:
        mine = {i for layers in stage.chunks.values() for i in layers}
        blocks = [(i, block) for i, block in blocks if i in mine]
    return prove.record_references(model, prove.block_kinds(blocks, model.config), mesh, sp)


def _shared_parameters(model: nn.Module) -> list[list[tuple[str, nn.Module, str]]]:
    """Groups of (module path, module, name) that own one Parameter (a tied embedding and head, weights
    reused by several decoder layers)."""
    owners: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            if all(m is not module or n != name for _, m, n in owners.get(id(param), ())):
                owners.setdefault(id(param), []).append((path, module, name))
    return [group for group in owners.values() if len(group) > 1]


def _share_again(shared: list[list[tuple[str, nn.Module, str]]]) -> None:
    """Each shared Parameter one Parameter again after tp and ep: their styles distribute each owner's
    reference to it on its own, into equal copies where the owners are split alike (the same layer class,
    the same plan entry). Owners split otherwise keep their copies, and :func:`_check_still_shared` refuses."""
    for group in shared:
        (_, first, name), *others = group
        kept = getattr(first, name)
        if all(_split_alike(getattr(module, n), kept) for _, module, n in others):
            for _, module, n in others:
                setattr(module, n, kept)


def _split_alike(a: torch.Tensor, b: torch.Tensor) -> bool:
    if isinstance(a, DTensor) != isinstance(b, DTensor) or a.shape != b.shape:
        return False
    return not isinstance(a, DTensor) or (a.placements == b.placements and a.device_mesh == b.device_mesh)


def _check_shared_in_one_stage(
    model: nn.Module, shared: list[list[tuple[str, nn.Module, str]]], stage: HFStage
) -> None:
    """Weights reused by decoder layers that pp puts on different stages would be two copies, each trained
    by its stage's share of the gradient: refused on every rank alike, before any collective (a tied
    embedding and head is the pipeline's own case: it sums their gradients)."""
    parts, p = hf_parts(model), stage.parallel
    blocks = parts.blocks_path
    stage_of = {
        index: pp_rank
        for pp_rank in range(p.pp)
        for layers in stage_chunks(len(parts.blocks), pp_rank, p.pp, p.virtual_stages, p.schedule in V_SHAPED).values()
        for index in layers
    }
    for group in shared:
        indices = sorted(
            {
                int(path.removeprefix(f"{blocks}.").split(".")[0])
                for path, _, _ in group
                if path.startswith(f"{blocks}.")
            }
        )
        if len({stage_of[i] for i in indices}) > 1:
            names = ", ".join(f"'{path}.{name}'" for path, _, name in group)
            raise ConfigError(
                f"parallelize_hf_model: {names} share one Parameter, but pp = {p.pp} puts their layers "
                f"{indices} on different pipeline stages (each stage would train its own copy). Use pp = 1, or "
                "a pipeline split that keeps those layers in one stage."
            )


def _check_still_shared(model: nn.Module, shared: list[list[tuple[str, nn.Module, str]]]) -> None:
    """Each shared Parameter is still one Parameter in what parallelizing left here (a pipeline stage
    may hold only some of its owners): a style or data-parallel unit that gave each owner its own copy
    would split the gradient between the copies, which drift apart after one step."""
    present = {id(m) for m in model.modules()}
    for group in shared:
        here = [(path, getattr(module, name)) for path, module, name in group if id(module) in present]
        if len({id(param) for _, param in here}) > 1:
            names = ", ".join(f"'{path}.{name}'" for (path, _, name) in group)
            raise ConfigError(
                f"parallelize_hf_model: {names} share one Parameter, but parallelizing gave them "
                "separate copies (their gradients would be split and the copies drift apart); "
                "sharing weights between these modules is not supported with this layout."
            )


def _as_meshtron_head(head: nn.Module | None) -> None:
    """A bias-free ``nn.Linear`` head becomes meshtron's :class:`~meshtron.models.qwen2.LMHead` in place
    (same weight and name): ``head(h)`` still gives logits, ``head(h, labels)`` the fused, chunked
    token-loss sum that never holds a whole micro-batch's logits. Other heads stay as they are."""
    if type(head) is nn.Linear and head.bias is None:
        head.__class__ = LMHead
        head.chunk_tokens = DEFAULT_CHUNK_TOKENS


def _materialize(model: nn.Module, parts: HFParts, leave: list[nn.Module] = (), on_host: bool = False) -> None:
    """A meta model's tensors made real (uninitialised) on this rank's device, except those of ``leave``'s
    modules; a tied head re-tied (``to_empty`` gives each module its own tensor); RoPE frequencies rebuilt.
    ``on_host`` (``[parallel] offload = "optimizer"``, without ``leave``): the parameters on the host
    (:func:`~meshtron.parallel.compose.allocate_empty`)."""
    tied = parts.tied  # a property: false once to_empty has untied them
    if leave:
        left = {id(m) for module in leave for m in module.modules()}
        for module in model.modules():
            if id(module) not in left:
                module.to_empty(device=env.local_device(), recurse=False)
    else:  # in one call: an FSDP unit re-registers its sharded parameters after its whole subtree
        allocate_empty(model, env.local_device(), on_host)
    if tied:
        parts.head.weight = parts.embed.weight
    with torch.no_grad():
        _reset_rotary(model)


def _check_twin(folder: str | Path, config, mesh: DeviceMesh, options: dict) -> int:
    """What :func:`load_hf_checkpoint`'s model (split on the meta device, weights read after) cannot check
    itself, checked on a twin built from the same config with the checkpoint's weights, read whole up to what
    the checks run, then dropped: the residual stream's layout under SP or cp
    (:func:`meshtron.hf.prove.check_sequence_dim`: the embedding) and the block check (up to the first block
    of the last kind, whose forward runs through the blocks before it; later blocks and an untied head stay on
    the meta device): references recorded, split by the same options, proved as :func:`parallelize_hf_model`
    proves a model with weights. Returns the bytes read here."""
    from transformers import AutoModelForCausalLM

    kw = inspect.signature(parallelize_hf_model).bind(None, mesh, **options)
    kw.apply_defaults()
    kw = kw.arguments
    proving = kw["prove_blocks"] and prove.split_layout(mesh)
    if not (proving or (kw["sp"] and mesh["tp"].size() > 1) or mesh["cp"].size() > 1):
        return 0
    with torch.device("meta"):
        twin = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    convert_float8(twin, mesh, kw["fp8"], kw["offload"])
    parts = hf_parts(twin)
    kinds = prove.block_kinds(parts.block_items(), twin.config)
    last = kinds[-1][0] if proving else -1
    later = [block for index, block in parts.block_items() if index > last]
    _materialize(twin, parts, later + ([parts.head] if parts.head is not None and not parts.tied else []))
    read = load_sharded_weights(twin, folder, {name for name, t in twin.state_dict().items() if not t.is_meta})
    prove.check_sequence_dim(twin, parts, mesh, kw["sp"])
    if proving:
        references = prove.record_references(twin, kinds, mesh, kw["sp"])
        compose(
            twin,
            _TwinParallelisms(
                mesh,
                kw["sp"],
                kw["data_parallel"],
                ("none", 1, kw["ac_policy"]),
                kw["dtype"],
                (kw["cp_comm_type"], kw["cp_a2a_size"]),
                pipelined=False,
                references=references,
                fp8=kw["fp8"],
            ),
        )
    return read


def _reset_rotary(model: nn.Module) -> None:
    """Non-persistent buffers (RoPE frequencies) are not in checkpoints: rebuild them after to_empty."""
    for module in model.modules():
        if is_rotary(module) and hasattr(module, "config"):
            fresh = type(module)(module.config)
            for name, buf in fresh.named_buffers(recurse=False):
                getattr(module, name).copy_(buf)


def _converted_on_load(folder: str | Path, config) -> bool:
    """Whether the folder stores the model's tensors under other names or layouts that transformers converts
    on load (DeepSeek-V4's ``save_pretrained`` writes its original per-expert ``attn.wq_a`` ... names): some
    state-dict name missing from the folder, and a conversion mapping for the model type. Without one, the
    slice reader refuses the folder naming what is missing."""
    from transformers import AutoModelForCausalLM
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    parts = hf_parts(model)
    tied = f"{parts.head_path}.weight" if parts.tied else None
    missing = missing_tensors(folder, [name for name in model.state_dict() if name != tied])
    return bool(missing) and bool(get_checkpoint_conversion_mapping(config.model_type))


def _whole_then_parallelize(folder: str | Path, mesh: DeviceMesh, options: dict) -> tuple[nn.Module, int]:
    """transformers' ``from_pretrained`` (its own conversion) on every rank, then :func:`parallelize_hf_model`
    (block check included): each rank reads and holds the whole checkpoint once, as that path does."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    parallelize_hf_model(model, mesh, **options)
    return model, sum(path.stat().st_size for path in set(weight_map(folder).values()))


def load_hf_checkpoint(folder: str | Path, mesh: DeviceMesh, **options) -> tuple[nn.Module, int]:
    """Build the folder's model on the meta device, parallelize it (``options`` as
    :func:`parallelize_hf_model`) and stream this rank's slices in. Returns (model, bytes read here).

    Per-rank peak memory is about the rank's share of the weights, never the whole model; the block check
    (``prove_blocks``, on by default) reads the weights it needs whole first (:func:`_check_twin`). A folder
    transformers converts on load (:func:`_converted_on_load`) is read whole on every rank by
    ``from_pretrained`` instead (bytes read: the folder's files).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if mesh["pp"].size() > 1:
        raise ConfigError(
            "load_hf_checkpoint: pp > 1 is not supported yet; use from_pretrained, then parallelize_hf_model."
        )
    config = AutoConfig.from_pretrained(folder)
    if _converted_on_load(folder, config):
        return _whole_then_parallelize(folder, mesh, options)
    _check_twin(folder, config, mesh, options)  # before the model: refused early, at a lower peak
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    parallelize_hf_model(model, mesh, **options)
    _materialize(model, hf_parts(model), on_host=options.get("offload", "none") == "optimizer")
    return model, load_sharded_weights(model, folder)


def save_hf_checkpoint(model: nn.Module, folder: str | Path, max_shard_bytes: int = 2 << 30) -> None:
    """Gather the full weights (collective) and let rank 0 write an HF folder ``from_pretrained`` reads."""
    full = gather_full_state_dict(model)
    parts = hf_parts(model)
    if parts.tied:
        full.pop(f"{parts.head_path}.weight", None)
    if dist.get_rank() == 0:
        write_safetensors_folder(full, json.loads(model.config.to_json_string()), folder, max_shard_bytes)
    dist.barrier()


__all__ = ["convert_float8", "load_hf_checkpoint", "parallelize_hf_model", "save_hf_checkpoint"]
