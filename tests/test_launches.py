"""meshtron.testing's launches as pytest results: one result per check, selected by -k and -m, the failing
check named with its rank and arguments, the checks after it reported as not run; and its parity helper."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from meshtron.testing import GRAD_RTOL, LOSS_RTOL, assert_parity

CHECKS = textwrap.dedent(
    """
    import pytest
    import torch
    import torch.distributed as dist

    from meshtron.testing import launch_tests


    def check_all_reduce(value):
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == dist.get_world_size()


    def check_refused_on_rank_1(value):
        assert dist.get_rank() != 1, f"rank 1 refuses {value}"


    def check_after_the_failure(value):
        dist.barrier()


    @pytest.mark.full
    def check_in_the_full_tier(value):
        assert value == 7


    @launch_tests(2, [check_all_reduce, check_refused_on_rank_1, check_after_the_failure, check_in_the_full_tier])
    def test_launch(tmp_path):
        (tmp_path / "prepared").write_text("once")
        return (7,)
    """
)


def _pytest(folder, *args) -> str:
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "test_checks.py", *args],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return run.stdout + run.stderr


def _outcomes(output: str) -> list[tuple[str, str]]:
    """(outcome, check) per line of pytest's short summary, in its order."""
    rows = []
    for line in output.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] in ("PASSED", "FAILED", "ERROR") and "[" in words[1]:
            rows.append((words[0], words[1].split("[")[1].rstrip("]")))
    return rows


def test_each_check_is_its_own_result(tmp_path):
    (tmp_path / "test_checks.py").write_text(CHECKS)
    quick = _pytest(tmp_path, "-m", "not full")
    assert _outcomes(quick) == [
        ("PASSED", "check_all_reduce"),
        ("FAILED", "check_refused_on_rank_1"),
        ("FAILED", "check_after_the_failure"),
    ], quick
    assert "1 deselected" in quick, quick
    assert "check 'check_refused_on_rank_1' failed on rank 1 of 2" in quick, quick
    assert "AssertionError: rank 1 refuses 7" in quick and "launch arguments: (7,)" in quick, quick
    assert (
        "check 'check_after_the_failure' did not run: the launch of 2 ranks ended at check 'check_refused_on_rank_1'"
    ) in quick, quick

    # -k picks checks inside the launch: the launch runs those alone, the full-tier one among them.
    picked = _pytest(tmp_path, "-k", "all_reduce or full_tier")
    assert _outcomes(picked) == [("PASSED", "check_all_reduce"), ("PASSED", "check_in_the_full_tier")], picked
    assert "run_checks: check_refused_on_rank_1" not in picked and "2 deselected" in picked, picked


FIXTURE_LAUNCH = textwrap.dedent(
    """
    import os
    from pathlib import Path

    import pytest
    import torch.distributed as dist

    from meshtron.testing import LaunchedRuns, checks_needed, launch_checks, launched_check_results


    def _log(name):
        with open(os.environ["LAUNCH_LOG"], "a") as log:
            log.write(f"{name} {dist.get_rank()}\\n")


    def write_rank(root):
        _log("write_rank")
        (Path(root) / f"rank-{dist.get_rank()}").write_text("ran")


    def refuse_on_rank_0(root):
        _log("refuse_on_rank_0")
        assert dist.get_rank() != 0, "rank 0 refuses"


    CHECKS = [write_rank, refuse_on_rank_0]


    @pytest.fixture(scope="module")
    def runs(tmp_path_factory, request):
        root = tmp_path_factory.mktemp("runs")
        return LaunchedRuns(root, [launch_checks(checks_needed(request, CHECKS, "test_check"), 2, str(root))])


    test_check = launched_check_results("runs", CHECKS)


    def test_reads_the_ranks(runs):
        root = runs.after("write_rank")
        assert sorted(p.name for p in root.iterdir()) == ["rank-0", "rank-1"]


    def test_reads_what_the_refusal_left(runs):
        runs.after("refuse_on_rank_0")
    """
)


def _summary(output: str) -> list[tuple[str, str]]:
    """(outcome, test id) per line of pytest's short summary."""
    rows = []
    for line in output.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] in ("PASSED", "FAILED", "ERROR") and "::" in words[1]:
            rows.append((words[0], words[1].split("::")[1]))
    return rows


def test_each_check_of_a_fixture_launch_is_its_own_result(tmp_path, monkeypatch):
    (tmp_path / "test_checks.py").write_text(FIXTURE_LAUNCH)
    log = tmp_path / "launched.log"
    monkeypatch.setenv("LAUNCH_LOG", str(log))
    every = _pytest(tmp_path)
    assert sorted(_summary(every)) == [
        ("FAILED", "test_check[refuse_on_rank_0]"),
        ("FAILED", "test_reads_what_the_refusal_left"),
        ("PASSED", "test_check[write_rank]"),
        ("PASSED", "test_reads_the_ranks"),
    ], every
    raised = [
        line
        for line in every.splitlines()
        if line.startswith("E ") and "DistributedCheckFailed: check 'refuse_on_rank_0' failed on rank 0 of 2" in line
    ]
    assert len(raised) == 2, every  # its result and its reader's; not the short summary, whose width varies with CI
    assert sorted(log.read_text().splitlines()) == [
        "refuse_on_rank_0 0",
        "refuse_on_rank_0 1",
        "write_rank 0",
        "write_rank 1",
    ], every  # one launch for the four results

    # -k picks one check's result: the fixture launches that check alone.
    log.unlink()
    picked = _pytest(tmp_path, "-k", "write_rank")
    assert _summary(picked) == [("PASSED", "test_check[write_rank]")] and "3 deselected" in picked, picked
    assert sorted(log.read_text().splitlines()) == ["write_rank 0", "write_rank 1"], picked


def test_assert_parity_holds_the_contract_and_names_the_layout():
    ref = {"w": torch.tensor([1.0, -2.0]), "b": torch.tensor([0.5])}
    near = [("w", ref["w"] * (1 + GRAD_RTOL / 4)), ("b", ref["b"])]
    assert assert_parity("tp2", 3.0 * (1 + LOSS_RTOL / 4), 3.0, near, ref) == 2
    assert assert_parity("tp2", None, None, near, ref, looser={}) == 2  # gradients alone
    with pytest.raises(AssertionError, match=r"^tp2: loss 3\.0001 vs reference 3\.0, rel err 3\.3"):
        assert_parity("tp2", 3.0001, 3.0)
    with pytest.raises(AssertionError, match=r"^tp2: grad w rel err [45]\.\d\de-04 \(bound 1e-04\)"):
        assert_parity("tp2", None, None, [("w", ref["w"] * (1 + 5e-4))], ref)
    assert assert_parity("tp2", None, None, [("w", ref["w"] * (1 + 5e-4))], ref, looser={"w": 1e-3}) == 1
    with pytest.raises(AssertionError, match="^tp2: the reference run has no gradient named v"):
        assert_parity("tp2", None, None, [("v", ref["w"])], ref)
    with pytest.raises(AssertionError, match="^tp2: grad z: reference is all zeros"):
        assert_parity("tp2", None, None, [("z", torch.zeros(2))], {"z": torch.zeros(2)})
    with pytest.raises(AssertionError, match="^tp2: w has no gradient"):
        assert_parity("tp2", None, None, [("w", None)], ref)
    # A gradient zero in exact arithmetic: rounding noise on both sides, held to GRAD_RTOL x the largest (2.0).
    noise = {**ref, "k.bias": torch.tensor([1e-9, -3e-9])}
    assert assert_parity("tp2", None, None, [("k.bias", torch.tensor([-2e-9, 0.0]))], noise, vanishing=["k.bias"]) == 1
    with pytest.raises(AssertionError, match=r"^tp2: grad k.bias is 1.00e-03, not rounding noise below 1e-04 x the"):
        assert_parity("tp2", None, None, [("k.bias", torch.tensor([1e-3, 0.0]))], noise, vanishing=["k.bias"])
    with pytest.raises(AssertionError, match=r"^tp2: reference grad k.bias is 1.00e-03"):
        assert_parity(
            "tp2",
            None,
            None,
            [("k.bias", torch.zeros(2))],
            {**ref, "k.bias": torch.tensor([1e-3])},
            vanishing=["k.bias"],
        )
