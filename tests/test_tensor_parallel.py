"""Tensor/sequence parallelism: parity with the unparallelized model, collective counts, errors.

One 8-rank launch covers tp = 2, 4 and 8: a 2-D (dp, tp) mesh gives every dp group its own tp
sub-mesh, and every dp group runs the same check on the same inputs.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode

from meshtron import env
from meshtron.checkpoint import load_full_state_dict
from meshtron.config import ConfigError, ModelConfig, ParallelConfig
from meshtron.models import build_model, token_loss_sum
from meshtron.parallel.recompute import apply_activation_checkpointing
from meshtron.parallel.tensor import apply_tensor_parallel, check_tensor_parallel
from meshtron.parallel.tensor_overlap import apply_overlapped_tensor_parallel
from meshtron.parallel.tp_gradient import TpGradient, name_tp_gradients
from meshtron.parallel.tp_styles import ReplicateParallel
from meshtron.parallel.vocab_loss import parallel_token_loss_sum
from meshtron.testing import assert_parity, count_calls, fresh_seed, launch_tests, random_model, rel_err
from test_float8 import HAS_TORCHAO, check_tp_matches_one_rank_fp8
from test_mxfp8 import check_tp_matches_one_rank_mxfp8

DENSE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=8,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
)
BATCH, SEQ = 2, 16
# The same split computation in another order (overlapped rings against SP's collectives, a split backward against
# the whole one, a two-layer MLP's tp partial sums): float32 reassociation of a few sums, held to the loss's bound.
REASSOCIATION_RTOL = 1e-5
# (layout, tied embeddings): tp 2, 4 and 8, each with and without SP (check_parity_dense)
DENSE_LAYOUTS = [
    (ParallelConfig(tp=2), False),
    (ParallelConfig(tp=2, sp=True, activation_checkpointing="full"), False),
    (ParallelConfig(tp=4), False),
    (ParallelConfig(tp=4, sp=True), True),
    (ParallelConfig(tp=8), False),
    (ParallelConfig(tp=8, sp=True), False),
]
# tp_overlap at tp 2 (KV heads split) and tp 4 (replicated; checkpointing replays the rings) (check_tp_overlap)
OVERLAP_LAYOUTS = [
    ParallelConfig(tp=2, sp=True, tp_overlap=True),
    ParallelConfig(tp=4, sp=True, tp_overlap=True, activation_checkpointing="full"),
]


def _tp_mesh(tp: int):
    world = dist.get_world_size()
    return init_device_mesh(env.device_type(), (world // tp, tp), mesh_dim_names=("dp", "tp"))["tp"]


def _parallel_copy(ref, tp_mesh, sp: bool, on_meta: bool, overlap: bool = False):
    """The TP model with the reference weights, built either on meta (the training path) or by copy."""
    apply = apply_overlapped_tensor_parallel if overlap else apply_tensor_parallel
    if not on_meta:
        return apply(copy.deepcopy(ref), tp_mesh, sp)
    with torch.device("meta"):
        model = build_model(ref.config)
    apply(model, tp_mesh, sp)
    model.to_empty(device=env.local_device())
    model.tie_weights()
    with torch.no_grad():
        load_full_state_dict(model, ref.state_dict())
    return model.train()


def _batch(cfg: ModelConfig, seed: int):
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
    labels[0, :3] = -100  # ignored positions must stay ignored on sharded logits
    return tokens.to(env.local_device()), labels.to(env.local_device())


def _step(model, tokens, labels, loss_fn):
    loss = loss_fn(model(tokens), labels) / (labels != -100).sum()
    loss.backward()
    return loss


class _EmbeddingGradRows(TorchDispatchMode):
    """Rows of every embedding weight gradient computed (aten.embedding_dense_backward)."""

    def __enter__(self):
        self.seen = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.embedding_dense_backward.default:
            self.seen.append(out.shape[0])
        return out


def _check_layout(layout: ParallelConfig, seed: int, on_meta: bool = True, tie: bool = False):
    """The model on ``layout`` (its tp, sp, tp_overlap and full activation checkpointing) against the
    1-rank model: loss and gradients within the numerics contract. Returns the loss and the gathered gradients."""
    cfg = ModelConfig(**DENSE, tie_word_embeddings=tie)
    ref = random_model(cfg, seed)
    par = _parallel_copy(ref, _tp_mesh(layout.tp), layout.sp, on_meta, layout.tp_overlap)
    if layout.activation_checkpointing == "full":  # recomputation replays the SP gathers; the shards saved must match
        apply_activation_checkpointing(par, "full")
    tokens, labels = _batch(cfg, seed)
    expected = _step(ref, tokens, labels, token_loss_sum)
    with _EmbeddingGradRows() as rows:
        actual = _step(par, tokens, labels, parallel_token_loss_sum)
    where = f"seed {seed}: {layout.name} tie={tie}"
    # The vocabulary-split embedding's weight gradient is computed for this rank's rows only.
    assert rows.seen == [math.ceil(cfg.vocab_size / layout.tp)], (where, rows.seen)
    ref_params = dict(ref.named_parameters())
    assert set(ref_params) == {n for n, _ in par.named_parameters()}
    ref_grads = {name: p.grad for name, p in ref_params.items()}
    assert_parity(where, actual, expected, [(n, p.grad) for n, p in par.named_parameters()], ref_grads)
    if tie:
        assert par.lm_head.weight is par.embed_tokens.weight
    return actual, {
        n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in par.named_parameters()
    }


def _exchanges(calls) -> list[tuple[str, ...]]:
    """Per ``batch_isend_irecv`` call: the element counts it sends."""
    return [tuple(op.tensor.numel() for op in ops if op.op is dist.isend) for (ops, *_) in calls]


@pytest.mark.full
def check_tp_overlap(seed):
    """tp_overlap (SP's gathers and reduce-scatters as rings overlapped with their GEMMs): loss and
    gradients equal to SP without overlap (float reassociation) and to the 1-rank model, at tp 2 (KV heads
    split) and tp 4 (replicated, with activation checkpointing replaying the rings). Each overlapped GEMM
    sends tp - 1 sequence shards, (tp - 1) / tp of the gathered tensor: the all-gather's and
    reduce-scatter's bytes; the blocks run no all-gather or reduce-scatter (tp 4). Refused without SP."""
    cfg = ModelConfig(**DENSE)
    shard = BATCH * SEQ * cfg.hidden_size
    for layout in OVERLAP_LAYOUTS:
        tp = layout.tp
        plain_loss, plain = _check_layout(replace(layout, tp_overlap=False), seed + tp)
        with count_calls(dist, "batch_isend_irecv") as calls:
            loss, grads = _check_layout(layout, seed + tp)
        where = f"seed {seed + tp}: {layout.name} against SP without overlap"
        assert_parity(where, loss, plain_loss, grads.items(), plain, grad_rtol=REASSOCIATION_RTOL)
        # Per layer: 4 rings in forward (q/k/v and gate/up gathers, o and down reduce-scatters), 4 more
        # replayed by the checkpointed forward, 6 in backward (as SP: 2 reduce-scatters, 4 gathers).
        rings = cfg.num_hidden_layers * (4 + 6 + (4 if layout.activation_checkpointing == "full" else 0))
        assert _exchanges(calls) == [(shard // tp,)] * (rings * (tp - 1)), (tp, len(calls))
    model = _parallel_copy(random_model(cfg, seed), _tp_mesh(4), sp=True, on_meta=True, overlap=True)
    counts = _layer_collectives(model, *_batch(cfg, seed))
    for layer in ("0", "1"):  # only the replicated KV heads' 4 gradient all-reduces are left
        assert counts.get((f"Transformer.layers.{layer}", "forward"), Counter()) == Counter(), counts
        assert counts.get((f"Transformer.layers.{layer}", "backward")) == Counter(all_reduce=4), counts
    with torch.device("meta"):
        model = build_model(cfg)
    with pytest.raises(ConfigError, match=r"tp_overlap = true .* set sp = true"):
        apply_overlapped_tensor_parallel(model, _tp_mesh(2), sp=False)


def check_parity_dense(seed):
    for layout, tie in DENSE_LAYOUTS:
        _check_layout(layout, seed + layout.tp, on_meta=layout.tp != 8, tie=tie)


def _stage(model, first: bool):
    """A pipeline stage of ``model``: the embedding and layer 0, or layer 1 and the head."""
    stage = copy.deepcopy(model)
    del stage.layers["1" if first else "0"]
    if first:
        stage.norm = stage.lm_head = None
    else:
        stage.embed_tokens = None
    return stage


@pytest.mark.full
def check_pipeline_stages_and_uneven_vocab(seed):
    """Two stages pass hidden states (sequence-sharded under SP) and still get the full-sequence RoPE;
    a vocabulary that tp does not divide (250 over 4) still gives the exact loss."""
    cfg = ModelConfig(**{**DENSE, "vocab_size": 250})
    ref = random_model(cfg, seed)
    tokens, labels = _batch(cfg, seed)
    expected = _step(ref, tokens, labels, token_loss_sum)
    mesh = _tp_mesh(4)
    first = apply_tensor_parallel(_stage(ref, first=True), mesh, sp=True)
    last = apply_tensor_parallel(_stage(ref, first=False), mesh, sp=True)
    hidden = first(tokens)
    assert hidden.shape[1] == SEQ // 4  # stages exchange sequence shards under SP
    actual = _step(last, hidden, labels, parallel_token_loss_sum)
    grads = {**{n: p.grad for n, p in first.named_parameters()}, **{n: p.grad for n, p in last.named_parameters()}}
    ref_grads = {name: p.grad for name, p in ref.named_parameters()}
    assert_parity(f"seed {seed}: two stages at tp4_sp", actual, expected, [(n, grads[n]) for n in ref_grads], ref_grads)


def _layer_collectives(model, tokens, labels):
    """{(module, 'forward'|'backward'): Counter(op name)} for one fwd+bwd step under CommDebugMode."""
    comm = CommDebugMode()
    with comm:
        _step(model, tokens, labels, parallel_token_loss_sum)
    return {
        (fqn, phase): Counter({str(op).split(".")[-1]: n for op, n in counts[phase].items()})
        for fqn, counts in comm.comm_module_counts.items()
        for phase in ("forward", "backward")
    }


def _expected_layer_collectives(sp: bool, replicated_kv: bool, phase: str) -> Counter:
    """Megatron's count per dense layer: 2 all-reduces (no SP) or 2 all-gathers + 2 reduce-scatters
    (SP), in forward and again in backward; under SP backward also re-gathers the q/k/v and gate/up
    inputs, which forward saved sequence-sharded (2 more all-gathers).

    Replicated KV heads add 4 all-reduces in backward (the replicas' k/v weight and bias gradients).
    MoE layers need expert parallelism too (it splits their tokens over tp); their counts are
    checked in tests/test_expert_parallel.py.
    """
    if not sp:
        want = Counter(all_reduce=2)
    else:
        want = Counter(all_gather_into_tensor=2, reduce_scatter_tensor=2)
    if sp and phase == "backward":
        want["all_gather_into_tensor"] += 2
    if replicated_kv and phase == "backward":
        want["all_reduce"] += 4
    return want


@pytest.mark.full
def check_collectives_per_layer(seed):
    # (kv heads, tp): KV heads split over tp, or replicated when tp exceeds them.
    for kv, tp in ((2, 2), (8, 4), (2, 4)):
        for sp in (False, True):
            cfg = ModelConfig(**{**DENSE, "num_key_value_heads": kv})
            model = _parallel_copy(random_model(cfg, seed), _tp_mesh(tp), sp, on_meta=True)
            counts = _layer_collectives(model, *_batch(cfg, seed))
            for layer in ("0", "1"):
                for phase in ("forward", "backward"):
                    got = counts.get((f"Transformer.layers.{layer}", phase), Counter())
                    want = _expected_layer_collectives(sp, kv < tp, phase)
                    where = f"kv={kv} tp={tp} sp={sp} layer {layer} {phase}"
                    assert got == want, f"{where}: {dict(got)} != {dict(want)}"


def _saved_activation_bytes(block, x, rope, exclude: set[int]) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward of ``block``."""
    saved: dict[int, int] = {}

    def pack(t):
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        if storage.data_ptr() not in exclude:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, rope)
    return sum(saved.values())


def _storages(tensors) -> set[int]:
    return {(t.to_local() if isinstance(t, DTensor) else t).untyped_storage().data_ptr() for t in tensors}


@pytest.mark.full
def check_sp_saves_activations_over_tp(seed):
    """With SP every tensor a dense block saves for backward is split over tp (KV heads included
    here), the q/k/v and gate/up inputs as sequence shards: per rank ~1/tp of the unsplit block."""
    cfg = ModelConfig(**{**DENSE, "num_key_value_heads": 8})
    ref = random_model(cfg, seed)
    seq = 64  # long enough that per-token tensors dominate
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, seq, cfg.hidden_size, generator=gen).to(env.local_device()).requires_grad_()
    rope = ref.rotary(torch.arange(seq, device=x.device).expand(BATCH, -1), x.dtype)
    unsplit = _saved_activation_bytes(ref.layers["0"], x, rope, _storages([*ref.parameters(), *rope]))
    for tp in (2, 4, 8):
        mesh = _tp_mesh(tp)
        par = _parallel_copy(ref, mesh, sp=True, on_meta=True)
        shard = x.detach().chunk(tp, dim=1)[mesh.get_local_rank()].clone().requires_grad_()
        per_rank = _saved_activation_bytes(par.layers["0"], shard, rope, _storages([*par.parameters(), *rope]))
        ratio = per_rank * tp / unsplit
        assert abs(ratio - 1) < 0.1, f"tp={tp}: {per_rank} bytes saved per rank, {ratio:.3f} x unsplit / tp"


class _Gemms(TorchDispatchMode):
    """Operand shapes of every matrix product on local tensors, counted (a DTensor's product is
    counted as the local one it runs; run once first: DTensor's first sharding propagation of an op
    computes it on fake tensors)."""

    OPS = (
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.addmm_.default,
        torch.ops.aten.bmm.default,
    )

    def __enter__(self):
        self.shapes = Counter()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.OPS and not any(isinstance(a, DTensor) for a in args):
            self.shapes[(func.__name__, *(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)))] += 1
        return func(*args, **(kwargs or {}))


def _work(run) -> Counter:
    """The matrix products, collectives and point-to-point exchanges of ``run()``, counted."""
    with _Gemms() as gemms, CommDebugMode() as comm, count_calls(dist, "batch_isend_irecv") as exchanges:
        run()
    return (
        gemms.shapes + Counter({str(op): n for op, n in comm.get_comm_counts().items()}) + Counter(p2p=len(exchanges))
    )


@pytest.mark.full
def check_split_backward_computes_each_gradient_once(seed):
    """A zero-bubble split of a block's backward under SP (B: the input gradient; W: the weights')
    runs the GEMMs and collectives of one whole backward: SP's fused linears compute only the
    gradients the running pass asks for (B needs no re-gather, W no input gradient or reduce-scatter);
    so do the overlapped rings (tp_overlap)."""
    from meshtron.parallel.pipeline.executor import _backward_input

    cfg = ModelConfig(**DENSE)
    ref = random_model(cfg, seed)
    gen = torch.Generator().manual_seed(seed)
    for tp, overlap in ((2, False), (4, False), (4, True)):
        mesh = _tp_mesh(tp)
        block = _parallel_copy(ref, mesh, sp=True, on_meta=True, overlap=overlap).layers["0"]
        full = torch.randn(BATCH, SEQ, cfg.hidden_size, generator=gen).to(env.local_device())
        shard = full.chunk(tp, dim=1)[mesh.get_local_rank()]
        grad = torch.randn(shard.shape, generator=gen).to(env.local_device())
        rope = ref.rotary(torch.arange(SEQ, device=shard.device).expand(BATCH, -1), shard.dtype)
        grads = {}
        for split in (False, False, True):  # the first one fills DTensor's sharding caches
            block.zero_grad(set_to_none=True)
            x = shard.clone().requires_grad_()
            out = block(x, rope)
            if split:
                deferred = None

                def run_b():
                    nonlocal deferred
                    deferred = _backward_input(out, grad, x)  # noqa: B023 (run_b runs at once, below)

                work = _work(run_b)
                assert deferred.restarts and all(p.grad is None for p in block.parameters()), "B touched a weight"
                work += _work(lambda: deferred.run(out))  # noqa: B023 (_work runs it at once)
            else:
                work = _work(lambda: out.backward(grad))  # noqa: B023 (_work runs it at once)
            grads[split] = work, x.grad, {n: p.grad for n, p in block.named_parameters()}
        (whole, x_ref, ref_grads), (split_work, x_grad, split_grads) = grads[False], grads[True]
        assert split_work == whole, (
            f"tp={tp} overlap={overlap}: B + W did {dict(split_work - whole)} more, {dict(whole - split_work)} less"
        )
        assert rel_err(x_grad, x_ref) < 1e-6
        for name, g in ref_grads.items():
            assert g is not None and rel_err(split_grads[name], g) < REASSOCIATION_RTOL, f"tp={tp}: {name}"


class _CollectiveShapes(TorchDispatchMode):
    """Shapes of every tensor that enters or leaves a collective."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace in ("_c10d_functional", "c10d") and "wait" not in func.__name__:
            for t in [*args, *(out if isinstance(out, (list, tuple)) else [out])]:
                if isinstance(t, torch.Tensor):
                    self.shapes.append((func.__name__, tuple(t.shape)))
        return out


@pytest.mark.full
def check_loss_never_gathers_logits(seed):
    cfg = ModelConfig(**DENSE)
    model = _parallel_copy(random_model(cfg, seed), _tp_mesh(8), sp=True, on_meta=True)
    tokens, labels = _batch(cfg, seed)
    recorder = _CollectiveShapes()
    with recorder:
        _step(model, tokens, labels, parallel_token_loss_sum)
    # DTensor gathers along dim 0 and rearranges after, so compare sizes, not shapes.
    gathered = [math.prod(shape) for op, shape in recorder.shapes if op.startswith("all_gather")]
    assert BATCH * SEQ * cfg.hidden_size in gathered, "the SP gathers of hidden states were not seen"
    largest = max(math.prod(shape) for _, shape in recorder.shapes)
    assert largest < BATCH * SEQ * cfg.vocab_size, f"a collective moved {largest} elements (full logits or more)"

    logits = model(tokens).detach().requires_grad_()
    assert isinstance(logits, DTensor) and logits.to_local().shape[-1] == cfg.vocab_size // 8
    comm = CommDebugMode()
    with comm:
        loss = parallel_token_loss_sum(logits, labels)
        loss.backward()
    counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    # max, then (sum of exp, target logit) per token: two reductions of [tokens]-sized vectors.
    assert counts == {"allreduce_": 2}, counts
    assert logits.grad.placements == logits.placements and logits.grad.to_local().abs().max() > 0


def check_heads_error(seed):
    cfg = ModelConfig(**{**DENSE, "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 8})
    with torch.device("meta"):
        model = build_model(cfg)
    with pytest.raises(ConfigError, match=r"tp = 8 does not divide num_attention_heads = 12.*1, 2, 4"):
        apply_tensor_parallel(model, _tp_mesh(8))


class _Gain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.tensor([1.3]))

    def forward(self, x):
        return self.gain * x


def _gain_mlp(seed: int, tp_mesh=None, grad: str = "infer"):
    """up (colwise) -> a scalar gain on the split activation -> down (rowwise); the gain's gradient is a
    part on each tp rank."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), _Gain(), torch.nn.Linear(32, 16))
    if tp_mesh is not None:
        parallelize_module(
            mlp, tp_mesh, {"0": ColwiseParallel(), "1": ReplicateParallel(grad=grad), "2": RowwiseParallel()}
        )
        name_tp_gradients(mlp)
    return mlp


@pytest.mark.full
def check_replicated_gradients(seed):
    """A parameter on a column-split activation: declared replicated, the first backward refuses it by
    name; undeclared ("infer"), its gradient is the tp sum and equals the unparallelized one, at tp 2,
    4 and 8; the decision is kept (no further all-gather)."""
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed))
    ref = _gain_mlp(seed)
    ref(x).square().sum().backward()
    for tp in (2, 4, 8):
        tp_mesh = _tp_mesh(tp)
        declared = _gain_mlp(seed, tp_mesh, grad="replicate")
        with pytest.raises(
            ConfigError,
            match=r"parameter '1.gain' is declared replicated over tp .* the tp ranks computed "
            r"different gradients",
        ):
            declared(x).square().sum().backward()
        model = _gain_mlp(seed, tp_mesh)
        for step in range(2):
            model.zero_grad()
            with CommDebugMode() as comm:
                model(x).square().sum().backward()
            assert rel_err(model[1].gain.grad, ref[1].gain.grad) < REASSOCIATION_RTOL, (tp, step)
            assert rel_err(model[0].weight.grad, ref[0].weight.grad) < REASSOCIATION_RTOL, (tp, step)
            gathers = sum(
                n for op, n in comm.get_comm_counts().items() if "allgather" in str(op) or "all_gather" in str(op)
            )
            assert gathers == (1 if step == 0 else 0), (tp, step, comm.get_comm_counts())
        assert model[1].tp_gradients["gain"].decided.is_partial()


@pytest.mark.full
def check_fp8(seed):
    """[train] fp8 split over tp (tests/test_float8.py, tests/test_mxfp8.py): against the 1-rank FP8 model."""
    check_tp_matches_one_rank_fp8(_tp_mesh)
    check_tp_matches_one_rank_mxfp8(_tp_mesh)


@launch_tests(
    8,
    [
        check_heads_error,
        check_replicated_gradients,
        check_collectives_per_layer,
        check_sp_saves_activations_over_tp,
        check_loss_never_gathers_logits,
        check_split_backward_computes_each_gradient_once,
        check_pipeline_stages_and_uneven_vocab,
        check_parity_dense,
        check_tp_overlap,
    ]
    + ([check_fp8] if HAS_TORCHAO else []),
    timeout=420,
)
def test_tensor_parallel_8_ranks():
    return (fresh_seed(),)


def test_tp_gradient_decision():
    """The "infer" rule from the ranks' gradient classes: all equal -> replicated, all different -> summed,
    ranks without a gradient yet -> summed but undecided, equal in groups -> refused by name."""
    rule = TpGradient("infer", "layers.0.mlp.act_fn.alpha_p")
    assert rule._infer([[-1, 0, 1]], 2).is_replicate() and rule.decided is None
    assert rule._infer([[0], [-1, 1]], 2).is_partial() and rule.decided is None
    assert rule._infer([[0], [1], [2], [3]], 4).is_partial() and rule.decided.is_partial()
    rule = TpGradient("infer", "x.w")
    assert rule._infer([[0, 1, 2, 3]], 4).is_replicate() and rule.decided.is_replicate()
    with pytest.raises(
        ConfigError, match=r"parameter 'x.w' .* cannot decide .* ranks \[\[0, 1\], \[2, 3\]\] computed equal"
    ):
        TpGradient("infer", "x.w")._infer([[0, 1], [2, 3]], 4)
    with pytest.raises(ValueError, match="replicate, partial or infer"):
        ReplicateParallel(grad="replicated")


def test_error_lists_valid_tp():
    with pytest.raises(ConfigError, match=r"num_attention_heads = 28\. Valid tp up to 8 for this model: 1, 2, 4\."):
        check_tensor_parallel(28, 4, 8)
    with pytest.raises(ConfigError, match=r"num_key_value_heads = 3 do not divide"):
        check_tensor_parallel(12, 3, 2)
    check_tensor_parallel(12, 2, 4)  # 2 KV heads each replicated over 2 ranks
