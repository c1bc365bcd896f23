"""The training entry point end to end: layout invariance, resume, HF init and export, the CLI."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshtron.config import ParallelConfig, load_config
from meshtron.testing import (
    LOSS_CURVE_RTOL,
    LaunchedRuns,
    assert_parity,
    assert_step_metrics_sound,
    cached_recipe_mesh,
    checks_needed,
    launch_checks,
    launched_beside,
    launched_check_results,
    rel_err,
)

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4
EVAL_EVERY = 2  # also where the resume tests restart
# Same micro-batch split everywhere: the MoE aux loss is per global micro-batch.
COMMON = [
    "--train.steps",
    str(STEPS),
    "--parallel.microbatches",
    "2",
    "--train.log_every",
    "1",
    "--train.eval_every",
    str(EVAL_EVERY),
    "--train.eval_steps",
    "2",
]

LAYOUTS = {
    "dense": {
        "tp8": ParallelConfig(tp=8),
        "dp2_tp4_sp": ParallelConfig(dp=2, tp=4, sp=True),
        "pp2_dp2_tp2_1f1b": ParallelConfig(pp=2, dp=2, tp=2, schedule="1f1b"),
        "pp2v2_cp2_tp2": ParallelConfig(pp=2, cp=2, tp=2, schedule="interleaved", virtual_stages=2),
        # zbv needs 2 pp micro-batches; the dense loss does not depend on the split.
        "pp2v2_dp2_tp2_zbv": ParallelConfig(pp=2, dp=2, tp=2, schedule="zbv", virtual_stages=2, microbatches=4),
    },
    "moe": {
        "dp2_ep2_tp2_sp": ParallelConfig(dp=2, ep=2, tp=2, sp=True),
        "dp2_tp4": ParallelConfig(dp=2, tp=4),
        "pp2_cp2_ep2_zb1p": ParallelConfig(pp=2, cp=2, ep=2, schedule="zb1p"),
        # Experts folded over the dense ranks (issue 30's command): dense tp 4 x dp 2, experts ep 8.
        "dp2_tp4_fold_ep8": ParallelConfig(dp=2, ep=8, tp=4, fold_ep=True),
        # Folded and split over etp: the checkpoint the MoE resume test reshards.
        "dp2_tp4_sp_fold_ep4_etp2": ParallelConfig(dp=2, ep=4, tp=4, sp=True, etp=2, fold_ep=True),
    },
}
SINGLE = ParallelConfig()
PROFILED = "dp2_tp4_sp"  # traces steps 2-3 on every rank
# The layout runs that also checkpoint every EVAL_EVERY steps: the uninterrupted runs the resume tests
# restart (a run of its own would repeat them step for step).
RESUMED = {"dense": "pp2_dp2_tp2_1f1b", "moe": "dp2_tp4_sp_fold_ep4_etp2"}
# Extra keys of some runs (observability only: the numbers stay comparable with the others).
EXTRA = {"single": ["--train.tensorboard", "true"], PROFILED: ["--train.profile_steps", "[2, 3]"]}


def _overrides(out: Path, layout: ParallelConfig, extra: list[str] = ()) -> list[str]:
    """Every run lies two folders below the fixture's root, which holds the held-out text."""
    args = list(COMMON) + [
        "--train.output_dir",
        str(out),
        "--data.cache_dir",
        str(out.parent / "token_cache"),
        "--data.eval_source",
        str(out.parent.parent / "heldout.txt"),
    ]
    return args + layout.overrides() + list(extra)


def _train(recipe: str, out: Path, layout: ParallelConfig, extra: list[str] = ()) -> None:
    """Build mesh and trainer inside an already launched rank (what ``main`` does after parsing)."""
    from meshtron.parallel.layout import validate_layout
    from meshtron.train import Trainer

    cfg = load_config(ROOT / "recipes" / f"{recipe}.toml", _overrides(out, layout, extra))
    validate_layout(cfg, torch.distributed.get_world_size())
    Trainer(cfg, cached_recipe_mesh(cfg)).fit()


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in _records(out)]


def _eval_losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in _records(out) if "eval_loss" in r}


# Host offload of the optimizer state and of the saved activations (selective checkpointing: half the blocks).
OFFLOAD = [
    "--parallel.offload",
    "optimizer",
    "--parallel.offload_activations",
    "true",
    "--parallel.activation_checkpointing",
    "selective",
]


def single_rank_references(root: str) -> None:
    root = Path(root)
    for recipe in LAYOUTS:
        _train(f"debug_{recipe}", root / recipe / "single", SINGLE, EXTRA["single"])
    # Offloaded, saving at step 4, then resumed from that checkpoint (the later one removed).
    saved = root / "offload" / "checkpoints"
    _train(
        "debug_dense",
        root / "offload" / "uninterrupted",
        SINGLE,
        OFFLOAD + ["--checkpoint.every", str(EVAL_EVERY), "--checkpoint.dir", str(saved)],
    )
    shutil.rmtree(saved / f"step-{STEPS:08d}")
    _train(
        "debug_dense",
        root / "offload" / "resumed",
        SINGLE,
        OFFLOAD + ["--checkpoint.resume", "true", "--checkpoint.dir", str(saved)],
    )
    # Gathered once per step: the unsharded gradients accumulate on the device, then go to the host.
    _train("debug_dense", root / "offload" / "per_step", SINGLE, OFFLOAD + ["--parallel.fsdp_gather", "per_step"])


def _saved(root: Path, recipe: str) -> Path:
    """Where the layout run ``RESUMED[recipe]`` writes its checkpoints."""
    return root / "checkpoints" / recipe


def eight_rank_layouts(root: str) -> None:
    root = Path(root)
    for recipe, layouts in LAYOUTS.items():
        for name, layout in layouts.items():
            saves = ["--checkpoint.every", str(EVAL_EVERY), "--checkpoint.dir", str(_saved(root, recipe))]
            _train(
                f"debug_{recipe}",
                root / recipe / name,
                layout,
                EXTRA.get(name, []) + (saves if RESUMED[recipe] == name else []),
            )


def eight_rank_eval_before_training(root: str) -> None:
    """Evaluated on the training data itself before any update, the first eval batch is the first
    training batch: the forward-only pass (pipelined, interleaved) gives the first step's loss."""
    from meshtron.parallel.layout import validate_layout
    from meshtron.train import Trainer

    out = Path(root) / "eval_first" / "run"
    # Also the MoE statistics on TensorBoard: capacity drops, layers 0 and 2 on pp-rank 0, 1 and 3 on pp-rank 1.
    cfg = load_config(
        ROOT / "recipes" / "debug_moe.toml",
        _overrides(
            out,
            LAYOUTS["dense"]["pp2v2_cp2_tp2"],
            [
                "--data.eval_source",
                "builtin",
                "--train.eval_steps",
                "1",
                "--train.steps",
                "1",
                "--train.eval_every",
                "0",
                "--train.tensorboard",
                "true",
                "--model.moe_capacity_factor",
                "1.0",
            ],
        ),
    )
    validate_layout(cfg, torch.distributed.get_world_size())
    trainer = Trainer(cfg, cached_recipe_mesh(cfg))
    before = trainer.evaluate()["eval_loss"]
    trainer.fit()
    if torch.distributed.get_rank() == 0:
        (out / "eval_before.json").write_text(json.dumps(before))


def eight_rank_resume(root: str) -> None:
    """Resume from the step-EVAL_EVERY checkpoint of an uninterrupted run (the layout runs of RESUMED), in a
    fresh trainer on the same layout and, resharded, on tp8; both finish the remaining steps."""
    root = Path(root)
    saved = _saved(root, "dense")
    if torch.distributed.get_rank() == 0:
        for recipe in RESUMED:  # as if the runs had stopped after step EVAL_EVERY
            shutil.rmtree(_saved(root, recipe) / f"step-{STEPS:08d}")
    torch.distributed.barrier()
    for name, resumed_layout in (("split", LAYOUTS["dense"][RESUMED["dense"]]), ("reshard", ParallelConfig(tp=8))):
        _train(
            "debug_dense",
            root / "resume" / name,
            resumed_layout,
            ["--checkpoint.resume", "true", "--checkpoint.dir", str(saved)],
        )
    # MoE: experts folded and split over etp, resumed unfolded (ep a mesh dimension, experts whole).
    _train(
        "debug_moe",
        root / "resume_moe" / "reshard",
        ParallelConfig(dp=4, ep=2),
        ["--checkpoint.resume", "true", "--checkpoint.dir", str(_saved(root, "moe"))],
    )


def eight_rank_hf_round_trip(root: str) -> None:
    """Init from an HF folder, train with a vanishing lr on a TP x PP layout, export."""
    root = Path(root)
    _train(
        "debug_dense",
        root / "hf" / "run",
        ParallelConfig(pp=2, dp=2, tp=2),
        [
            "--checkpoint.init_from_hf",
            str(root / "hf" / "source"),
            "--checkpoint.export_hf",
            str(root / "hf" / "export"),
            "--train.lr",
            "1e-30",
            "--train.min_lr",
            "0.0",
            "--train.weight_decay",
            "0.0",
            "--train.steps",
            "2",
        ],
    )


BESIDE = [single_rank_references]
EIGHT_RANKS = [eight_rank_layouts, eight_rank_eval_before_training, eight_rank_resume, eight_rank_hf_round_trip]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, request):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from meshtron.hf import hf_config_dict

    root = tmp_path_factory.mktemp("train")
    cfg = load_config(ROOT / "recipes" / "debug_dense.toml").model
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config.from_dict(hf_config_dict(cfg)))
    hf.save_pretrained(root / "hf" / "source")
    (root / "heldout.txt").write_text((ROOT / "README.md").read_text())  # text the models never train on
    beside, eight = (checks_needed(request, c, "test_launched_check") for c in (BESIDE, EIGHT_RANKS))
    with launched_beside(beside, 1, str(root), timeout=600) as reference:
        report = launch_checks(eight, 8, str(root), timeout=1200)
    return LaunchedRuns(root, [reference.result(), report])


test_launched_check = pytest.mark.full(launched_check_results("runs", BESIDE + EIGHT_RANKS))


@pytest.mark.full
@pytest.mark.parametrize("recipe,layout", [(r, n) for r, ls in LAYOUTS.items() for n in ls])
def test_loss_curve_is_layout_invariant(runs, recipe, layout):
    root = runs.after("single_rank_references", "eight_rank_layouts")
    reference = _losses(root / recipe / "single")
    losses = _losses(root / recipe / layout)
    assert len(losses) == len(reference) == STEPS
    for step, (a, b) in enumerate(zip(losses, reference), start=1):
        assert_parity(f"step {step}: {layout} against single-rank", a, b, loss_rtol=LOSS_CURVE_RTOL)
    assert reference[-1] < reference[0] - 0.1, f"the debug recipe should learn in {STEPS} steps"


@pytest.mark.full
@pytest.mark.parametrize("recipe,layout", [(r, n) for r, ls in LAYOUTS.items() for n in ls])
def test_eval_loss_is_layout_invariant(runs, recipe, layout):
    root = runs.after("single_rank_references", "eight_rank_layouts")
    reference = _eval_losses(root / recipe / "single")
    losses = _eval_losses(root / recipe / layout)
    assert sorted(reference) == sorted(losses) == [EVAL_EVERY, STEPS]
    for step in reference:
        assert_parity(f"step {step}: {layout} eval against single-rank", losses[step], reference[step])
    records = {r["step"]: r for r in _records(root / recipe / layout)}
    assert abs(records[STEPS]["eval_ppl"] - math.exp(losses[STEPS])) < 1e-9 * records[STEPS]["eval_ppl"]
    assert losses[STEPS] < losses[EVAL_EVERY], "held-out loss should fall while the model learns"


@pytest.mark.full
def test_eval_of_the_training_batch_before_any_update_is_its_training_loss(runs):
    root = runs.after("eight_rank_eval_before_training")
    out = root / "eval_first" / "run"
    before = json.loads((out / "eval_before.json").read_text())
    (first,) = _records(out)
    assert abs(before - first["loss"]) < 1e-6 * first["loss"], (before, first["loss"])
    assert first["eval_loss"] < before  # the logged evaluation ran after the update, on the same batch


def _board(out: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of a run's TensorBoard files as {tag: [(step, value)]}, read by tensorboard itself."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.mark.full
@pytest.mark.parametrize("recipe", list(LAYOUTS))
def test_tensorboard_files_hold_the_logged_metrics(runs, recipe):
    root = runs.after("single_rank_references")
    out = root / recipe / "single"
    board, records = _board(out), _records(out)
    for key, tag in (
        ("loss", "train/loss"),
        ("lr", "train/lr"),
        ("grad_norm", "train/grad_norm"),
        ("tokens_per_sec", "perf/tokens_per_sec"),
        ("eval_loss", "eval/loss"),
        ("eval_ppl", "eval/perplexity"),
    ):
        expected = [(r["step"], r[key]) for r in records if key in r]
        assert [step for step, _ in board[tag]] == [step for step, _ in expected], tag
        for (_, got), (_, want) in zip(board[tag], expected):
            assert abs(got - want) <= 1e-6 * abs(want), (tag, got, want)  # stored as float32
    loads = [t for t in board if t.startswith("moe/")]
    if recipe == "dense":
        assert not loads
    else:  # 4 MoE layers x 8 experts, each layer's shares summing to 1 at every step
        assert len(loads) == 4 * 8 and "moe/layers.3.mlp/load/expert_007" in board
        for step in range(STEPS):
            assert abs(sum(board[t][step][1] for t in loads if "layers.0." in t) - 1) < 1e-5


@pytest.mark.full
def test_moe_statistics_are_gathered_from_every_pipeline_stage(runs):
    root = runs.after("eight_rank_eval_before_training")
    board = _board(root / "eval_first" / "run")
    for layer in range(4):
        shares = [board[f"moe/layers.{layer}.mlp/load/expert_{e:03d}"][0][1] for e in range(8)]
        assert abs(sum(shares) - 1) < 1e-5 and max(shares) > 1 / 8, layer
        dropped = board[f"moe/layers.{layer}.mlp/dropped"][0][1]
        assert 0 < dropped < 0.5, (layer, dropped)  # capacity factor 1: some tokens of the busiest experts


@pytest.mark.full
def test_profiler_writes_a_trace_of_the_chosen_steps_per_rank(runs):
    root = runs.after("eight_rank_layouts")
    traces = sorted((root / "dense" / PROFILED / "profile").iterdir())
    assert [t.name for t in traces] == [f"rank-{r}.json" for r in range(8)]
    for trace in traces:
        names = {event.get("name") for event in json.loads(trace.read_text())["traceEvents"]}
        assert {"meshtron step 2", "meshtron step 3"} <= names, trace
        assert "meshtron step 1" not in names and "meshtron step 4" not in names
        assert any("all_reduce" in str(n) or "reduce_scatter" in str(n) for n in names), trace  # collectives seen


def _tokens_per_step(recipe: str) -> int:
    train = load_config(ROOT / "recipes" / f"{recipe}.toml").train
    return train.global_batch_size * train.seq_len


@pytest.mark.full
def test_step_metrics_of_every_run_are_sound(runs):
    """Every logged step of every 8-rank run: finite, consistent timing figures (no rank waited longer
    than its step)."""
    root = runs.after("single_rank_references", "eight_rank_layouts")
    for recipe, layouts in LAYOUTS.items():
        for name in layouts:
            assert_step_metrics_sound(_records(root / recipe / name), _tokens_per_step(f"debug_{recipe}"), 8)


@pytest.mark.full
def test_plot_draws_every_run(runs, tmp_path):
    root = runs.after("single_rank_references", "eight_rank_layouts")
    from meshtron.watch.plot import draw, main

    chosen = [root / "dense" / "single", root / "dense" / "tp8"]
    fig = draw(chosen)
    loss_ax, eval_ax, speed_ax = fig.axes
    assert [line.get_label() for line in loss_ax.lines] == ["single", "tp8"]
    for line, run in zip(loss_ax.lines, chosen):
        assert list(line.get_ydata()) == _losses(run)
    assert list(eval_ax.lines[0].get_xdata()) == [EVAL_EVERY, STEPS]
    assert len(speed_ax.lines) == 2
    png = tmp_path / "curves.png"
    assert main([str(r) for r in chosen] + ["-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([str(tmp_path / "missing")]) == 2


@pytest.mark.full
def test_resume_reproduces_the_uninterrupted_run(runs):
    root = runs.after("eight_rank_layouts", "eight_rank_resume")
    full = _losses(root / "dense" / RESUMED["dense"])
    assert len(full) == STEPS
    for name in ("split", "reshard"):  # same layout, then resharded onto tp8
        resumed = _losses(root / "resume" / name)
        assert len(resumed) == STEPS - EVAL_EVERY
        for step, (a, b) in enumerate(zip(resumed, full[EVAL_EVERY:]), start=EVAL_EVERY + 1):
            assert_parity(f"step {step}: {name} resume against uninterrupted", a, b, loss_rtol=LOSS_CURVE_RTOL)
    assert _losses(root / "resume" / "split") == full[EVAL_EVERY:], "same-layout resume must be bit-exact"
    # The folded ep 4 x etp 2 checkpoint resumed on dp 4 x ep 2: DCP reshards the experts.
    full, resumed = _losses(root / "moe" / RESUMED["moe"]), _losses(root / "resume_moe" / "reshard")
    assert len(resumed) == STEPS - EVAL_EVERY
    for step, (a, b) in enumerate(zip(resumed, full[EVAL_EVERY:]), start=EVAL_EVERY + 1):
        assert_parity(f"step {step}: MoE resume unfolded against folded uninterrupted", a, b, loss_rtol=LOSS_CURVE_RTOL)


@pytest.mark.full
def test_offload_changes_no_loss_and_resumes_exactly(runs):
    """One rank with the AdamW state and the saved activations in host memory (the fused AdamW stepping the
    host shards, clipping their gradients): the same losses and gradient norms, bit for bit, as without;
    its step-4 checkpoint resumes to the same last four steps; gathered once per step (gradients accumulating
    on the device before they go to the host), the same losses within 1e-5."""
    root = runs.after("single_rank_references")
    plain, offloaded = _records(root / "dense" / "single"), _records(root / "offload" / "uninterrupted")
    assert [(r["loss"], r["grad_norm"]) for r in offloaded] == [(r["loss"], r["grad_norm"]) for r in plain]
    assert _losses(root / "offload" / "resumed") == _losses(root / "offload" / "uninterrupted")[EVAL_EVERY:]
    for step, (a, b) in enumerate(zip(_losses(root / "offload" / "per_step"), _losses(root / "dense" / "single")), 1):
        assert_parity(f"step {step}: offloaded, gathered per step", a, b)


@pytest.mark.full
def test_hf_init_and_export_keep_transformers_logits(runs):
    root = runs.after("eight_rank_hf_round_trip")
    from transformers import Qwen2ForCausalLM

    source = Qwen2ForCausalLM.from_pretrained(root / "hf" / "source").eval()
    exported = Qwen2ForCausalLM.from_pretrained(root / "hf" / "export").eval()
    ids = torch.randint(0, source.config.vocab_size, (2, 32))
    with torch.no_grad():
        assert rel_err(exported(ids).logits, source(ids).logits) < 1e-5
    first_loss = _losses(root / "hf" / "run")[0]
    assert abs(first_loss - 5.545) < 0.05  # random HF init on bytes: about ln(256)


def test_cli_trains_and_rejects_bad_recipes(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "-m",
        "meshtron.train",
        "--recipe",
        str(ROOT / "recipes" / "debug_dense.toml"),
        "--parallel.dp",
        "2",
        "--train.steps",
        "2",
        "--train.output_dir",
        str(tmp_path / "cli"),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 2/2" in done.stdout and "straggler" not in done.stdout  # a healthy run
    records = _records(tmp_path / "cli")
    assert [r["step"] for r in records] == [1, 2]
    assert {"step", "loss", "grad_norm", "lr", "tokens_per_sec"} <= set(records[0])
    assert_step_metrics_sound(records, _tokens_per_step("debug_dense"), 2)
    bad = subprocess.run(cmd + ["--parallel.tpp", "2"], env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0
    ours = [line for line in bad.stderr.splitlines() if line.startswith("meshtron: ")]
    assert len(ours) == 1 and "unknown key 'tpp'" in ours[0] and "Did you mean 'tp'" in ours[0], bad.stderr[-2000:]
    assert "[rank0]:" not in bad.stderr and "[rank1]:" not in bad.stderr  # no worker traceback
