"""Pipeline stage split, schedules, simulator and visualizer (pure: no processes)."""

import subprocess
import sys
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtron.parallel.pipeline import (
    P2P,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    DeadlockError,
    F,
    W,
    analytic_bubble,
    build_schedule,
    chunk_layer_ranges,
    gpipe,
    interleaved_1f1b,
    match_p2p,
    one_f_one_b,
    peak_in_flight,
    simulate,
    split_layers,
)
from meshtron.parallel.pipeline.schedules import _interleaved_slots, _with_p2p
from meshtron.parallel.pipeline.show import main as show_main
from meshtron.parallel.pipeline.show import render_timeline

PNG_HEADER = b"\x89PNG\r\n\x1a\n"

CASES = [(name, pp, m, 1) for name in ("gpipe", "1f1b") for pp in (2, 4, 8) for m in (pp, 2 * pp, 3 * pp + 1)]
CASES += [("interleaved", pp, m, v) for v in (2, 3) for pp in (2, 4, 8) for m in (pp, 2 * pp, 3 * pp)]
CASES += [("gpipe", 1, 3, 1), ("1f1b", 1, 3, 1)]


def _ids(case):
    return "{}-pp{}-m{}-v{}".format(*case)


def _computes(rank_entries):
    return [s for s in rank_entries if isinstance(s, Action)]


def _ops(rank_entries):
    return [op for s in rank_entries if isinstance(s, P2P) for op in s.ops]


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_every_stage_runs_each_microbatch_once_forward_before_backward(case):
    name, pp, m, v = case
    entries = build_schedule(name, pp, m, v)
    seen = defaultdict(list)
    for rank, rank_entries in enumerate(entries):
        for i, a in enumerate(_computes(rank_entries)):
            assert a.stage % pp == rank, f"stage {a.stage} scheduled on rank {rank}"
            seen[(a.stage, a.mb)].append((a.kind, i))
    assert set(seen) == {(s, i) for s in range(pp * v) for i in range(m)}
    for key, runs in seen.items():
        assert [kind for kind, _ in runs] == [F, B], key


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_tensors_are_received_before_use_and_sent_after_production(case):
    name, pp, m, v = case
    last = pp * v - 1
    for rank, rank_entries in enumerate(build_schedule(name, pp, m, v)):
        done, received = set(), set()
        for entry in rank_entries:
            if isinstance(entry, P2P):
                for op in entry.ops:
                    if op.kind in (SEND_F, SEND_B):
                        produced = F if op.kind == SEND_F else B
                        assert (produced, op.stage, op.mb) in done, f"rank {rank}: {op} before its compute"
                        neighbour = op.stage + 1 if op.kind == SEND_F else op.stage - 1
                    else:
                        received.add((op.kind, op.stage, op.mb))
                        neighbour = op.stage - 1 if op.kind == RECV_F else op.stage + 1
                    assert op.peer == neighbour % pp, f"rank {rank}: {op} has the wrong peer"
                continue
            if entry.kind == F and entry.stage > 0:
                assert (RECV_F, entry.stage, entry.mb) in received, f"rank {rank}: {entry} before its input"
            if entry.kind == B and entry.stage < last:
                assert (RECV_B, entry.stage, entry.mb) in received, f"rank {rank}: {entry} before its grad"
            done.add((entry.kind, entry.stage, entry.mb))


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_sends_match_receives_in_posting_order(case):
    name, pp, m, v = case
    entries = build_schedule(name, pp, m, v)
    sent, got = defaultdict(list), defaultdict(list)
    for rank, rank_entries in enumerate(entries):
        for op in _ops(rank_entries):
            if op.kind == SEND_F:
                sent[(rank, op.peer)].append((RECV_F, op.stage + 1, op.mb))
            elif op.kind == SEND_B:
                sent[(rank, op.peer)].append((RECV_B, op.stage - 1, op.mb))
            else:
                got[(op.peer, rank)].append((op.kind, op.stage, op.mb))
    assert sent.keys() == got.keys()
    for channel in sent:
        assert sent[channel] == got[channel], f"ranks {channel} pair different tensors"
    # every stage boundary carries one activation and one gradient per microbatch
    assert sum(len(x) for x in sent.values()) == 2 * m * (pp * v - 1)
    match_p2p(entries)


def _spans(result) -> dict:
    return {(s.kind, s.stage, s.mb): s for line in result.timelines for s in line}


def _assert_data_flow(span: dict, last: int, m: int) -> None:
    """Every micro-batch's forward runs stage after stage, and its backward in the reverse order."""
    for i in range(m):
        for s in range(last):
            assert span[(F, s + 1, i)].start >= span[(F, s, i)].end
            assert span[(B, s, i)].start >= span[(B, s + 1, i)].end


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_simulation_respects_dependencies_and_hits_analytic_bubble(case):
    name, pp, m, v = case
    result = simulate(build_schedule(name, pp, m, v), f_cost=1, b_cost=2)
    span = _spans(result)
    last = pp * v - 1
    _assert_data_flow(span, last, m)
    for i in range(m):
        assert span[(B, last, i)].start >= span[(F, last, i)].end
    assert result.makespan == (v * m + pp - 1) * 3
    assert result.bubble == pytest.approx(analytic_bubble(pp, m, v), abs=1e-12)
    assert result.bubble == pytest.approx((pp - 1) / (v * m + pp - 1), abs=1e-12)


def test_interleaved_bubble_is_megatrons_ratio_in_fraction_form():
    pp, m, v = 4, 8, 2
    bubble = simulate(interleaved_1f1b(pp, m, v)).bubble
    assert bubble / (1 - bubble) == pytest.approx((pp - 1) / (v * m))  # Megatron: bubble time / ideal time
    assert bubble < simulate(one_f_one_b(pp, m)).bubble


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_one_f_one_b_keeps_at_most_pp_microbatches_in_flight(pp):
    m = 3 * pp + 1
    peaks_1f1b = [peak_in_flight(s) for s in one_f_one_b(pp, m)]
    peaks_gpipe = [peak_in_flight(s) for s in gpipe(pp, m)]
    assert peaks_1f1b == [pp - r for r in range(pp)]
    assert max(peaks_1f1b) <= pp
    assert peaks_gpipe == [m] * pp


@settings(max_examples=40, deadline=None)
@given(
    pp=st.integers(2, 6),
    v=st.integers(2, 4),
    groups=st.integers(1, 4),
    f=st.integers(1, 3),
    b=st.integers(1, 4),
    p2p=st.sampled_from([0, 0.5]),
)
def test_random_shapes_never_deadlock(pp, v, groups, f, b, p2p):
    m = groups * pp
    for name, vv in (("interleaved", v), ("1f1b", 1), ("gpipe", 1)):
        result = simulate(build_schedule(name, pp, m, vv), f, b, p2p)
        busy = vv * m * (f + b)
        assert result.makespan >= busy
        if p2p == 0:
            assert result.makespan == (vv * m + pp - 1) * (f + b)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
def test_fewer_microbatches_than_stages_is_an_error(name):
    with pytest.raises(ValueError, match=r"microbatches = 3 is fewer than pp = 4.*microbatches >= 4"):
        build_schedule(name, 4, 3, 2 if name == "interleaved" else 1)


def test_interleaved_needs_a_multiple_of_pp_microbatches():
    with pytest.raises(ValueError, match=r"microbatches = 6 is not a multiple of pp = 4.*4 or 8"):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(ValueError, match="pp >= 2"):
        interleaved_1f1b(1, 4, 2)
    with pytest.raises(ValueError, match="virtual_stages = 2 needs schedule = 'interleaved'"):
        build_schedule("1f1b", 4, 8, 2)
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'"):
        build_schedule("zb", 2, 2)


def test_simulator_reports_deadlock_with_stuck_steps():
    # rank 0 waits for a gradient before sending the activation that would produce it
    entries = [
        [P2P((Action(RECV_B, 0, 0, 1),)), Action(F, 0, 0), P2P((Action(SEND_F, 0, 0, 1),)), Action(B, 0, 0)],
        [P2P((Action(RECV_F, 0, 1, 0),)), Action(F, 0, 1), Action(B, 0, 1), P2P((Action(SEND_B, 0, 1, 0),))],
    ]
    with pytest.raises(DeadlockError, match=r"RECV_B\(s0,mb0\)@1.*RECV_F\(s1,mb0\)@0"):
        simulate(entries)


def test_interleaved_needs_forward_backward_slots_to_avoid_a_ring_deadlock():
    pp, m, v = 4, 8, 2
    per_action = [
        _with_p2p([[a] for slot in _interleaved_slots(pp, m, v, r) for a in slot], pp, pp * v) for r in range(pp)
    ]
    with pytest.raises(DeadlockError):
        simulate(per_action)
    simulate(interleaved_1f1b(pp, m, v))


def test_out_of_order_pairing_is_rejected():
    entries = [
        [Action(F, 0, 0), Action(F, 1, 0), P2P((Action(SEND_F, 0, 0, 1), Action(SEND_F, 1, 0, 1)))],
        [P2P((Action(RECV_F, 1, 1, 0), Action(RECV_F, 0, 1, 0))), Action(F, 1, 1), Action(F, 0, 1)],
    ]
    with pytest.raises(ValueError, match="posting order differs"):
        match_p2p(entries)


def test_split_balances_layers_and_spares_the_ends():
    assert [len(r) for r in chunk_layer_ranges(10, 4)] == [2, 3, 3, 2]
    assert [len(r) for r in chunk_layer_ranges(11, 4)] == [3, 3, 3, 2]
    assert [len(r) for r in chunk_layer_ranges(8, 4)] == [2, 2, 2, 2]
    assert [len(r) for r in chunk_layer_ranges(3, 2)] == [2, 1]
    for layers, pp, v in [(24, 4, 2), (13, 4, 3), (7, 7, 1), (28, 8, 1)]:
        ranges = chunk_layer_ranges(layers, pp, v)
        assert [i for r in ranges for i in r] == list(range(layers))
        sizes = [len(r) for r in ranges]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
        assert sizes[-1] == min(sizes)


def test_split_assigns_chunks_round_robin_for_interleaving():
    assert split_layers(8, 2, 2) == [[range(0, 2), range(4, 6)], [range(2, 4), range(6, 8)]]
    by_rank = split_layers(13, 4, 3)
    ranges = chunk_layer_ranges(13, 4, 3)
    assert all(by_rank[c % 4][c // 4] == ranges[c] for c in range(12))


def test_split_rejects_more_stages_than_layers():
    with pytest.raises(ValueError, match=r"num_hidden_layers = 6 is fewer than pp \* virtual_stages = 8"):
        split_layers(6, 4, 2)


def test_show_writes_png_and_prints_bubble(tmp_path, capsys):
    out = tmp_path / "timeline.png"
    show_main(["--pp", "4", "--microbatches", "8", "--schedule", "interleaved", "--virtual", "2", "--out", str(out)])
    assert out.read_bytes()[:8] == PNG_HEADER
    printed = capsys.readouterr().out
    assert "bubble 0.1579 (simulated), 0.1579 (analytic" in printed


def test_show_command_line(tmp_path):
    out = tmp_path / "t.png"
    cmd = [sys.executable, "-m", "meshtron.parallel.pipeline.show", "--pp", "2", "--out", str(out)]
    run = subprocess.run(cmd + ["--microbatches", "4"], capture_output=True, text=True, check=True)
    assert "bubble 0.2000" in run.stdout and out.read_bytes()[:8] == PNG_HEADER


def test_show_rejects_bad_shapes_with_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        show_main(["--pp", "2", "--microbatches", "3", "--schedule", "interleaved", "--virtual", "2"])
    assert "not a multiple of pp = 2" in capsys.readouterr().err


def test_render_measured_timeline(tmp_path):
    measured = [(0, "F", 0, 0.0, 1.1), (1, "F", 0, 1.2, 2.0), (1, "B", 0, 2.0, 4.1), (0, "B", 0, 4.3, 6.0)]
    out = tmp_path / "measured.png"
    render_timeline(measured, str(out), title="measured")
    assert out.read_bytes()[:8] == PNG_HEADER


ZB_CASES = [(name, pp, m) for name in ("zb1p", "zbv", "dualpipev") for pp in (2, 4, 8) for m in (2 * pp, 3 * pp + 1)]


def _zb_ids(case):
    return "{}-pp{}-m{}".format(*case)


def _zb_schedule(name, pp, m):
    return build_schedule(name, pp, m, 1 if name == "zb1p" else 2)


@pytest.mark.parametrize("case", ZB_CASES, ids=_zb_ids)
def test_zero_bubble_schedules_run_every_pass_once_in_data_flow_order(case):
    name, pp, m = case
    entries = _zb_schedule(name, pp, m)
    chunks = 1 if name == "zb1p" else 2
    result = simulate(entries, 1, 1, 0, w_cost=1, rendezvous=False)  # raises on deadlock or local disorder
    span = _spans(result)
    last = pp * chunks - 1
    _assert_data_flow(span, last, m)
    for i in range(m):
        for s in range(last + 1):
            if (W, s, i) in span:
                assert span[(W, s, i)].start >= span[(B, s, i)].end
    assert len(span) == len([x for line in result.timelines for x in line])  # nothing twice
    assert {(k, s, i) for k, s, i in span if k != W} == {
        (k, s, i) for k in (F, B) for s in range(last + 1) for i in range(m)
    }
    split = {(s, i) for k, s, i in span if k == W}
    assert split == {(s, i) for s in range(last + 1) for i in range(m)} or name == "dualpipev"
    match_p2p(entries)
    if name == "zb1p":  # one communicator for both directions would do too, as for 1F1B
        match_p2p(entries, one_channel=True)


@pytest.mark.parametrize("pp", [2, 4, 8])
@pytest.mark.parametrize("m_per_pp", [2, 3, 4])
def test_zero_bubble_bubbles_match_the_papers_unit_cost_figures(pp, m_per_pp):
    """Qi et al., for F = B = W (bubble time over ideal time): 1F1B (p-1)/m, ZB-H1 (p-1)/(3m); ZB-V
    rounds its fill to 0: exactly one chunk slot per rank, (p-1)/(6m) with two chunks of unit costs."""
    m = m_per_pp * pp

    def ratio(name, v):
        result = simulate(build_schedule(name, pp, m, v), 1, 1, 0, w_cost=1, rendezvous=False)
        return result.bubble / (1 - result.bubble)

    assert ratio("1f1b", 1) == pytest.approx((pp - 1) / m)
    assert ratio("zb1p", 1) == pytest.approx((pp - 1) / (3 * m))
    assert ratio("zbv", 2) == pytest.approx((pp - 1) / (6 * m))
    # DualPipeV runs its paired slots' backwards whole: two chunk slots of fill per rank
    assert ratio("dualpipev", 2) == pytest.approx(2 * (pp - 1) / (6 * m))


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_zero_bubble_memory_is_one_f_one_bs_peak(pp):
    m = 3 * pp
    # ZB-H1: pp micro-batches on every rank, the peak 1F1B has on its first rank
    assert [peak_in_flight(s) for s in build_schedule("zb1p", pp, m)] == [pp] * pp
    # ZB-V: 2 pp chunk activations, each half a rank's layers: again pp micro-batches' worth
    assert [peak_in_flight(s) for s in build_schedule("zbv", pp, m, 2)] == [2 * pp] * pp
    # DualPipeV keeps one chunk more than ZB-V (DeepSeek-V3: pp + 1 micro-batches' worth)
    assert [peak_in_flight(s) for s in build_schedule("dualpipev", pp, m, 2)] == [2 * pp + 1] * pp


def test_split_backward_names_the_schedules_with_weight_passes():
    """The planner walks one schedule for every checkpointing mode of a schedule without ``W`` actions."""
    from meshtron.parallel.pipeline.schedules import SCHEDULES, SPLIT_BACKWARD, built_schedule, split_backwards

    for name in SCHEDULES:
        v = 1 if name in ("gpipe", "1f1b", "zb1p") else 2
        entries = built_schedule(name, 4, 8, v)
        assert any(split_backwards(rank) for rank in entries) == (name in SPLIT_BACKWARD), name
        assert entries == tuple(map(tuple, build_schedule(name, 4, 8, v)))


def test_a_stage_with_a_checkpointed_or_compiled_part_runs_backward_whole():
    """The rule's one owner, asked of modules by the pipelined runner and of layer indices by the planner."""
    from meshtron.parallel.pipeline.schedules import runs_backward_whole

    def never(_):
        return False

    assert not runs_backward_whole(range(4), never, never)
    assert runs_backward_whole(range(4), lambda layer: layer == 3, never)
    assert runs_backward_whole(range(4), never, lambda _: True)
    assert not runs_backward_whole([], never, lambda _: True)  # nothing compiled in a stage with no parts


def test_zb1p_passes_the_strict_rendezvous_model_too():
    for pp in (2, 4, 8):
        assert simulate(build_schedule("zb1p", pp, 2 * pp), 1, 1, 0, w_cost=1).bubble == pytest.approx(
            simulate(build_schedule("zb1p", pp, 2 * pp), 1, 1, 0, w_cost=1, rendezvous=False).bubble
        )


def test_v_shape_places_stages_down_and_back_up():
    assert split_layers(8, 2, 2, v_shape=True) == [[range(0, 2), range(6, 8)], [range(2, 4), range(4, 6)]]
    entries = build_schedule("zbv", 2, 4, 2)
    # the turn of the V (stages 1 and 2 on rank 1) hands over locally: no p2p between them
    assert not [op for op in _ops(entries[1]) if op.stage in (1, 2) and op.kind in (SEND_F, RECV_B) and op.stage == 1]
    assert {op.peer for r in range(2) for op in _ops(entries[r])} == {0, 1}


@pytest.mark.parametrize(
    "args, message",
    [
        (("zbv", 4, 8, 1), r"zbv: needs virtual_stages = 2 .*set \[parallel\] virtual_stages = 2"),
        (("zbv", 4, 7, 2), r"zbv: microbatches = 7 is fewer than 2 \* pp = 8.*microbatches >= 8"),
        (("dualpipev", 2, 3, 2), r"dualpipev: microbatches = 3 is fewer than the 4 stages.*microbatches >= 4"),
        (("zb1p", 4, 3, 1), r"microbatches = 3 is fewer than pp = 4"),
        (("zb1p", 4, 8, 2), r"virtual_stages = 2 needs schedule = 'interleaved', 'zbv' or 'dualpipev'"),
    ],
)
def test_zero_bubble_constraints_are_clear_errors(args, message):
    with pytest.raises(ValueError, match=message):
        build_schedule(*args)


def test_show_draws_zero_bubble_schedules_with_weight_passes(tmp_path, capsys):
    """Without costs given, a split-backward schedule is drawn with its W (unit costs) and says so."""
    out = tmp_path / "zbv.png"
    show_main(["--pp", "4", "--microbatches", "16", "--schedule", "zbv", "--out", str(out)])
    assert out.read_bytes()[:8] == PNG_HEADER
    printed = capsys.readouterr().out
    assert "costs per chunk: f=1 b=1 w=1 p2p=0 (b and w: the defaults for zbv, a split backward" in printed
    assert "zbv pp=4 microbatches=16 virtual=2 f=1.0 b=1.0 w=1.0" in printed
    assert "bubble 0.0303 (simulated), 0.0303 (analytic for f = b = w)" in printed
    assert "peak in-flight microbatches per rank [8, 8, 8, 8]" in printed
    with pytest.raises(SystemExit):
        show_main(["--pp", "4", "--microbatches", "6", "--schedule", "dualpipev"])
    assert "microbatches >= 8" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name, v", [("1f1b", 1), ("zb1p", 1), ("interleaved", 2), ("interleaved", 3), ("zbv", 2), ("dualpipev", 2)]
)
def test_past_the_steady_count_a_schedule_only_repeats_its_steady_state(name, v):
    """``steady_microbatches``: more micro-batches than 4 pp hold no state the steady count's schedule does
    not (each rank's distinct per-stage held counts, before and after each action) and idle no longer (the
    simulated idle time, any backward cost, split or whole)."""
    from meshtron.parallel.pipeline.schedules import held_by_stage, steady_microbatches

    def states(schedule):
        return [
            {
                (tuple(sorted(before.items())), tuple(sorted(after.items())))
                for (_, before), (_, after) in zip([(0, {})] + list(held_by_stage(entries)), held_by_stage(entries))
            }
            for entries in schedule
        ]

    def idle(schedule, b, w):
        result = simulate(schedule, 1, b, w_cost=w, rendezvous=False)
        return result.bubble * len(schedule) * result.makespan

    for pp in (2, 3, 4):
        steady = steady_microbatches(name, pp, 10 * pp)
        assert steady == 4 * pp and steady_microbatches(name, pp, 3 * pp) == 3 * pp
        base = build_schedule(name, pp, steady, v)
        for m in (steady + pp, 7 * pp):
            longer = build_schedule(name, pp, m, v)
            assert states(longer) == states(base), (pp, m)
            for b, w in ((2.0, 0.0), (1.37, 1.0), (2.9, 0.0)):
                assert idle(longer, b, w) == pytest.approx(idle(base, b, w), rel=1e-9, abs=1e-9), (pp, m, b, w)
    assert steady_microbatches("gpipe", 4, 100) == 100  # gpipe holds every micro-batch
