"""Run checks on N local ranks from plain pytest (gloo on CPU, NCCL with one GPU per rank).

Launching ranks is the expensive part on a small machine, so one launch runs a whole list of check functions
in order. Each check runs on every rank; a failing rank reports its traceback and the launch is ended at once
(the others would block in their next collective), with the report naming the check and the rank. Every
launch has a wall-clock timeout, so nothing hangs. See CONTRIBUTING.md, 'Multi-rank checks', and
docs/extending.md, 'Tests check behaviour'.
"""

from __future__ import annotations

import functools
import math
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

_CONTEXT = None


class DistributedCheckFailed(AssertionError):
    """A check failed (or timed out) on at least one rank."""


_STARTUP = "process group start-up"


def _context():
    # A forkserver that has already imported torch turns an 8-rank launch's imports into a few
    # forks; transformers' model base classes (imported in every launch that builds a transformers
    # model) likewise (the start-up times: docs/extending.md). A process has one forkserver, which the suite's dry runs
    # (meshtron.dryrun's rank processes) share once a launch has started it: it imports what their
    # ranks need too.
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(
            [
                "torch",
                "torch.distributed",
                "torch.distributed.tensor",
                "meshtron",
                "meshtron.dryrun",
                "transformers.modeling_layers",
            ]
        )
    return _CONTEXT


def _rank_main(rank: int, world_size: int, store_path: str, checks, args, results, pg_timeout: float):
    import torch
    import torch.distributed as dist

    from meshtron import env

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(1)
    current = _STARTUP
    try:
        env.local_device()
        dist.init_process_group(
            env.backend(),
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
        for check in checks:
            current = check.__name__
            check(*args)
            results.put(("ok", rank, current, None))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report anything, including KeyboardInterrupt
        results.put(("fail", rank, current, traceback.format_exc()))
        results.close()
        results.join_thread()  # flush before the hard exit below drops the feeder thread
        os._exit(1)
    results.put(("exit", rank, None, None))


def run_checks(
    checks: Sequence[Callable[..., Any]],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
) -> None:
    """Run ``checks`` (module-level functions) in order on ``world_size`` ranks; raise on failure.

    ``args`` are passed to every check and must be picklable. Inside a check the default process
    group is initialised, so ``meshtron.build_mesh`` and ``torch.distributed`` work as under torchrun.
    """
    launch_checks(checks, world_size, *args, timeout=timeout).raise_first()


def launch_checks(
    checks: Sequence[Callable[..., Any]],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
) -> LaunchReport:
    """:func:`run_checks` that reports instead of raising: which checks passed on every rank and where the
    launch ended, so each check can be its own test result."""
    if not checks:  # nothing selected: no ranks to start
        return LaunchReport(world_size, [])
    report = _launch(checks, world_size, args, timeout)
    if report.failed == _STARTUP:
        # gloo's TCP rendezvous can drop a connection on an overloaded host before any check ran;
        # that is not what the checks test, so it gets one fresh launch.
        report = _launch(checks, world_size, args, timeout)
    text = repr(args)
    report.arguments = text if len(text) <= 300 else text[:300] + " ..."
    return report


@dataclass
class LaunchReport:
    """What one launch did: the checks that passed on every rank (with their seconds) and, if the launch
    ended early, the check it ended in and why. Checks after that one did not run."""

    world_size: int
    names: list[str]
    passed: dict[str, float] = field(default_factory=dict)
    failed: str | None = None
    message: str = ""
    arguments: str = ""  # the launch's arguments as text (a seed among them), for replaying a failure
    ranks_done: dict[str, int] = field(default_factory=dict, repr=False)

    def credit(self, name: str, seconds: float) -> bool:
        """Count one rank's pass of check ``name``; True once every rank has passed it."""
        self.ranks_done[name] = self.ranks_done.get(name, 0) + 1
        if self.ranks_done[name] < self.world_size:
            return False
        self.passed[name] = seconds
        return True

    def raise_for(self, name: str) -> None:
        """Raise unless check ``name`` passed on every rank."""
        if name in self.passed:
            return
        if name == self.failed:
            raise DistributedCheckFailed(f"{self.message}\nlaunch arguments: {self.arguments}")
        raise DistributedCheckFailed(
            f"check '{name}' did not run: the launch of {self.world_size} ranks ended at check '{self.failed}'"
        )

    def raise_first(self) -> None:
        if self.failed is not None:
            raise DistributedCheckFailed(self.message)


_LAUNCHED: dict[str, LaunchReport | BaseException] = {}


def launch_tests(world_size: int, checks: Sequence[Callable[..., Any]], *, timeout: float = 300.0):
    """One pytest result per check of one multi-rank launch.

    Decorates the function that prepares the launch: it takes fixtures like a test and returns the checks'
    arguments as a tuple, or yields them to keep a context open while the launch runs (a reference run beside
    it) and to assert on what a launch that passed left behind. The result is a test parametrized by check:
    ``-k`` and ``-m`` select checks (a check decorated with ``@pytest.mark.full`` belongs to the full tier), the
    first selected item launches every selected check once, and each item reports its own check: passed (its
    seconds as the ``check_seconds`` property), failed with its traceback, or not run because the launch ended
    at an earlier one.
    """
    import inspect

    import pytest

    by_name = {c.__name__: c for c in checks}

    def decorate(prepare):
        def test(check, request, **fixtures):
            key = request.node.nodeid.split("[")[0]
            if key not in _LAUNCHED:
                selected = [
                    item.callspec.params["check"] for item in request.session.items if item.nodeid.split("[")[0] == key
                ]
                try:
                    _LAUNCHED[key] = _prepared_launch(
                        prepare, fixtures, [by_name[n] for n in selected], world_size, timeout
                    )
                except BaseException as err:  # the preparation failed: every check of the launch reports it
                    _LAUNCHED[key] = err
            outcome = _LAUNCHED[key]
            if isinstance(outcome, BaseException):
                raise outcome
            outcome.raise_for(check)
            request.node.user_properties.append(("check_seconds", round(outcome.passed[check], 1)))

        own = list(inspect.signature(prepare).parameters.values())
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        test.__signature__ = inspect.Signature(
            [inspect.Parameter("check", kind), inspect.Parameter("request", kind), *own]
        )
        test.__name__, test.__qualname__, test.__doc__ = prepare.__name__, prepare.__qualname__, prepare.__doc__
        test.__module__ = prepare.__module__
        test.pytestmark = list(getattr(prepare, "pytestmark", []))
        params = [pytest.param(c.__name__, id=c.__name__, marks=getattr(c, "pytestmark", [])) for c in checks]
        return pytest.mark.parametrize("check", params)(test)

    return decorate


def _prepared_launch(prepare, fixtures: dict, checks: list, world_size: int, timeout: float) -> LaunchReport:
    import inspect

    made = prepare(**fixtures)
    if not inspect.isgenerator(made):  # returned arguments: one launch path for both forms
        made = _yielded(made)
    args = next(made)
    try:
        report = launch_checks(checks, world_size, *(args or ()), timeout=timeout)
    except BaseException:
        made.close()
        raise
    if report.failed is None:
        next(made, None)  # the preparation's own asserts on what the launch left, and its context's exit
    else:
        made.close()  # the failed check is the result to read, not what its absence broke afterwards
    return report


def _yielded(value):
    yield value


@contextmanager
def launched_beside(
    checks: Sequence[Callable[..., Any]], world_size: int, *args: Any, timeout: float = 300.0
) -> Iterator[Future]:
    """:func:`launch_checks` of ``checks`` running while the block runs; yields the future of its report. A
    small launch (a 1-rank reference run) beside a large one uses the CPUs the small one alone leaves idle."""
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(launch_checks, checks, world_size, *args, timeout=timeout)


@dataclass
class LaunchedRuns:
    """What a module fixture's launches left: the folder their checks wrote into, and every check's result.

    A test that reads the folder names the checks whose output it reads (:meth:`after`), so a failed check is
    reported as that check's failure rather than as a missing file."""

    root: Path
    reports: list[LaunchReport]

    def after(self, *names: str) -> Path:
        """The root folder, once each check of ``names`` passed on every rank of its launches."""
        for name in names:
            self.raise_for(name)
        return self.root

    def raise_for(self, name: str) -> None:
        launches = [r for r in self.reports if name in r.names]
        if not launches:
            launched = sorted({n for r in self.reports for n in r.names})
            raise ValueError(f"no launch of this fixture ran a check named '{name}'; it ran {launched}")
        for report in launches:
            report.raise_for(name)

    def seconds(self, name: str) -> float:
        return sum(r.passed.get(name, 0.0) for r in self.reports)


def checks_needed(request, checks: Sequence[Callable[..., Any]], results: str) -> list[Callable[..., Any]]:
    """The checks a module fixture must launch for the selected tests: all of them when any test reading the
    fixture's folder is selected, otherwise those whose own result item (``results[name]``) is selected, so
    ``-k name`` runs one check of the launch."""
    module = [item for item in request.session.items if item.nodeid.split("::")[0] == request.node.nodeid]
    if any(request.fixturename in getattr(item, "fixturenames", ()) for item in module):
        return list(checks)
    chosen = {item.callspec.params["check"] for item in module if getattr(item, "originalname", None) == results}
    return [c for c in checks if c.__name__ in chosen]


def launched_check_results(fixture: str, checks: Sequence[Callable[..., Any]]):
    """A test parametrized by check that reports each check of a module fixture's launches as its own result
    (its seconds as the ``check_seconds`` property); assign it to a ``test_`` name in the module."""
    import pytest

    @pytest.mark.parametrize("check", [c.__name__ for c in checks])
    def test(check, request):
        runs = request.getfixturevalue(fixture)
        runs.raise_for(check)
        request.node.user_properties.append(("check_seconds", round(runs.seconds(check), 1)))

    return test


def _launch(checks, world_size: int, args, timeout: float) -> LaunchReport:
    ctx = _context()
    results = ctx.Queue()
    report = LaunchReport(world_size, [c.__name__ for c in checks])
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(rank, world_size, store, list(checks), args, results, timeout),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            _collect(procs, results, timeout, report)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)
    return report


def _collect(procs, results, timeout: float, report: LaunchReport) -> None:
    """Fill ``report`` from the ranks' messages until every rank exited or one failed, died or ran out of time."""
    world_size = report.world_size
    last = time.monotonic()
    deadline = last + timeout
    exited: set[int] = set()

    def running() -> str:  # the first check not yet passed on every rank (the last if all have: its teardown)
        return next((n for n in report.names if n not in report.passed), report.names[-1])

    while len(exited) < world_size:
        try:
            kind, rank, check, tb = results.get(timeout=0.2)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in exited]
            if dead:
                _end_with_failures(
                    results,
                    [],
                    report,
                    running(),
                    f"rank {dead[0]} died (exit code {procs[dead[0]].exitcode}) without a report",
                )
                return
            if time.monotonic() > deadline:
                stuck = [r for r in range(world_size) if r not in exited]
                report.failed = running()
                report.message = (
                    f"check '{report.failed}' timed out: the launch ran past {timeout:.0f}s; ranks "
                    f"still running: {stuck}; checks passed on all ranks: {list(report.passed)}"
                )
                return
            continue
        if kind == "fail":
            _end_with_failures(results, [(rank, check, tb)], report, check, "")
            return
        if kind == "ok":
            now = time.monotonic()
            if report.credit(check, now - last):  # the suite's time, check by check (pytest -s or -rP shows it)
                print(f"run_checks: {check} passed on {world_size} ranks in {now - last:.1f} s", flush=True)
                last = now
        else:
            exited.add(rank)


def _end_with_failures(results, failures: list, report: LaunchReport, check: str, fallback: str) -> None:
    """Gather the messages that arrive within a second and record the failures in ``report``, root cause first.

    When one rank fails, its peers fail next with broken-connection errors; the rank whose error
    is not a communication error is the one to read. A slower rank's pass of an earlier check can
    still be on its way: it is counted.
    """
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        try:
            kind, rank, failed, tb = results.get(timeout=0.1)
        except queue.Empty:
            continue
        if kind == "fail":
            failures.append((rank, failed, tb))
        elif kind == "ok":
            report.credit(failed, 0.0)
    if not failures:
        report.failed, report.message = check, f"check '{check}' failed: {fallback}"
        return
    comm_words = ("Connection closed", "Connection reset", "Broken pipe", "Timed out", "gloo")
    failures.sort(key=lambda f: (any(w in f[2] for w in comm_words), f[0]))
    rank, failed, tb = failures[0]
    others = ", ".join(f"rank {r} in '{c}'" for r, c, _ in failures[1:])
    report.failed = failed
    report.message = (
        f"check '{failed}' failed on rank {rank} of {report.world_size}"
        + (f" (also failed: {others})" if others else "")
        + f":\n{tb}"
    )


def cached_mesh(**sizes):
    """``build_mesh(**sizes)``, built once per layout per launch: every mesh brings its own process
    groups (each with its gloo threads), and a launch that checks many models reuses a few layouts. Sizes
    left out are their defaults, so ``cached_mesh(tp=2)`` and ``cached_mesh(pp=1, tp=2)`` are one mesh."""
    return _cached_mesh(tuple(sorted({**_mesh_defaults(), **sizes}.items())))


@functools.cache
def _mesh_defaults() -> dict:
    import inspect

    from meshtron.mesh import build_mesh

    return {k: v.default for k, v in inspect.signature(build_mesh).parameters.items()}


@functools.cache
def _cached_mesh(sizes: tuple):
    from meshtron.mesh import build_mesh

    return build_mesh(**dict(sizes))


def layout_mesh(layout):
    """:func:`cached_mesh` of a layout (a ``ParallelConfig``: folded experts and etp included), what
    ``meshtron.mesh.recipe_mesh`` builds for a recipe with that ``[parallel]`` section."""
    p = layout
    return cached_mesh(pp=p.pp, dp=p.dp, cp=p.cp, ep=p.ep, tp=p.tp, etp=p.etp, fold_ep=p.fold_ep)


def cached_recipe_mesh(cfg):
    """:func:`layout_mesh` of a recipe's ``[parallel]`` section."""
    return layout_mesh(cfg.parallel)


# Tiny transformers models for the HF tests: sizes, and name -> (config class, extra config) of the
# dense families every HF test file uses.
HF_TINY_SIZES = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=8,
    head_dim=8,
    max_position_embeddings=64,
)
HF_TINY_FAMILIES = {
    "llama": ("LlamaConfig", dict(num_key_value_heads=2, attention_bias=True)),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(num_key_value_heads=2)),
    # Per-head q_norm / k_norm ('replicated_with_grad_allreduce'); 2 KV heads: replicated at tp = 4.
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2)),
    # Fused qkv_proj / gate_up_proj: 'colwise_gather_output' then 'rowwise_split_input'.
    "phi3": ("Phi3Config", dict(num_key_value_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
}


# The numerics contract (DESIGN.md): a float32 layout's relative error against the one-process run.
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
# Losses over several optimizer steps: each step's float32 differences move the weights the next one starts from.
LOSS_CURVE_RTOL = 1e-4


def assert_parity(
    where: str,
    loss,
    reference_loss,
    grads: Iterable[tuple[str, Any]] = (),
    reference_grads: Mapping[str, Any] | None = None,
    *,
    loss_rtol: float = LOSS_RTOL,
    grad_rtol: float = GRAD_RTOL,
    looser: Mapping[str, float] | None = None,
    vanishing: Sequence[str] = (),
) -> int:
    """A layout's loss (unless ``loss`` is None) and gradients against the reference run's, within the numerics
    contract.

    ``grads`` are the (name, gradient) pairs this rank holds (DTensors are gathered); each is compared with
    ``reference_grads[name]``, within ``looser[suffix]`` for a name ending in one of its suffixes. A name
    ending in one of ``vanishing`` has a gradient that is zero in exact arithmetic (a key projection's bias
    without RoPE: softmax ignores what it adds to every score of a query), so only rounding is left: it and its
    reference must be below ``grad_rtol`` x the largest reference gradient. Returns how many gradients
    were compared; ``where`` (the layout) begins every failure message."""
    if loss is not None:
        err = rel_err(_as_tensor(loss), _as_tensor(reference_loss))
        assert err < loss_rtol, f"{where}: loss {_text(loss)} vs reference {_text(reference_loss)}, rel err {err:.2e}"
    compared = 0
    for name, grad in grads:
        assert grad is not None, f"{where}: {name} has no gradient"
        assert name in reference_grads, f"{where}: the reference run has no gradient named {name}"
        if any(name.endswith(suffix) for suffix in vanishing):
            _assert_vanishing(where, name, grad, reference_grads, grad_rtol)
            compared += 1
            continue
        limit = next((v for k, v in (looser or {}).items() if name.endswith(k)), grad_rtol)
        try:
            err = rel_err(grad, reference_grads[name])
        except AssertionError as failed:  # an all-zero reference: name the layout and the parameter
            raise AssertionError(f"{where}: grad {name}: {failed}") from None
        assert err < limit, f"{where}: grad {name} rel err {err:.2e} (bound {limit:.0e})"
        compared += 1
    return compared


def _assert_vanishing(where: str, name: str, grad, reference_grads: Mapping[str, Any], rtol: float) -> None:
    scale = max(_largest(g) for g in reference_grads.values() if g is not None)
    for run, value in (("", grad), ("reference ", reference_grads[name])):
        size = _largest(value)
        assert size <= rtol * scale, (
            f"{where}: {run}grad {name} is {size:.2e}, not rounding noise below {rtol:.0e} x the largest "
            f"reference gradient ({scale:.2e}): it is zero in exact arithmetic"
        )


def _largest(t) -> float:
    """max |t| (a DTensor gathered first, as :func:`rel_err` does)."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().abs().max().item()


def _text(value) -> str:
    return str(value.tolist() if hasattr(value, "tolist") else value)


def _as_tensor(value):
    import torch

    return value.detach() if isinstance(value, torch.Tensor) else torch.tensor(float(value), dtype=torch.float64)


def rel_err(actual, expected) -> float:
    """max |actual - expected| / max |expected| (DTensors are gathered first).

    A reference that is all zeros fails: a comparison against zeros would prove nothing.
    """
    import torch
    from torch.distributed.tensor import DTensor

    actual = actual.full_tensor() if isinstance(actual, DTensor) else actual
    expected = expected.full_tensor() if isinstance(expected, DTensor) else expected
    scale = expected.detach().abs().max()
    assert scale > 0, "reference is all zeros"
    # float32 at least, float64 when either side is (a float64 reference is not rounded to float32 first).
    dtype = torch.float64 if torch.float64 in (actual.dtype, expected.dtype) else torch.float32
    return ((actual.detach().to(dtype) - expected.detach().to(dtype)).abs().max() / scale).item()


# init_weights gives norms of 1 and biases of 0, and any slice of ones is ones: a parity test on those
# values cannot see a norm or bias applied to the wrong shard of its features. Moving every parameter by
# N(0, 0.05) (the matrices start at N(0, 0.02)) gives each element its own value.
PERTURBATION_STD = 0.05


def perturb_weights_(model, seed: int):
    """Add N(0, :data:`PERTURBATION_STD`) drawn under ``seed`` to every parameter of a plain (unsharded) model,
    in place; the same values on every rank and device. Returns the model."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen).to(p.device, p.dtype) * PERTURBATION_STD)
    return model


def random_model(cfg, seed: int, device=None):
    """The unparallelized meshtron model of ``cfg`` in training mode with random weights everywhere (norms
    and biases too): ``init_weights(seed)`` then :func:`perturb_weights_`; identical on every rank. A
    parallel model gets the same values with ``meshtron.checkpoint.load_full_state_dict(model, ref.state_dict())``."""
    import torch

    from meshtron import env
    from meshtron.models import build_model, materialize

    with torch.device("meta"):
        model = build_model(cfg)
    return perturb_weights_(materialize(model, device or env.local_device(), seed), seed).train()


def fresh_seed() -> int:
    """A new seed for a test's random inputs, printed: pytest shows a failed test's output, so the failing
    draw can be replayed with ``MESHTRON_SEED=<seed>`` (put it in assertion messages too)."""
    import random

    seed = int(os.environ.get("MESHTRON_SEED") or random.randrange(1 << 30))
    print(f"seed {seed} (replay with MESHTRON_SEED={seed})")
    return seed


def assert_step_metrics_sound(records: list[dict], tokens_per_step: int, world_size: int) -> None:
    """Each ``metrics.jsonl`` record's timing figures finite and consistent with each other and with the
    recipe: tokens/s x step time = the tokens of a global batch, every rank's own time (its step time
    less the time it waited in collectives) non-negative and at most the step time. Rank 0 measures
    ``step_time``; every rank's step opens as all leave one barrier, so the others' steps differ from it
    only by the work each does after the step's last collective (its optimizer update), hence 10 %."""
    for r in records:
        figures = {
            k: r[k] for k in ("loss", "grad_norm", "tokens_per_sec", "step_time", "rank_time_max", "rank_time_median")
        }
        assert all(math.isfinite(v) for v in figures.values()), r
        assert math.isclose(r["tokens_per_sec"] * r["step_time"], tokens_per_step, rel_tol=1e-9), r
        assert 0 <= r["rank_time_median"] <= r["rank_time_max"] <= 1.1 * r["step_time"], r
        assert r["slowest_rank"] in range(world_size), r


def random_moe(config: dict, seed: int, **overrides):
    """A training-mode MoE block of ``ModelConfig(**config, **overrides)`` with N(0, 0.3) weights
    drawn under ``seed``: large enough that the router spreads tokens over the experts."""
    import torch

    from meshtron.config import ModelConfig
    from meshtron.models.moe import MoE

    torch.manual_seed(seed)
    moe = MoE(ModelConfig(**{**config, **overrides})).train()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


# c10d and functional (DTensor) spellings of the same collective, counted under one name.
_COLLECTIVE_NAMES = {
    "_allgather_base_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "allgather_": "all_gather",
    "allreduce_": "all_reduce",
    "all_reduce": "all_reduce",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "alltoall_base_": "all_to_all",
    "all_to_all_single": "all_to_all",
}


def module_collectives(comm, fqn: str) -> dict[str, dict[str, int]]:
    """{'forward' | 'backward': {collective: count}} that a ``CommDebugMode`` saw inside module ``fqn``."""
    from collections import Counter

    counts = comm.comm_module_counts.get(fqn, {})
    out = {}
    for phase in ("forward", "backward"):
        tally: Counter = Counter()
        for op, n in counts.get(phase, {}).items():
            name = str(op).split(".")[-2 if str(op).endswith(".default") else -1]
            tally[_COLLECTIVE_NAMES.get(name, name)] += n
        out[phase] = dict(tally)
    return out


@contextmanager
def count_calls(owner: Any, name: str, skip_group=None) -> Iterator[list]:
    """Counts calls of ``owner.name`` (e.g. ``torch.distributed``, ``"all_gather_single"``) while
    active, except those on process group ``skip_group``: yields a list that gets one entry per
    call, its positional arguments. Callers that look the function up on ``owner`` at call time (as FSDP2 does for its
    collectives) are counted."""
    calls: list = []
    original = getattr(owner, name)

    def counting(*args, **kwargs):
        if skip_group is None or kwargs.get("group") is not skip_group:
            calls.append(args)
        return original(*args, **kwargs)

    setattr(owner, name, counting)
    try:
        yield calls
    finally:
        setattr(owner, name, original)


def whole_weight_passes(executor) -> list:
    """The split ``W`` actions past the first stage that run the whole backward instead of restarting
    at the nodes their ``B`` recorded; the list fills while ``executor`` runs."""
    whole, weight = [], executor._weight

    def recorded(index, a):
        key = (a.stage, a.mb)  # no reference to the deferred work kept: W must free it
        if a.stage > 0 and key in executor._deferred and not executor._deferred[key].restarts:
            whole.append(a)
        weight(index, a)

    executor._weight = recorded
    return whole


def units_with_parameters(model) -> int:
    """FSDP2 units that own parameters of their own (not only nested units'): the units that gather
    and reduce a parameter group."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    nested = {
        u: {id(p) for v in u.modules() if v is not u and isinstance(v, FSDPModule) for p in v.parameters()}
        for u in units
    }
    return sum(any(id(p) not in nested[u] for p in u.parameters()) for u in units)


def documented_command(page: Path, section: str, start: str) -> list[str]:
    """The one command of ``page``'s ``## section`` (fenced ``bash``) that begins with ``start``, its lines
    joined and split as a shell would: what a test runs as a user types it."""
    import shlex

    text = page.read_text().split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    blocks = [block.split("```", 1)[0].strip() for block in text.split("```bash")[1:]]
    (command,) = [b for b in blocks if b.startswith(start)]
    return shlex.split(command.replace("\\\n", " "))


def run_torchrun(command: list[str], root: Path, env: Mapping[str, str] | None = None, timeout: float = 300):
    """A ``torchrun ...`` command run from ``root`` with this interpreter (``python -m torch.distributed.run``),
    ``root`` importable; the completed process, whose failure fails the caller with the output's tails."""
    import subprocess
    import sys

    assert command[0] == "torchrun", command
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *command[1:]],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done
