"""Reliability: bit-exact resume, crash recovery under torchrun, no hangs, numerics guard, bad input."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from meshtron.config import ConfigError, load_config
from meshtron.testing import (
    LaunchedRuns,
    assert_step_metrics_sound,
    checks_needed,
    launch_checks,
    launched_check_results,
)

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "debug_dense.toml"
MOE_RECIPE = ROOT / "recipes" / "debug_moe.toml"
SINGLE = {"pp": 1, "dp": 1, "cp": 1, "ep": 1, "tp": 1}


def _args(out: Path, layout: dict, extra: list[str] = ()) -> list[str]:
    args = ["--train.output_dir", str(out), "--data.cache_dir", str(out.parent / "token_cache")]
    for key, value in {**SINGLE, **layout}.items():
        args += [f"--parallel.{key}", str(value)]
    return args + list(extra)


def _trainer(out: Path, layout: dict, extra: list[str] = ()):
    from meshtron.parallel.layout import validate_layout
    from meshtron.train import Trainer, recipe_mesh

    cfg = load_config(RECIPE, _args(out, layout, extra))
    validate_layout(cfg, dist.get_world_size())
    return Trainer(cfg, recipe_mesh(cfg))


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in _records(out)]


# ---------------------------------------------------------------- in-process checks on dp2 x tp2

DP2_TP2 = {"dp": 2, "tp": 2, "microbatches": 2}


def exact_resume(root: str) -> None:
    """Resume from step 2 of a 4-step run, next to an interrupted later save: steps 3-4 bit-identical."""
    root = Path(root)
    _trainer(root / "full", DP2_TP2, ["--train.steps", "4", "--checkpoint.every", "2"]).fit()
    full_ckpt, resumed_ckpt = root / "full" / "checkpoints", root / "resumed_ckpt"
    if dist.get_rank() == 0:
        shutil.copytree(full_ckpt / "step-00000002", resumed_ckpt / "step-00000002")
        # A crash during the step-4 save: shards written, marker missing; and a leftover temp folder.
        shutil.copytree(
            full_ckpt / "step-00000004", resumed_ckpt / "step-00000004", ignore=shutil.ignore_patterns("meshtron.json")
        )
        shutil.copytree(full_ckpt / "step-00000004", resumed_ckpt / ".step-00000006.tmp")
    dist.barrier()
    trainer = _trainer(
        root / "resumed",
        DP2_TP2,
        ["--train.steps", "4", "--checkpoint.resume", "true", "--checkpoint.dir", str(resumed_ckpt)],
    )
    assert trainer.start_step == 2
    trainer.fit()


def async_save_resumes_exactly(root: str) -> None:
    """The 4-step run of ``exact_resume`` with asynchronous saves (every 2, keep 2); its step-2
    checkpoint is resumed (steps 3-4 compared in the test). Then a save in flight: until it completes,
    only its temp folder exists and the previous checkpoint is the latest, which is what a crash
    during the write leaves behind."""
    from meshtron.checkpoint import latest_checkpoint

    root = Path(root)
    out, resumed_ckpt = root / "async", root / "async_resumed_ckpt"
    trainer = _trainer(
        out,
        DP2_TP2,
        ["--train.steps", "4", "--checkpoint.every", "2", "--checkpoint.keep", "2", "--checkpoint.async_save", "true"],
    )
    trainer.fit()
    ckpt = out / "checkpoints"
    if dist.get_rank() == 0:
        assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000002", "step-00000004"]
        shutil.copytree(ckpt / "step-00000002", resumed_ckpt / "step-00000002")
    dist.barrier()
    trainer.checkpoints.save(
        6, trainer.runner.module, trainer.optimizer, trainer.cfg, {"data": trainer.dataset.state_dict()}
    )
    if dist.get_rank() == 0:
        assert (ckpt / ".step-00000006.tmp").is_dir() and latest_checkpoint(ckpt) == ckpt / "step-00000004"
    trainer.checkpoints.wait()
    if dist.get_rank() == 0:
        assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000004", "step-00000006"]  # keep 2
    resumed = _trainer(
        root / "async_resumed",
        DP2_TP2,
        ["--train.steps", "4", "--checkpoint.resume", "true", "--checkpoint.dir", str(resumed_ckpt)],
    )
    assert resumed.start_step == 2
    resumed.fit()


def keep_and_final_save(root: str) -> None:
    """every = 2 over 5 steps saves steps 2, 4 and the final 5; keep = 2 leaves the newest two."""
    out = Path(root) / "keep"
    _trainer(out, DP2_TP2, ["--train.steps", "5", "--checkpoint.every", "2", "--checkpoint.keep", "2"]).fit()
    folders = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert folders == ["step-00000004", "step-00000005"], folders


def different_configs_are_named(root: str) -> None:
    from meshtron.train import check_same_config

    rank = dist.get_rank()
    same = load_config(RECIPE, _args(Path(root) / "x", DP2_TP2))
    check_same_config(same)
    lr = "0.003" if rank % 2 == 0 else "0.002"
    differing = load_config(RECIPE, _args(Path(root) / "x", DP2_TP2, ["--train.lr", lr]))
    with pytest.raises(ConfigError) as err:
        check_same_config(differing)
    message = str(err.value)
    assert "ranks [0, 2]" in message and "ranks [1, 3]" in message and "same" in message
    assert err.value.on_every_rank


BAD_PARAM = "layers.2.mlp.up_proj.weight"


def _poison_gradient(trainer, at_step: int) -> None:
    """Rank 1 finds a NaN in one local gradient shard at ``at_step`` (1-based)."""
    original, calls = trainer.runner.forward_backward, [0]

    def forward_backward(*args):
        loss = original(*args)
        calls[0] += 1
        if calls[0] == at_step and dist.get_rank() == 1:
            grad = dict(trainer.runner.module.named_parameters())[BAD_PARAM].grad
            grad.to_local().view(-1)[0] = float("nan")
        return loss

    trainer.runner.forward_backward = forward_backward


def nonfinite_stops_with_the_parameter(root: str) -> None:
    from meshtron.train import NonFiniteError

    trainer = _trainer(Path(root) / "nan_stop", DP2_TP2, ["--train.steps", "2"])
    _poison_gradient(trainer, at_step=2)
    with pytest.raises(NonFiniteError) as err:
        trainer.fit()
    assert "step 2:" in str(err.value) and f"first non-finite gradient: {BAD_PARAM}" in str(err.value)


def nonfinite_between_reads_stops_at_the_next_read(root: str) -> None:
    """With ``log_every = 3`` step 2 is not read: the stop comes at step 3's read and names step 2."""
    from meshtron.train import NonFiniteError

    trainer = _trainer(Path(root) / "nan_unread", DP2_TP2, ["--train.steps", "3", "--train.log_every", "3"])
    _poison_gradient(trainer, at_step=2)
    with pytest.raises(NonFiniteError) as err:
        trainer.fit()
    assert "step 2:" in str(err.value) and "found at the read of step 3" in str(err.value), err.value


def nonfinite_skips_the_update(root: str) -> None:
    out = Path(root) / "nan_skip"
    trainer = _trainer(out, DP2_TP2, ["--train.steps", "3", "--train.on_nonfinite", '"skip"'])
    _poison_gradient(trainer, at_step=2)
    before = {}

    def snapshot_after_step_one(record):
        if record["step"] == 1:
            before.update({n: p.to_local().clone() for n, p in trainer.runner.module.named_parameters()})
        if record["step"] == 2:  # the skipped step left every parameter as it was
            for name, param in trainer.runner.module.named_parameters():
                assert torch.equal(param.to_local(), before[name]), name
        log(record)

    log, trainer.logger.log = trainer.logger.log, snapshot_after_step_one
    trainer.fit()
    if dist.get_rank() == 0:
        records = _records(out)
        assert [r.get("skipped", False) for r in records] == [False, True, False]
        assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)


LATE_S = 0.5  # how late rank 0 joins each collective of waits_counted_once


def waits_counted_once(root: str) -> None:
    """Rank 0 joins a blocking all-reduce (c10d waits inside it) LATE_S late, then two asynchronous
    ones, whose Works two threads wait for at once; each rank writes its waited and wall seconds."""
    from meshtron.watch import collective_log

    collective_log.install()
    start, waited = time.perf_counter(), collective_log.LOG.waited()
    for blocking in (True, False):
        if dist.get_rank() == 0:
            time.sleep(LATE_S)
        if blocking:
            dist.all_reduce(torch.ones(4))
            continue
        works = [dist.all_reduce(torch.ones(4), async_op=True) for _ in range(2)]
        threads = [threading.Thread(target=work.wait) for work in works]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    waited = collective_log.LOG.waited() - waited
    wall = time.perf_counter() - start
    (Path(root) / f"waits-{dist.get_rank()}.json").write_text(json.dumps({"waited": waited, "wall": wall}))


def step_clocks_open_together(root: str) -> None:
    """Ranks 1-3 enter a step LATE_S x rank late (rank 0 logging, or a rank still loading, between steps):
    every rank's step window opens at the step's barrier, so none of them counts the wait for the late ones
    (without it rank 0's step time held 1.5 s of waiting) and each rank's own time lies inside its window."""
    trainer = _trainer(Path(root) / "clock", DP2_TP2, ["--train.steps", "2"])
    trainer.train_step(0)  # warm-up: first-step work is uneven across ranks
    trainer.own_seconds.clear()
    time.sleep(LATE_S * dist.get_rank())
    record = trainer.train_step(1)
    own = trainer.own_seconds[-1]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (record["step_time"], own))
    if dist.get_rank() == 0:
        (Path(root) / "clocks.json").write_text(json.dumps(every))


FOUR_RANKS = [
    waits_counted_once,
    exact_resume,
    async_save_resumes_exactly,
    keep_and_final_save,
    different_configs_are_named,
    nonfinite_stops_with_the_parameter,
    nonfinite_between_reads_stops_at_the_next_read,
    nonfinite_skips_the_update,
    step_clocks_open_together,
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("reliability")
    checks = checks_needed(request, FOUR_RANKS, "test_launched_check")
    return LaunchedRuns(root, [launch_checks(checks, 4, str(root), timeout=600)])


test_launched_check = pytest.mark.full(launched_check_results("runs", FOUR_RANKS))


@pytest.mark.full
def test_time_waited_in_collectives_is_counted_once(runs):
    """The waited time is the union of the waits: within the wall time on every rank (summed, the
    blocking call's inner wait and the two threads' waits counted twice), and on the ranks that
    waited for rank 0, both of its late arrivals."""
    root = runs.after("waits_counted_once")
    for rank in range(4):
        figures = json.loads((root / f"waits-{rank}.json").read_text())
        assert 0 <= figures["waited"] <= figures["wall"], (rank, figures)
        if rank:
            assert figures["waited"] >= 0.8 * 2 * LATE_S, (rank, figures)


@pytest.mark.full
def test_every_rank_times_one_common_step_window(runs):
    """Ranks 1-3 entered the step 0.5, 1.0 and 1.5 s late: the step times still agree (by far less than
    the lateness), and each rank's own time is within its own step."""
    root = runs.after("step_clocks_open_together")
    every = json.loads((root / "clocks.json").read_text())
    times = [step_time for step_time, _ in every]
    assert max(times) - min(times) < LATE_S, every
    assert all(0 <= own <= step_time for step_time, own in every), every


@pytest.mark.full
def test_resume_is_bit_exact_next_to_an_interrupted_save(runs):
    root = runs.after("exact_resume")
    full, resumed = _losses(root / "full"), _losses(root / "resumed")
    assert len(full) == 4 and len(resumed) == 2
    assert resumed == full[2:]  # float equality: model, optimizer, schedule, data position, RNG restored
    full_norms = [r["grad_norm"] for r in _records(root / "full")]
    assert [r["grad_norm"] for r in _records(root / "resumed")] == full_norms[2:]


@pytest.mark.full
def test_async_saved_checkpoint_resumes_exactly(runs):
    root = runs.after("exact_resume", "async_save_resumes_exactly")
    full = _losses(root / "full")
    assert _losses(root / "async") == full  # saving in the background leaves the training as it was
    assert _losses(root / "async_resumed") == full[2:]


def test_checkpoint_without_marker_is_never_loaded(tmp_path):
    from meshtron.checkpoint import CheckpointMismatch, latest_checkpoint, read_marker

    (tmp_path / "step-00000004").mkdir()
    (tmp_path / "step-00000004" / "meshtron.json").write_text(json.dumps({"step": 4}))
    (tmp_path / "step-00000008").mkdir()  # interrupted: shards but no marker
    (tmp_path / ".step-00000012.tmp").mkdir()
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000004"
    with pytest.raises(CheckpointMismatch, match="incomplete"):
        read_marker(tmp_path / "step-00000008")


def test_a_commit_deletes_stale_temp_folders_and_never_prunes_itself(tmp_path):
    """A temp folder left by a killed save of a step this run never saves (it checkpoints at other
    steps) goes at the next commit; keep = 1 in a folder holding a later step of an older run (reused
    without resume) keeps the checkpoint just written."""
    from meshtron.checkpoint import MARKER, CheckpointWriter, latest_checkpoint

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    (tmp_path / "step-00000010").mkdir()
    (tmp_path / "step-00000010" / MARKER).write_text(json.dumps({"step": 10}))
    (tmp_path / ".step-00000003.tmp").mkdir()
    (tmp_path / ".step-00000003.tmp" / "__0_0.distcp").write_bytes(b"half")
    CheckpointWriter(tmp_path, keep=1).save(2, model, optimizer, load_config(RECIPE), {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000002"


# ---------------------------------------------------------------- torchrun: crash, failure, hang


def _torchrun(
    out: Path,
    nproc: int,
    extra: list[str],
    torchrun_args: list[str] = (),
    fault: str = "",
    layout: dict | None = None,
    recipe: Path = RECIPE,
):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MESHTRON_FAULT", None)
    if fault:
        env["MESHTRON_FAULT"] = fault
    layout = layout or {"dp": nproc}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        *torchrun_args,
        "-m",
        "meshtron.train",
        "--recipe",
        str(recipe),
        *_args(out, layout, extra),
    ]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def _finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[str, str]:
    """Wait for a launch; on timeout end its whole process group (launcher and workers) and fail."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the launch hung for {timeout} s:\n{err[-3000:]}")


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the job ended before {path} appeared: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.01)


@pytest.mark.full
def test_killed_rank_restarts_from_the_latest_checkpoint(tmp_path):
    steps = ["--train.steps", "12", "--checkpoint.every", "4"]
    reference = _torchrun(tmp_path / "uninterrupted", 2, steps)
    crashed_out = tmp_path / "crashed"
    crashed = _torchrun(crashed_out, 2, steps + ["--checkpoint.resume", "true"], ["--max-restarts", "1"])
    _wait_for(crashed_out / "checkpoints" / "step-00000004" / "meshtron.json", crashed)
    victim = int((crashed_out / "pids" / "rank-1.pid").read_text())
    os.kill(victim, signal.SIGKILL)
    logged_before_kill = len(_records(crashed_out))
    out, err = _finish(crashed)
    assert crashed.returncode == 0, err[-3000:]
    assert "meshtron: resumed from" in out
    resumed_at = int(out.split("meshtron: resumed from")[1].split("(step ")[1].split(")")[0])
    assert resumed_at >= 4
    steps_lost = max(logged_before_kill - resumed_at, 0)
    print(
        f"killed rank 1 (pid {victim}) after step {logged_before_kill}; resumed at {resumed_at}; "
        f"steps lost {steps_lost}"
    )
    _, ref_err = _finish(reference)
    assert reference.returncode == 0, ref_err[-3000:]
    assert [r["step"] for r in _records(crashed_out)] == list(range(1, 13))
    assert _losses(crashed_out) == _losses(tmp_path / "uninterrupted")


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (its parent, the launcher, was killed too)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _finish_watching_latest(proc: subprocess.Popen, ckpt: Path) -> tuple[str, str, list[int | None]]:
    """``_finish``, sampling the step of the latest complete checkpoint meanwhile (None: there was none)."""
    from meshtron.checkpoint import latest_checkpoint

    seen, done = [], threading.Event()

    def sample() -> None:
        while not done.is_set():
            latest = latest_checkpoint(ckpt)
            seen.append(None if latest is None else int(latest.name.split("-")[1]))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        out, err = _finish(proc)
    finally:
        done.set()
        sampler.join()
    return out, err, seen


@pytest.mark.full
def test_job_killed_during_an_async_save_resumes_from_the_last_complete_checkpoint(tmp_path):
    """SIGKILL of the whole job (launcher and ranks) while the asynchronous save of step 5 is
    written but not committed: rank 0 is held before step 6 (MESHTRON_FAULT), so it never completes
    the save, and the job is killed once DCP has written the shards and its metadata into the temp
    folder (it looks like a DCP checkpoint, only our marker is missing). Saves every step, keep 2."""
    from meshtron.checkpoint import MARKER, latest_checkpoint, read_marker

    recipe = [
        "--train.steps",
        "8",
        "--checkpoint.every",
        "1",
        "--checkpoint.keep",
        "2",
        "--checkpoint.async_save",
        "true",
        "--checkpoint.resume",
        "true",
    ]
    reference = _torchrun(tmp_path / "uninterrupted", 2, ["--train.steps", "8"])
    out = tmp_path / "crashed"
    ckpt = out / "checkpoints"
    crashed = _torchrun(out, 2, recipe, fault="hang:0:6")
    in_flight = ckpt / ".step-00000005.tmp"
    _wait_for(in_flight / ".metadata", crashed, timeout=240)
    ranks = [int((out / "pids" / f"rank-{r}.pid").read_text()) for r in (0, 1)]
    for pid in ranks:  # torchrun starts each rank in a session of its own
        os.kill(pid, signal.SIGKILL)
    os.killpg(crashed.pid, signal.SIGKILL)
    crashed.communicate()
    deadline = time.monotonic() + 30
    while any(_running(pid) for pid in ranks):
        assert time.monotonic() < deadline, "a rank outlived the kill"
        time.sleep(0.05)

    assert sorted(p.name for p in ckpt.iterdir()) == [".step-00000005.tmp", "step-00000003", "step-00000004"]
    assert not (in_flight / MARKER).exists() and sorted(p.name for p in in_flight.glob("__*.distcp"))
    assert latest_checkpoint(ckpt) == ckpt / "step-00000004" and read_marker(ckpt / "step-00000004")["step"] == 4
    assert [r["step"] for r in _records(out)] == [1, 2, 3, 4, 5]
    print(f"killed after step 5 with {in_flight.name} holding {sorted(p.name for p in in_flight.iterdir())}")

    resumed = _torchrun(out, 2, recipe)
    stdout, err, latest_steps = _finish_watching_latest(resumed, ckpt)
    assert resumed.returncode == 0, err[-3000:]
    assert f"meshtron: resumed from {ckpt / 'step-00000004'} (step 4)" in stdout
    print(f"resumed from step 4; latest complete step over the run: {sorted(set(latest_steps))}")
    # Every moment of the resumed run had a complete checkpoint, never older than the one resumed.
    assert latest_steps and None not in latest_steps and latest_steps == sorted(latest_steps)
    assert latest_steps[0] >= 4 and latest_steps[-1] == 8
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000007", "step-00000008"]
    _, ref_err = _finish(reference)
    assert reference.returncode == 0, ref_err[-3000:]
    assert [r["step"] for r in _records(out)] == list(range(1, 9))
    assert _losses(out) == _losses(tmp_path / "uninterrupted")


@pytest.mark.full
def test_a_failing_or_stuck_rank_ends_the_job(tmp_path):
    """A rank's own error is reported once, by that rank, and its peers' failed collectives stay quiet;
    a rank stuck inside an expert-parallel step is named in one hang report (at the automatic limit,
    half the 30 s collective timeout) with the collective its peers wait in; a refusal every rank
    reaches before any process group exists is printed exactly once even when rank 0, held 5 s, is
    stopped before it gets there (the other rank finishes first and torchrun ends the job)."""
    common = ["--train.steps", "20"]
    started = time.monotonic()
    failing = _torchrun(tmp_path / "raise", 2, common + ["--train.collective_timeout_s", "300"], fault="raise:1:3")
    stuck = _torchrun(
        tmp_path / "stall",
        4,
        common + ["--train.collective_timeout_s", "30"],
        fault="stall:2:3",
        layout={"dp": 2, "ep": 2},
        recipe=MOE_RECIPE,
    )
    refused = _torchrun(tmp_path / "refused", 4, ["--parallel.tp", "3"], fault="delay:0:0")
    _, err = _finish(failing)
    assert failing.returncode != 0
    assert err.count("meshtron: rank 1: failed with RuntimeError: MESHTRON_FAULT injected") == 1, err[-3000:]
    assert "collective failed" not in err, err[-3000:]
    _, err = _finish(refused)
    assert refused.returncode != 0
    lines = [line for line in err.splitlines() if line.startswith("meshtron:")]
    assert len(lines) == 1 and "pp=1 x dp=4 x cp=1 x ep=1 x tp=3 = 12, but the world size is 4" in lines[0], err[-3000:]
    _, err = _finish(stuck)
    assert stuck.returncode != 0
    report = _hang_report(err, tmp_path / "stall", 4)
    print(report)
    assert "step 3 has run" in report and "(hang limit 15 s)" in report, report
    assert "Behind: rank 2 (outside any collective: rank 2 at meshtron/faults.py" in report, report
    assert "in stall" in report and "Rank 3 waits in all_to_all_single over ep [2, 3]" in report, report
    assert time.monotonic() - started < 150


def _hang_report(err: str, out: Path, ranks: int) -> str:
    """The job's one hang line, after checking there is exactly one and a file per rank."""
    lines = [line for line in err.splitlines() if line.startswith("meshtron:")]
    hang = [line for line in lines if line.startswith("meshtron: hang: ")]
    assert len(hang) == 1 and not [line for line in lines if "collective failed" in line], err[-3000:]
    for rank in range(ranks):
        text = (out / "hang" / f"rank-{rank}.txt").read_text()
        assert f"rank {rank} of {ranks}" in text and "thread MainThread:" in text and "collectives issued" in text
    return hang[0]


def test_hang_limit_and_summary():
    """The automatic limit, and the summary when no rank is outside a collective (ranks wait in
    different collectives): the rank that issued fewer collectives on a shared group is behind."""
    from meshtron.watch.watchdog import hang_limit, hang_summary

    assert hang_limit(20, 600, [100.0]) == 20
    assert hang_limit(0, 600, []) == 300 and hang_limit(0, 600, [40.0, 41.0, 90.0]) == 300
    assert hang_limit(0, 2000, [40.0, 41.0, 90.0]) == 410 and hang_limit(0, 30, []) == 15
    waiting = {"op": "all_reduce", "group": [0, 1], "dim": "dp", "peers": "", "group_seq": 8}
    states = {
        0: {"waiting": waiting, "counts": [[[0, 1], 8]], "where": "a.py:1 in f"},
        1: {"waiting": {**waiting, "op": "broadcast", "group_seq": 7}, "counts": [[[0, 1], 7]], "where": "b.py:2 in g"},
    }
    assert hang_summary(states, 3, "step 4 has run 20 s on rank 0 (hang limit 20 s)", Path("out/hang")) == (
        "meshtron: hang: step 4 has run 20 s on rank 0 (hang limit 20 s). Behind: rank 1 (fewer collectives "
        "issued: rank 1 at b.py:2 in g). Rank 0 waits in all_reduce over dp [0, 1] (their collective #8 on it; "
        "rank 1 issued 7). No answer from rank 2 (dead, or its Python thread cannot run). Stacks and last "
        "collectives: out/hang/rank-*.txt (start with rank-1.txt)."
    )


@pytest.mark.full
def test_a_straggler_is_named_once_it_stays_behind(tmp_path):
    """Behind means over the median by 20 % and 0.25 s, at two logs in a row on the same rank."""
    from meshtron.watch.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path, 5, enabled=False)
    logs = [
        (3, 0.05, 0.03),  # 67 % over the median, but 0.02 s: a healthy CPU step
        (3, 0.60, 0.30),  # behind once
        (5, 1.03, 0.03),
        (5, 1.04, 0.03),  # behind twice: named
        (5, 1.20, 1.10),
    ]  # 9 % over
    named = [
        logger.straggler({"slowest_rank": rank, "rank_time_max": most, "rank_time_median": median})
        for rank, most, median in logs
    ]
    assert named == [None, None, None, 5, None]


@pytest.mark.full
def test_a_hang_inside_a_pipeline_step_is_reported_and_restarted(tmp_path):
    """pp 2 x dp 2: rank 2 (the last stage) stalls in a block's forward of step 5 while rank 1 works
    SLOW_FAULT_S longer than the others in every step. The hang report names rank 2 within the hang
    limit + 30 s, every rank writes its file, torchrun restarts the job (faults act in its first attempt
    only), it resumes from step 4 and the loss curve equals an uninterrupted run's. metrics.jsonl names
    rank 1 as the slowest rank of the steps before the hang, and the console no other rank; the
    uninterrupted run names none. Every step's timing figures are consistent."""
    from meshtron.faults import SLOW_FAULT_S

    layout = {"pp": 2, "dp": 2, "microbatches": 2}
    steps = ["--train.steps", "8", "--checkpoint.every", "2", "--checkpoint.resume", "true"]
    reference = _torchrun(tmp_path / "uninterrupted", 4, steps, layout=layout)
    out = tmp_path / "stalled"
    stalled = _torchrun(
        out,
        4,
        steps + ["--train.hang_timeout_s", "10"],
        ["--max-restarts", "1"],
        fault="stall:2:5,slow:1:*",
        layout=layout,
    )
    _wait_for(out / "checkpoints" / "step-00000004" / "meshtron.json", stalled, timeout=240)
    stall_began = time.monotonic()
    _wait_for(out / "hang" / "rank-2.txt", stalled, timeout=60)
    reported_after = time.monotonic() - stall_began
    stdout, err = _finish(stalled)
    assert stalled.returncode == 0, err[-3000:]
    report = _hang_report(err, out, 4)
    print(f"{report}\nreported {reported_after:.1f} s after step 4's checkpoint")
    assert reported_after < 10 + 30
    assert "step 5 has run" in report and "Behind: rank 2 (outside any collective" in report, report
    assert "in stall" in report and " over pp [0, 2] (" in report, report
    assert f"meshtron: resumed from {out / 'checkpoints' / 'step-00000004'} (step 4)" in stdout
    records = _records(out)
    before_hang = records[1:4]  # step 1 is warm-up; steps 5-8 are the restarted attempt's, unslowed
    assert [r["slowest_rank"] for r in before_hang] == [1, 1, 1], before_hang
    assert all(r["rank_time_max"] - r["rank_time_median"] > 0.8 * SLOW_FAULT_S for r in before_hang)
    named = re.findall(r"straggler rank (\d+)", stdout)
    assert named and set(named) == {"1"}, stdout
    ref_out, ref_err = _finish(reference)
    assert reference.returncode == 0, ref_err[-3000:]
    assert "straggler" not in ref_out, ref_out
    assert [r["step"] for r in records] == list(range(1, 9))
    assert _losses(out) == _losses(tmp_path / "uninterrupted")
    train = load_config(RECIPE).train
    for run in (out, tmp_path / "uninterrupted"):
        assert_step_metrics_sound(_records(run), train.global_batch_size * train.seq_len, 4)


# ---------------------------------------------------------------- bad input through the CLI


def _write_hf(folder: Path, hidden_size: int | None = None, truncate: bool = False, weights: bool = True):
    from safetensors.torch import save_file

    from meshtron.hf import hf_config_dict

    model = load_config(RECIPE).model
    config = hf_config_dict(model)
    if hidden_size:
        config["hidden_size"] = hidden_size
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    if weights:
        path = folder / "model.safetensors"
        save_file({"model.norm.weight": torch.randn(4096)}, str(path))
        if truncate:
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _write_checkpoint_of_other_shape(root: Path) -> Path:
    from dataclasses import asdict

    cfg = load_config(RECIPE, ["--model.hidden_size", "32"])
    folder = root / "step-00000002"
    folder.mkdir(parents=True)
    (folder / "meshtron.json").write_text(json.dumps({"step": 2, "config": asdict(cfg), "train_state": {}}))
    return folder


def _big_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models

    vocab = {"<|endoftext|>": 0, **{f"t{i}": i for i in range(1, 300)}}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(path))


def test_bad_inputs_fail_once_with_exit_2_and_write_nothing(tmp_path, monkeypatch, capsys):
    from meshtron.train import main

    malformed = tmp_path / "malformed.toml"
    malformed.write_text(RECIPE.read_text().replace("steps = 10", "steps = = 10"))
    _write_hf(tmp_path / "hf_no_weights", weights=False)
    _write_hf(tmp_path / "hf_truncated", truncate=True)
    _write_hf(tmp_path / "hf_other", hidden_size=32)
    ckpt = _write_checkpoint_of_other_shape(tmp_path / "ckpt")
    ckpt_before = (ckpt / "meshtron.json").read_bytes()
    (tmp_path / "empty.txt").write_text("")
    _big_tokenizer(tmp_path / "tokenizer.json")
    cases = {
        "malformed TOML": (["--recipe", str(malformed)], "line"),
        "unknown key": (["--train.stpes", "3"], "Did you mean 'steps'"),
        "wrong type": (["--train.steps", '"ten"'], "[train] steps must be an integer"),
        "impossible sizes": (["--parallel.tp", "3"], "world size is 1"),
        "unknown choice": (["--train.on_nonfinite", '"skp"'], "Did you mean 'skip'"),
        "missing safetensors": (
            ["--checkpoint.init_from_hf", str(tmp_path / "hf_no_weights")],
            "neither model.safetensors",
        ),
        "truncated safetensors": (
            ["--checkpoint.init_from_hf", str(tmp_path / "hf_truncated")],
            "unreadable or truncated",
        ),
        "HF config mismatch": (
            ["--checkpoint.init_from_hf", str(tmp_path / "hf_other")],
            "hidden_size: config.json 32 vs recipe 64",
        ),
        "checkpoint of another shape": (
            ["--checkpoint.resume", "true", "--checkpoint.dir", str(ckpt.parent)],
            "saved for a different model",
        ),
        "missing dataset": (["--data.source", str(tmp_path / "nope.txt")], "does not exist"),
        "empty dataset": (["--data.source", str(tmp_path / "empty.txt")], "holds no text"),
        "missing eval data": (
            ["--data.eval_source", str(tmp_path / "nope.txt")],
            f"[data] eval_source '{tmp_path / 'nope.txt'}' does not exist",
        ),
        "empty eval data": (
            ["--data.eval_source", str(tmp_path / "empty.txt")],
            f"[data] eval_source '{tmp_path / 'empty.txt'}' holds no text",
        ),
        "evaluation without data": (["--train.eval_every", "5"], "eval_every = 5 needs [data] eval_source"),
        "profile window": (["--train.profile_steps", "[3, 2]"], "profile_steps must be [first, last]"),
        "tokenizer too large": (
            ["--data.tokenizer", str(tmp_path / "tokenizer.json")],
            "has 300 tokens but [model] vocab_size is 256",
        ),
    }
    for name in ("WORLD_SIZE", "RANK", "MESHTRON_FAULT"):
        monkeypatch.delenv(name, raising=False)
    # Every case through main() in this process (what `python -m meshtron.train` runs); two also as
    # real commands, for the exit status.
    for name, (args, expected) in cases.items():
        out = tmp_path / "out" / name.replace(" ", "_")
        code = main(_cli_args(args, out))
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2, f"{name}: exit {code}\n{err[-2000:]}"
        assert len(lines) == 1 and lines[0].startswith("meshtron: "), f"{name}: {err[-2000:]}"
        assert expected in lines[0], f"{name}: {lines[0]}"
        assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists(), name
    assert (ckpt / "meshtron.json").read_bytes() == ckpt_before
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    env["PYTHONPATH"] = str(ROOT)
    for name in ("malformed TOML", "empty dataset"):
        args, expected = cases[name]
        cmd = [sys.executable, "-m", "meshtron.train", *_cli_args(args, tmp_path / "cli" / name.replace(" ", "_"))]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and done.stderr.count("meshtron: ") == 1, done.stderr[-2000:]
        assert expected in done.stderr and "Traceback" not in done.stderr


def _cli_args(args: list[str], out: Path) -> list[str]:
    recipe = [] if args[0] == "--recipe" else ["--recipe", str(RECIPE)]
    return [*recipe, "--parallel.dp", "1", "--train.steps", "2", "--train.output_dir", str(out), *args]


# ---------------------------------------------------------------- random recipe edits


@pytest.mark.full
def test_random_recipe_edits_fail_only_with_config_error(tmp_path_factory):
    import dataclasses

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from meshtron.config import Config
    from meshtron.parallel.layout import validate_layout

    keys = [
        (section.name, f.name)
        for section in dataclasses.fields(Config)
        for f in dataclasses.fields(section.default_factory())
    ]
    key = st.one_of(
        st.sampled_from(keys),
        st.tuples(
            st.sampled_from(["train", "parallel", "modle"]),
            st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8),
        ),
    )
    value = st.one_of(
        st.integers(-3, 70),
        st.integers(-(2**70), 2**70),
        st.booleans(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from(['"fsdp"', '"interleaved"', '"x"', "[1, 2]", '"skip"', "{a = 1}", "= =", ""]),
    )
    recipe_text = RECIPE.read_text()
    folder = tmp_path_factory.mktemp("edits")

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(edits=st.lists(st.tuples(key, value), max_size=4), world=st.integers(1, 16), in_file=st.booleans())
    def check(edits, world, in_file):
        path, overrides = folder / "recipe.toml", []
        text = recipe_text
        for (section, name), raw in edits:
            shown = raw if isinstance(raw, str) else json.dumps(raw) if not isinstance(raw, float) else repr(raw)
            shown = {"True": "true", "False": "false", "nan": "nan", "inf": "inf", "-inf": "-inf"}.get(shown, shown)
            if in_file:
                text += f"\n[{section}]\n{name} = {shown}\n"  # may repeat a table: malformed TOML
            else:
                overrides += [f"--{section}.{name}", shown]
        path.write_text(text)
        try:
            validate_layout(load_config(path, overrides), world)
        except ConfigError:
            pass

    check()
