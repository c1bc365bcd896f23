"""Communication/compute overlap, checked on CPU by the order in which the host issues things.

On a GPU, overlap needs the host to *post* a transfer before it queues the compute that should hide
it, and to wait for it only after. These tests record that order (it is the same on CPU ranks):

* FSDP prefetch: block i+1's all-gather is issued before block i's compute starts (forward), and
  block i-1's before block i's backward compute; results are identical with and without it;
* ring attention: each step posts the next key/value block before computing the current one and
  waits for it after (backward: the same for key/values, and dK/dV accumulators travel behind);
* expert parallelism: the dispatch all-to-all is in flight while the shared expert runs.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from meshtron.checkpoint import load_full_state_dict
from meshtron.config import Config, ModelConfig, ParallelConfig, TrainConfig
from meshtron.mesh import build_mesh
from meshtron.models import build_model, materialize
from meshtron.parallel import context
from meshtron.parallel.context import blocks
from meshtron.parallel.expert import apply_expert_parallel
from meshtron.parallel.runner import NoPipelineRunner
from meshtron.testing import cached_mesh, fresh_seed, launch_tests, random_model

DENSE = ModelConfig(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=10000.0,
)


class _AllGathers(TorchDispatchMode):
    """Appends ``("gather", unit)`` to ``events`` whenever FSDP copies a unit's shards into an all-gather."""

    def __init__(self, units: dict[str, torch.nn.Module], events: list):
        super().__init__()
        self.events = events
        # FSDP copies from each parameter's local shard: its storage names the unit.
        self.unit_of = {
            p.to_local().untyped_storage().data_ptr(): name for name, unit in units.items() for p in unit.parameters()
        }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.fsdp.all_gather_copy_in:
            owners = {self.unit_of.get(t.untyped_storage().data_ptr()) for t in args[0]}
            self.events.append(("gather", owners.pop() if len(owners) == 1 else owners))
        return func(*args, **(kwargs or {}))


def _record_block_compute(blocks: dict[str, torch.nn.Module], events: list) -> None:
    """``("forward", i)`` when block i's own compute starts (after FSDP's pre-forward), and
    ``("backward", i)`` when its output gradient arrives (after FSDP's pre-backward)."""
    for key, block in blocks.items():
        block.input_layernorm.register_forward_pre_hook(lambda m, a, i=key: events.append(("forward", i)))

        def on_output(module, args, out, i=key):
            out.register_hook(lambda g: events.append(("backward", i)))

        block.register_forward_hook(on_output)


def _prefetch_run(prefetch: int, weights: dict, ids, labels):
    layout = ParallelConfig(dp=2, fsdp_prefetch=prefetch)
    cfg = Config(model=DENSE, parallel=layout, train=TrainConfig(seed=3))
    with torch.device("meta"):
        model = build_model(DENSE)
    runner = NoPipelineRunner(model, cached_mesh(**layout.sizes), cfg, torch.device("cpu"))
    load_full_state_dict(runner.module, weights)  # in place: the shards' storages (the units' names) stay
    blocks = dict(runner.module.layers.items())
    events: list = []
    _record_block_compute(blocks, events)
    units = {**blocks, "embed": runner.module.embed_tokens, "head": runner.module.lm_head}
    with _AllGathers(units, events):
        loss = runner.forward_backward(ids, labels)
    grads = {n: p.grad.full_tensor() for n, p in runner.module.named_parameters()}
    return events, loss, grads


def _before(events: list, first, second) -> bool:
    return events.index(first) < events.index(second)


def fsdp_prefetches_the_next_block(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    ids, labels = (torch.randint(0, DENSE.vocab_size, (2, 8), generator=gen) for _ in range(2))
    weights = random_model(DENSE, seed, device="cpu").state_dict()
    events, loss, grads = _prefetch_run(1, weights, ids, labels)
    plain_events, plain_loss, plain_grads = _prefetch_run(0, weights, ids, labels)
    blocks = [str(i) for i in range(DENSE.num_hidden_layers)]
    forward = events[: events.index(("forward", blocks[-1])) + 1]
    backward = events[len(forward) :]
    for this, nxt in zip(blocks, blocks[1:]):
        assert _before(forward, ("gather", nxt), ("forward", this)), forward
        # FSDP2 alone gathers the next block only when its forward begins
        assert not _before(plain_events, ("gather", nxt), ("forward", this)), plain_events
    assert _before(forward, ("gather", "embed"), ("gather", "0"))
    assert _before(forward, ("gather", "head"), ("forward", blocks[-1]))
    for this, prev in zip(blocks[1:], blocks):
        assert _before(backward, ("gather", prev), ("backward", this)), backward
    assert torch.equal(loss, plain_loss), f"seed {seed}: loss {loss} without prefetch {plain_loss}"
    differ = [n for n in grads if not torch.equal(grads[n], plain_grads[n])]
    assert not differ, f"seed {seed}: prefetching changed the gradients of {differ}"


@contextlib.contextmanager
def _patched(obj, name: str, wrapper):
    raw = inspect.getattr_static(obj, name)  # e.g. a staticmethod, restored as it was
    setattr(obj, name, wrapper(getattr(obj, name)))
    try:
        yield
    finally:
        setattr(obj, name, raw)


def _recording(events: list, label: str):
    def wrap(fn):
        def call(*args, **kwargs):
            events.append(label)
            return fn(*args, **kwargs)

        return call

    return wrap


def _ring_expected(rank: int, size: int) -> tuple[list[str], list[str]]:
    forward, backward = [], []
    for step, plan in enumerate(context.ring_schedule(rank, size)):
        more = step + 1 < size
        forward += ["post kv"] * more + ["compute"] * len(plan) + ["wait"] * more
        backward += ["post kv"] * more + ["compute"] * len(plan) + ["wait"] * (step > 0) + ["post dkv"]
        backward += ["wait"] * more
    return forward, backward + ["wait"]


def ring_posts_before_computing(seed: int) -> None:
    mesh = build_mesh(cp=dist.get_world_size())
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    q, k, v = (torch.randn(1, h, 8, 16, generator=gen, requires_grad=True) for h in (4, 2, 2))
    events: list[str] = []

    def start(original):
        def call(self, send, tag):
            events.append("post kv" if tag == context._KV_TAG else "post dkv")
            return original(self, send, tag)

        return call

    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(context.RingExchange, "start", start))
        stack.enter_context(
            _patched(context.RingExchange, "wait", lambda fn: staticmethod(_recording(events, "wait")(fn)))
        )
        stack.enter_context(_patched(blocks, "attention_block", _recording(events, "compute")))
        stack.enter_context(_patched(blocks, "attention_block_backward", _recording(events, "compute")))
        out = context.RingAttention(mesh["cp"])(q, k, v)
        forward = list(events)
        out.backward(torch.randn(out.shape, generator=gen))
    expected_forward, expected_backward = _ring_expected(mesh["cp"].get_local_rank(), mesh["cp"].size())
    assert forward == expected_forward, forward
    assert events[len(forward) :] == expected_backward, events[len(forward) :]


MOE = ModelConfig(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=32,
    rope_theta=10000.0,
)


class _Work:
    def __init__(self, work, events: list):
        self.work, self.events = work, events

    def wait(self):
        self.events.append("wait dispatch")
        return self.work.wait()


def expert_dispatch_overlaps_shared_expert(seed: int) -> None:
    model = materialize(build_model(MOE), "cpu", seed=seed)
    apply_expert_parallel(model, build_mesh(ep=dist.get_world_size()))
    moe = model.layers["0"].mlp
    events: list[str] = []
    moe.shared_expert.register_forward_pre_hook(lambda *a: events.append("shared expert start"))
    moe.shared_expert.register_forward_hook(lambda *a: events.append("shared expert end"))

    def all_to_all(original):
        def call(*args, async_op=False, **kwargs):
            work = original(*args, async_op=async_op, **kwargs)
            events.append("post dispatch" if async_op else "blocking all-to-all")
            return _Work(work, events) if async_op else work

        return call

    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    with _patched(dist, "all_to_all_single", all_to_all):
        model(torch.randint(0, MOE.vocab_size, (2, 8), generator=gen)).sum().backward()
    assert events[:6] == [
        "blocking all-to-all",
        "post dispatch",
        "shared expert start",
        "shared expert end",
        "wait dispatch",
        "blocking all-to-all",
    ], events  # counts, dispatch ... combine


@launch_tests(
    2,
    [fsdp_prefetches_the_next_block, ring_posts_before_computing, expert_dispatch_overlaps_shared_expert],
    timeout=300,
)
def test_overlap_mechanics():
    return (fresh_seed(),)
