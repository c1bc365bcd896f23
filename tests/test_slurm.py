"""scripts/slurm/train.sbatch against a real SLURM controller and daemon started on this machine (full tier).

The test installs or finds slurmctld, slurmd, the client commands and munge (Debian's packages; skipped with one
line where they can be neither found nor installed), writes a one-node slurm.conf with this machine's CPUs,
starts the daemons on free ports and stops everything it started. A job of the debug recipe (2 processes on the
node) gives exactly the losses of the same run under plain torchrun; a job cancelled after its step-2
checkpoint (rank 0 held in step 4 by the hang fault) and resubmitted resumes there and ends with the same
losses.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.full

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "slurm" / "train.sbatch"
COMMANDS = ("slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "sinfo", "munged", "munge")
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
STEPS = 6
RUN = ["--recipe", "recipes/debug_dense.toml", "--train.steps", str(STEPS), "--checkpoint.every", "2"]
PROCS = 2


def _missing() -> list[str]:
    return [c for c in COMMANDS if shutil.which(c) is None and not (Path("/usr/sbin") / c).exists()]


def _command(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin") / name)


def _install_or_skip() -> None:
    if _missing() and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "install", "-y", "-q", *PACKAGES], env=env, capture_output=True, timeout=900)
    if missing := _missing():
        pytest.skip(
            f"no SLURM here ({', '.join(missing)} missing), none installable: apt-get install {' '.join(PACKAGES)}"
        )


def _munge_up() -> bool:
    return subprocess.run(f"{_command('munge')} -n | unmunge", shell=True, capture_output=True).returncode == 0


def _start_munge() -> bool:
    """munged running (started as the munge user if it was not); True when this test started it."""
    if _munge_up():
        return False
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    subprocess.run(["runuser", "-u", "munge", "--", _command("munged")], check=True, capture_output=True)
    assert _munge_up(), "munged did not start"
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _config(folder: Path) -> Path:
    host = socket.gethostname()
    for sub in ("state", "spool", "log"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    conf = folder / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=meshtron-test",
                f"SlurmctldHost={host}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                f"StateSaveLocation={folder / 'state'}",
                f"SlurmdSpoolDir={folder / 'spool'}",
                f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
                f"SlurmdPidFile={folder / 'slurmd.pid'}",
                f"SlurmctldLogFile={folder / 'log' / 'slurmctld.log'}",
                f"SlurmdLogFile={folder / 'log' / 'slurmd.log'}",
                f"SlurmctldPort={_free_port()}",
                f"SlurmdPort={_free_port()}",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "MpiDefault=none",
                "ReturnToService=2",
                "SchedulerType=sched/builtin",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_CPU",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                f"NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN",
                "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE",
            ]
        )
        + "\n"
    )
    return conf


def _stop(pidfile: Path) -> None:
    if pidfile.is_file():
        pid = int(pidfile.read_text().strip())
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 15)
        for _ in range(50):
            if not Path(f"/proc/{pid}").exists():
                return
            time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The environment of a user of a one-node SLURM cluster started here (SLURM_CONF set)."""
    _install_or_skip()
    folder = tmp_path_factory.mktemp("slurm")
    conf = _config(folder)
    started_munge = _start_munge()
    env = {**os.environ, "SLURM_CONF": str(conf)}
    try:
        subprocess.run([_command("slurmctld"), "-f", str(conf)], env=env, check=True, capture_output=True)
        subprocess.run([_command("slurmd"), "-f", str(conf)], env=env, check=True, capture_output=True)
        for _ in range(120):
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout
            if state.strip() == "idle":
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"the SLURM node never became idle: {state!r}; {(folder / 'log').iterdir()}")
        yield env
    finally:
        subprocess.run(["scancel", "--user", "root"], env=env, capture_output=True)
        _stop(folder / "slurmd.pid")
        _stop(folder / "slurmctld.pid")
        if started_munge:
            subprocess.run(["pkill", "-x", "munged"], capture_output=True)


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    """The run's losses under plain torchrun, PROCS processes."""
    out = tmp_path_factory.mktemp("torchrun") / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(PROCS), "-m", "meshtron.train"]
    done = subprocess.run(
        [*command, *RUN, "--train.output_dir", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [r["loss"] for r in _records(out)]


def _submit(cluster: dict, out: Path, *, wait: bool, fault: str = "") -> str:
    env = {
        **cluster,
        "MESHTRON_PROCS_PER_NODE": str(PROCS),
        "MESHTRON_LOGS": str(out.parent / "logs"),
        "MESHTRON_PYTHON": sys.executable,
    }
    env.pop("MESHTRON_FAULT", None)
    if fault:
        env["MESHTRON_FAULT"] = fault
    command = ["sbatch", "--parsable", f"--output={out.parent}/%j.out", *(["--wait"] if wait else []), str(SCRIPT)]
    done = subprocess.run(
        [*command, *RUN, "--train.output_dir", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"sbatch failed: {done.stdout[-2000:]}{done.stderr[-2000:]}"
    return done.stdout.strip().split(";")[0]


def _job_output(out: Path, job: str) -> str:
    logs = "".join(p.read_text() for p in sorted((out.parent / "logs").glob(f"{job}-node*.log")))
    return (out.parent / f"{job}.out").read_text() + logs


def test_a_job_trains_as_torchrun_does(cluster, reference, tmp_path):
    out = tmp_path / "run"
    job = _submit(cluster, out, wait=True)
    text = _job_output(out, job)
    assert f"meshtron: job {job}, 1 node(s) x {PROCS} process(es), rendezvous" in text, text[-2000:]
    assert [r["loss"] for r in _records(out)] == reference, text[-2000:]


def test_a_cancelled_job_resumes_on_resubmission(cluster, reference, tmp_path):
    from meshtron.checkpoint import latest_checkpoint

    out = tmp_path / "run"
    first = _submit(cluster, out, wait=False, fault="hang:0:4")
    for _ in range(600):  # its step-2 checkpoint complete, rank 0 then held in step 4
        if latest_checkpoint(out / "checkpoints") is not None:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"job {first} wrote no checkpoint: {_job_output(out, first)[-2000:]}")
    subprocess.run(["scancel", first], env=cluster, check=True)
    for _ in range(120):
        queued = subprocess.run(["squeue", "-h", "-j", first], env=cluster, capture_output=True, text=True).stdout
        if not queued.strip():
            break
        time.sleep(0.5)
    assert len(_records(out)) < STEPS, "the job ended before it was cancelled"
    second = _submit(cluster, out, wait=True)
    text = _job_output(out, second)
    assert "meshtron: resumed from" in text and "(step 2)" in text, text[-2000:]
    assert [r["step"] for r in _records(out)] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in _records(out)] == reference, text[-2000:]
