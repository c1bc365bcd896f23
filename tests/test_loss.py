"""The fused, chunked lm_head + cross-entropy: exact against the plain loss, never holds a micro-batch's
logits, vocab-parallel over tp (with and without SP) with two all-reduces per chunk."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode

from meshtron import env
from meshtron.checkpoint import load_full_state_dict
from meshtron.config import ModelConfig
from meshtron.models import build_model, materialize, token_loss_sum
from meshtron.models.chunked_loss import cross_entropy_sum, linear_cross_entropy_sum
from meshtron.parallel.tensor import apply_tensor_parallel
from meshtron.testing import fresh_seed, launch_tests, random_model, rel_err


class _LargestTensor(TorchDispatchMode):
    """Largest number of elements of any tensor an op produced while active (a DTensor's local part)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, DTensor):
                t = t._local_tensor
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _problem(n: int, hidden: int, vocab: int, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) * 0.3).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[::5] = -100
    return h, w, labels


def _reference(h, w, labels, softcap: float | None = None):
    h, w = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    logits = h @ w.t()
    if softcap:  # as Gemma 2/3's causal LM caps its logits
        logits = torch.tanh(logits / softcap) * softcap
    loss = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
    loss.backward()
    return loss, h.grad, w.grad


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_fused_loss_matches_cross_entropy(chunk):
    h, w, labels = _problem(150, 24, 97)
    want, want_h, want_w = _reference(h, w, labels)
    loss = linear_cross_entropy_sum(h, w, labels, chunk)
    (loss * 3).backward()  # the incoming gradient scales both stored gradients
    assert rel_err(loss, want) < 1e-6
    assert rel_err(h.grad / 3, want_h) < 1e-5 and rel_err(w.grad / 3, want_w) < 1e-5


def test_fused_loss_soft_caps_the_logits():
    """Soft-capping folded into the chunks: loss and both gradients are those of the capped logits
    (a cap of 1.5 is well inside the logits' range, so it changes them)."""
    h, w, labels = _problem(150, 24, 97)
    want, want_h, want_w = _reference(h, w, labels, softcap=1.5)
    assert rel_err(want, _reference(h, w, labels)[0]) > 0.05
    loss = linear_cross_entropy_sum(h, w, labels, 7, softcap=1.5)
    (loss * 3).backward()
    assert rel_err(loss, want) < 1e-6
    assert rel_err(h.grad / 3, want_h) < 1e-5 and rel_err(w.grad / 3, want_w) < 1e-5


def test_logits_loss_matches_cross_entropy_and_keeps_logits():
    h, w, labels = _problem(150, 24, 97)
    want, want_h, want_w = _reference(h, w, labels)
    logits = h @ w.t()
    before = logits.detach().clone()
    loss = cross_entropy_sum(logits, labels, chunk=32)
    loss.backward()
    assert rel_err(loss, want) < 1e-6
    assert rel_err(h.grad, want_h) < 1e-5 and rel_err(w.grad, want_w) < 1e-5
    assert torch.equal(logits.detach(), before), "backward must not overwrite the saved logits"


def test_fused_loss_bf16_accumulates_in_fp32():
    h, w, labels = _problem(512, 32, 300, torch.bfloat16)
    want, want_h, want_w = _reference(h, w, labels)
    loss = linear_cross_entropy_sum(h, w, labels, 64)
    loss.backward()
    assert loss.dtype == torch.float32 and h.grad.dtype == w.grad.dtype == torch.bfloat16
    assert rel_err(loss, want) < 1e-2
    assert rel_err(h.grad, want_h) < 1e-2 and rel_err(w.grad, want_w) < 1e-2


def test_fused_loss_never_holds_the_logits():
    n, hidden, vocab, chunk = 512, 16, 1000, 32
    h, w, labels = _problem(n, hidden, vocab)
    largest = _LargestTensor()
    with largest:
        linear_cross_entropy_sum(h, w, labels, chunk).backward()
    # The biggest temporaries are one chunk of logits (chunk x V); the weight gradient is V x H.
    assert largest.largest == max(chunk * vocab, vocab * hidden), largest.largest
    assert largest.largest * 8 < n * vocab


def test_fused_loss_peak_is_the_planners_loss_term():
    """bf16 with the weight dominant (as at a 7B vocabulary): the peak is the forward's chunk buffers and
    gradients, which meshtron.plan counts; neither the last chunk's logit gradient nor a whole fp32 copy
    of the weight gradient in backward adds to it (together they added 11 % at this shape)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from meshtron.config import Config, TrainConfig
    from meshtron.plan.moments import loss_bytes

    n, hidden, vocab, chunk = 512, 256, 4096, 128
    h, w, labels = _problem(n, hidden, vocab, torch.bfloat16)
    tracker = MemTracker()
    with tracker:
        linear_cross_entropy_sum(h, w, labels, chunk).backward()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    cfg = Config(
        model=ModelConfig(vocab_size=vocab, hidden_size=hidden),
        train=TrainConfig(dtype="bfloat16", seq_len=n, global_batch_size=1, loss_chunk_tokens=chunk),
    )
    inputs = (n + vocab) * hidden * 2
    assert abs(peak - inputs - loss_bytes(cfg, 0)) < 0.01 * peak, (peak - inputs, loss_bytes(cfg, 0))


def test_no_grad_computes_no_gradients():
    h, w, labels = _problem(64, 8, 50)
    largest = _LargestTensor()
    with torch.no_grad(), largest:
        loss = linear_cross_entropy_sum(h, w, labels, 16)
    assert rel_err(loss, _reference(h, w, labels)[0]) < 1e-6
    assert largest.largest <= 16 * 50  # no gradient buffers: only chunk logits


def test_model_loss_equals_loss_of_logits():
    cfg = ModelConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = materialize(build_model(cfg), "cpu", seed=3)
    model.lm_head.chunk_tokens = 5
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 300, (2, 9), generator=gen)
    labels = torch.randint(0, 300, (2, 9), generator=gen)
    labels[1, :4] = -100
    want = token_loss_sum(model(tokens), labels)
    want.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got = model(tokens, labels=labels)
    got.backward()
    assert rel_err(got, want) < 1e-6
    for name, p in model.named_parameters():
        assert rel_err(p.grad, grads[name]) < 1e-5, name


# ---- vocab-parallel over tp, 8 ranks --------------------------------------------------------------------

DENSE = dict(
    vocab_size=250,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=8,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
)
BATCH, SEQ, CHUNK = 2, 32, 8


def _tp_mesh(tp: int):
    world = torch.distributed.get_world_size()
    return init_device_mesh(env.device_type(), (world // tp, tp), mesh_dim_names=("dp", "tp"))["tp"]


def _models(cfg: ModelConfig, tp: int, sp: bool, seed: int):
    ref = random_model(cfg, seed)
    with torch.device("meta"):
        par = build_model(cfg)
    apply_tensor_parallel(par, _tp_mesh(tp), sp)
    par.to_empty(device=env.local_device())
    par.tie_weights()
    with torch.no_grad():
        load_full_state_dict(par, ref.state_dict())
    par.lm_head.chunk_tokens = CHUNK
    return ref, par


def _batch(cfg: ModelConfig, seed: int):
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
    labels[0, :3] = -100
    return tokens.to(env.local_device()), labels.to(env.local_device())


def check_fused_loss_parity(seed):
    """Loss and every gathered gradient equal the single-process model's, at tp 2, 4 (a vocabulary of
    250 it does not divide) and 8, with and without SP, tied or not."""
    for tp in (2, 4, 8):
        for sp in (False, True):
            tie = tp == 4 and not sp
            cfg = ModelConfig(**DENSE, tie_word_embeddings=tie)
            ref, par = _models(cfg, tp, sp, seed + tp)
            tokens, labels = _batch(cfg, seed)
            expected = token_loss_sum(ref(tokens), labels)
            expected.backward()
            actual = par(tokens, labels=labels)
            actual.backward()
            where = f"seed {seed}: tp={tp} sp={sp} tie={tie}"
            assert not isinstance(actual, DTensor) and rel_err(actual, expected) < 1e-5, where
            ref_params = dict(ref.named_parameters())
            for name, p in par.named_parameters():
                grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                assert rel_err(grad, ref_params[name].grad) < 1e-4, f"{where}: {name}"


def check_fused_loss_collectives_and_memory(seed):
    """Two all-reduces of per-token values per chunk in forward; nothing of vocabulary size is moved or
    allocated beyond one chunk's logits."""
    tp = 4
    cfg = ModelConfig(**DENSE)
    _, par = _models(cfg, tp, sp=True, seed=seed)
    _, labels = _batch(cfg, seed)
    mesh = par.lm_head.weight.device_mesh
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(BATCH, SEQ, cfg.hidden_size, generator=gen).to(env.local_device())
    hidden = full.chunk(tp, dim=1)[mesh.get_local_rank()].requires_grad_()  # the SP residual stream
    comm = CommDebugMode()
    largest = _LargestTensor()
    with comm, largest:
        par.lm_head(hidden, labels).backward()
    counts = comm.get_comm_counts()
    chunks = math.ceil(BATCH * SEQ / CHUNK)
    by_name = {str(op).split(".")[-1]: n for op, n in counts.items()}
    # One SP gather of the input, 2 all-reduces per chunk, one reduce-scatter of the input gradient.
    assert by_name == {"all_gather_into_tensor": 1, "allreduce_": 2 * chunks, "reduce_scatter_tensor": 1}, by_name
    v_local = math.ceil(cfg.vocab_size / tp)
    assert largest.largest <= max(CHUNK * v_local, BATCH * SEQ * cfg.hidden_size, v_local * cfg.hidden_size), (
        largest.largest
    )
    assert largest.largest < BATCH * SEQ * v_local


@pytest.mark.full
@launch_tests(8, [check_fused_loss_parity, check_fused_loss_collectives_and_memory], timeout=240)
def test_fused_loss_tensor_parallel_8_ranks():
    return (fresh_seed(),)
