"""``python -m meshtron.train --dry-run N``: real-size steps traced on fake tensors under a fake process group.

The shipped recipes' layouts are simulated rank by rank (one process per distinct rank, no data, no
GPU): the traced peak is held to meshtron.plan's prediction within 5 % (benchmarks/results/dry_run.md
for every recipe), collectives are counted per op, bad input gets the launch's one-line error before
anything is traced, and a layout that does not fit --gpu-memory ends with the pre-flight refusal after
the report.
"""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from meshtron.train import main
from test_readme import table_after, unquote

ROOT = Path(__file__).resolve().parents[1]
# The shipped recipes (those stating GPUs as their hardware) but the 7B (its own test checks the report
# and the refusal), slowest first.
SHIPPED = (
    "qwen2p5_32b",
    "qwen2p5_3b",
    "qwen2p5_72b",
    "qwen2p5_14b",
    "qwen2_57b_a14b",
    "qwen2p5_1p5b",
    "qwen1p5_moe_a2p7b",
    "qwen2p5_0p5b",
)
# MoE layers under tp, checkpointed: routed experts on the SP shards without a shared expert, the tp
# slices of replicated tokens without SP, experts folded over the dense ranks and split over etp.
TP_MOE = {
    "sp": ("--parallel.ep", "1", "--parallel.sp", "true", "--model.shared_expert_intermediate_size", "0"),
    "no sp": ("--parallel.ep", "1", "--parallel.sp", "false"),
    "etp": ("--parallel.sp", "true", "--parallel.ep", "4", "--parallel.etp", "2", "--parallel.fold_ep", "true"),
}
# More layouts traced with them: name -> (recipe, overrides).
DOCUMENTS = ("--data.document_mask", "true", "--train.seq_len", "2048")
# The data-parallel modes' layout: Qwen2.5-0.5B's shapes, 4 of its 24 layers (the plan is held per rank whatever
# the depth; all 24 took 60-70 s a mode to trace, 4 take about 15; so for documents under cp, 44 s).
MODES = (
    "--model.num_hidden_layers",
    "4",
    "--parallel.dp",
    "2",
    "--parallel.cp",
    "2",
    "--parallel.tp",
    "2",
    "--parallel.microbatches",
    "4",
    "--train.seq_len",
    "1024",
)
VARIANTS = {
    "0.5B documents": ("qwen2p5_0p5b", DOCUMENTS),
    "0.5B documents cp2": (
        "qwen2p5_0p5b",
        (*DOCUMENTS, "--model.num_hidden_layers", "4", "--parallel.dp", "4", "--parallel.cp", "2"),
    ),
    **{f"0.5B {mode}": ("qwen2p5_0p5b", (*MODES, "--parallel.data_parallel", mode)) for mode in ("hsdp", "replicate")},
    "0.5B fsdp per step": ("qwen2p5_0p5b", (*MODES, "--parallel.fsdp_gather", "per_step")),
    "0.5B offload": ("qwen2p5_0p5b", (*MODES, "--parallel.offload", "optimizer")),
    **{
        f"MoE tp {name}": (
            "debug_moe",
            (
                "--train.dtype",
                "bfloat16",
                "--parallel.dp",
                "4",
                "--parallel.tp",
                "2",
                "--parallel.microbatches",
                "2",
                "--parallel.activation_checkpointing",
                "full",
                "--train.seq_len",
                "512",
                *more,
            ),
        )
        for name, more in TP_MOE.items()
    },
    # A small dense model at every tp, with and without SP, its first layer of two checkpointed.
    **{
        f"dense tp{tp}{' sp' if sp else ''}": (
            "debug_dense",
            (
                "--model.num_hidden_layers",
                "2",
                "--parallel.tp",
                str(tp),
                "--parallel.sp",
                str(sp).lower(),
                "--parallel.activation_checkpointing",
                "selective",
            ),
        )
        for tp in (1, 2, 4, 8)
        for sp in (False, True)
        if tp > 1 or not sp
    },
    # FP8 (tensorwise) on 4 layers of real shapes: Qwen2.5-7B at the recipe's dp 2 x tp 4 + SP (FP8 casts on
    # split linears) and at dp 8 (weights all-gathered in float8); Qwen2-57B-A14B at its dp 4 x ep 8 with
    # an expert width (2568) FP8 leaves in bf16, the experts' emulated FP8 GEMM having no bf16 shape check.
    **{
        f"7B fp8 {name}": ("qwen2p5_7b", ("--model.num_hidden_layers", "4", "--train.fp8", "tensorwise", *more))
        for name, more in (("tp4", ()), ("dp8", ("--parallel.dp", "8", "--parallel.tp", "1", "--parallel.sp", "false")))
    },
    "57B fp8": (
        "qwen2_57b_a14b",
        ("--model.num_hidden_layers", "4", "--train.fp8", "tensorwise", "--model.moe_intermediate_size", "2568"),
    ),
    # The same at tp 4 + SP with the blocks' collectives as overlapped rings (tp_overlap).
    "dense tp4 sp overlap": (
        "debug_dense",
        (
            "--model.num_hidden_layers",
            "2",
            "--parallel.tp",
            "4",
            "--parallel.sp",
            "true",
            "--parallel.tp_overlap",
            "true",
            "--parallel.activation_checkpointing",
            "selective",
        ),
    ),
}
# The dense recipes and layouts above whose FLOPs an analytic count checks: every tp with and without SP,
# and the shipped recipes' real shapes (tp 1 and, with SP, 2, 4 and 8; no and full checkpointing).
DENSE = (
    "qwen2p5_0p5b",
    "qwen2p5_1p5b",
    "qwen2p5_3b",
    "qwen2p5_14b",
    "qwen2p5_32b",
    "qwen2p5_72b",
    *(name for name in VARIANTS if name.startswith("dense tp")),
)


@pytest.fixture(scope="module")
def shipped() -> dict[str, dict]:
    """The ``--json`` report of every shipped recipe's dry run at its stated hardware and of :data:`VARIANTS`,
    two layouts at a time in this process (their ranks fork from one server that imported torch once):
    about 370 s on 2 cores. One after another they take 625 s, 480 of them the shipped recipes at full size
    (Qwen2.5-32B's 64 layers x 8 checkpointed micro-batches 188 s, 3B 91 s, 72B 56 s)."""
    from meshtron.dryrun import dry_run, report
    from meshtron.parallel.layout import validate_layout

    def run(name: str) -> dict:
        cfg, hardware = _config(name)
        validate_layout(cfg, hardware.world_size)
        traces = dry_run(cfg, hardware.world_size, hw=hardware.hardware())
        return json.loads(report(cfg, hardware.world_size, traces, as_json=True, seconds=0.0))

    names = (*SHIPPED, *VARIANTS)
    with ThreadPoolExecutor(2) as pool:
        return dict(zip(names, pool.map(run, names)))


def _config(name: str):
    """(config, recipe hardware) of a shipped recipe or of :data:`VARIANTS`, at the recipe's stated world size."""
    from meshtron.config import infer_dp, load_config
    from meshtron.plan.recipes import recipe_hardware

    recipe, overrides = VARIANTS.get(name, (name, ()))
    hardware = recipe_hardware(ROOT / "recipes" / f"{recipe}.toml")
    return infer_dp(load_config(ROOT / "recipes" / f"{recipe}.toml", list(overrides)), hardware.world_size), hardware


def _dry_run(capsys, *args: str) -> tuple[int, dict | None, str]:
    code = main(["--json", *args])
    out, err = capsys.readouterr()
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return code, json.loads(lines[-1]) if lines else None, err


# The scalars the planner leaves out: the loss's token count and the gradient norm's pieces, a few
# all-reduces of one number per step.
SCALAR_BYTES = 64


def _check_comm(rank: dict) -> None:
    """meshtron.plan's bytes per (collective kind, group) equal the trace's, but for the scalars."""
    for key, c in rank["comm_bytes"].items():
        assert abs(c["traced"] - c["planned"]) <= SCALAR_BYTES, (key, c, rank["comm_bytes"])


# NVIDIA's H100 SXM datasheet: dense bf16 FLOP/s, the peak every recipe's dry run is timed at.
H100_PEAK = 989e12


def _block_matmuls(m, tp: int) -> tuple[int, int]:
    """(matmul weights of a dense block on one of ``tp`` ranks, of which its down projection's): q and o
    split by head, k and v by head or, with fewer KV heads than ranks, the one head the rank's queries
    read; gate, up and down over the intermediate features."""
    heads, kv_heads = m.num_attention_heads // tp, max(m.kv_heads // tp, 1)
    down = m.hidden_size * m.intermediate_size // tp
    return m.hidden_size * m.head_size * 2 * (heads + kv_heads) + 3 * down, down


def analytic_flops(cfg) -> int:
    """FLOPs one rank of a dense model without pp or cp runs in a training step, from its shapes alone (2 per
    multiply-add). Every matmul runs once forward and twice backward (input and weight gradients) on all
    of the rank's tokens (SP gathers the sequence before q/k/v and gate/up); a checkpointed block's
    forward runs again but for its down projection, whose output nothing saves (torch's checkpoint stops
    recomputing once the saved tensors are back; with ``tp_overlap`` the down projection's ring saves its
    input only once it has run, so it runs too). Causal attention computes the S (S + 1) / 2 query-key
    pairs its mask leaves per head (the kernels skip the masked blocks): forward QK^T and PV, backward five
    products (QK^T again, dP, dV, dQ, dK), a recomputation a forward more."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    rows, layers = t.global_batch_size // p.dp, m.num_hidden_layers
    block, down = _block_matmuls(m, p.tp)
    recomputed = {"none": 0, "full": layers, "selective": len(range(0, layers, p.ac_every))}[p.activation_checkpointing]
    weights = 3 * (layers * block + m.hidden_size * m.vocab_size // p.tp) + recomputed * (
        block - down * (not p.tp_overlap)
    )
    pairs = rows * m.num_attention_heads // p.tp * t.seq_len * (t.seq_len + 1) // 2
    return 2 * (rows * t.seq_len * weights + pairs * m.head_size * (2 * (layers + recomputed) + 5 * layers))


def _check_physical_bound(cfg, report: dict) -> None:
    """The dry run's tokens/s per device within the physical bound: the peak over 6 FLOPs per matmul weight
    and token (the embedding lookup multiplies nothing)."""
    block, _ = _block_matmuls(cfg.model, 1)
    bound = H100_PEAK / (6 * (cfg.model.num_hidden_layers * block + cfg.model.hidden_size * cfg.model.vocab_size))
    speed = report["tokens_per_second_per_device"]
    assert speed <= bound, (report["layout"], speed, bound)


def _check_planner_band(cfg, hardware, report: dict) -> None:
    """The dry run's tokens/s per device between ``meshtron.plan``'s with its compute pinned at 40 % MFU
    (``Hardware.mfu``: the FLOPs at 0.4 of the peak) and that over the MFU (the roofline runs every op at the peak or
    the memory bandwidth); the rest of the step (exposed communication, bubble) is the planner's in both. Held for tp
    layouts of real shapes (1.2-1.8 x); before the trace counted DTensor ops at their local shapes they ran at
    0.62-0.95 x (Qwen2.5-32B at tp 8 the least). At tp 1 the 0.5B runs at 0.85 x: its loss's memory-bound work over
    151,936 words outweighs its 896-wide matmuls."""
    from meshtron.plan.speed import predict_step_time

    hw = dataclasses.replace(hardware.hardware(), mfu=0.4)
    planned = predict_step_time(cfg, hw).tokens_per_second / hardware.world_size
    speed = report["tokens_per_second_per_device"]
    assert planned <= speed <= planned / hw.mfu, (report["layout"], speed, planned)


@pytest.mark.full
def test_traced_flops_match_an_analytic_count(shipped):
    """Every rank's traced FLOPs within 5 % of :func:`analytic_flops` (all are within 0.1 %), on the small
    dense model at tp 1, 2, 4 and 8 with and without SP and on the shipped dense recipes; their tokens/s
    per device within the physical bound, the recipes' tp layouts within the planner's band. Counted on
    the DTensor ops, the small model's tp 8 ranks traced 5.38 x the count (2.60 x with SP); with torch's
    formulas, which count causal attention's whole S x S square, its tp 1 rank 1.10 x."""
    for name in DENSE:
        cfg, hardware = _config(name)
        expected = analytic_flops(cfg)
        for rank in shipped[name]["ranks"]:
            assert rank["flops"] == pytest.approx(expected, rel=0.05), (name, rank["flops"], expected)
        _check_physical_bound(cfg, shipped[name])
        if cfg.parallel.tp > 1 and not name.startswith("dense"):
            _check_planner_band(cfg, hardware, shipped[name])


def test_a_dry_run_assumes_posted_sends_complete():
    """A fake process group's works never report completion: without this assumption the pipeline executor
    held every boundary tensor it sent until the end of the step (0.36 GiB more at the peak of a 32
    micro-batch zbv stage of Qwen2.5-7B, 15.94 -> 15.58 GiB, growing with the micro-batch count)."""
    from meshtron.host import completed, simulated

    class Pending:
        def is_completed(self) -> bool:
            return False

    assert not completed(Pending())
    with simulated():
        assert completed(Pending())


def test_dry_run_errors_before_tracing(capsys):
    code, report, err = _dry_run(capsys, "--recipe", "recipes/qwen2p5_7b.toml", "--dry-run", "12")
    assert code == 2 and report is None
    assert err.startswith("meshtron: [parallel] pp=1 x dp=2 x cp=1 x ep=1 x tp=4 = 8, but the world size is 12."), err
    code, report, err = _dry_run(capsys, "--recipe", "recipes/debug_moe.toml", "--dry-run", "8")
    assert code == 2 and report is None
    assert "--dry-run traces MoE experts in bfloat16 only" in err and "--train.dtype bfloat16" in err, err
    code, report, err = _dry_run(
        capsys,
        "--recipe",
        "recipes/debug_moe.toml",
        "--dry-run",
        "8",
        "--train.dtype",
        "bfloat16",
        "--train.fp8",
        "tensorwise",
    )
    assert code == 2 and report is None and "fp8 = 'tensorwise' runs them through an emulated" in err, err


# What a GPU rank holds beyond a fake-tensor trace, as the planner states it (meshtron.plan.memory.Assumptions):
# 1 GiB for the CUDA context, NCCL and cuBLAS workspaces, and 5 % caching-allocator slack.
RESERVE_GIB, SLACK = 1.0, 0.05


def _assert_documented_memory(recipe: str, report: dict) -> None:
    """docs/recipes.md's GiB per rank for ``recipe`` within 5 % of its busiest traced rank plus the stated
    reserve and slack: the figure held to a measurement, not only to the planner that wrote it
    (tests/test_readme.py). Today 0.97-1.03; a planner that lost the AdamW state (8 bytes a parameter)
    would document 22.7 GiB for the 7B, 0.74 of its trace's 30.7."""
    documented = {
        unquote(row[0]).removesuffix(".toml"): float(row[-1]) for row in table_after("# Recipes", "docs/recipes.md")
    }
    traced = max(rank["traced_gib"] for rank in report["ranks"])
    assert abs(documented[recipe] / (traced * (1 + SLACK) + RESERVE_GIB) - 1) <= 0.05, (
        recipe,
        documented[recipe],
        traced,
    )


@pytest.mark.full
def test_every_shipped_recipe_matches_the_plan(shipped):
    """Every shipped recipe at its stated hardware (8 or 32 GPUs, from its header): every distinct rank within
    5 % of the plan and the bytes sent equal to it (the 57B at dp4 x ep8 was 0.935 before a checkpointed
    MoE layer's dispatch stopped counting twice)."""
    from meshtron.plan.recipes import recipe_hardware

    on_gpus = {path.stem for path in (ROOT / "recipes").glob("*.toml") if recipe_hardware(path).device == "cuda"}
    # The 72B and 57B-A14B fine-tuning recipes keep their optimizer state in host memory, which a CPU trace
    # cannot tell from the device's: its host bytes are traced on "0.5B offload"
    # (test_offload_host_bytes_match_the_plan).
    assert on_gpus == {*SHIPPED, "qwen2p5_7b", "qwen2p5_72b_8gpu", "qwen2_57b_a14b_8gpu"}, on_gpus
    for recipe in SHIPPED:
        cfg, _ = _config(recipe)
        for rank in shipped[recipe]["ranks"]:
            assert 0.95 <= rank["ratio"] <= 1.05, (recipe, rank)
            _check_comm(rank)
            _check_host_syncs(cfg, rank, "split_sizes", _moe_forwards(cfg) * shipped[recipe]["microbatches"])
        _assert_documented_memory(recipe, shipped[recipe])


def _moe_forwards(cfg) -> int:
    """Split-size reads of MoE layers per micro-batch: one per layer; a checkpointed layer's recomputation
    takes its forward's (it read them again, as many syncs more, until meshtron.host.KeptReads)."""
    return sum(cfg.model.is_moe_layer(i) for i in range(cfg.model.num_hidden_layers))


def _check_host_syncs(cfg, rank: dict, read: str, count: int) -> None:
    """The traced step's host syncs: ``count`` reads of meshtron.host's ``read`` (the dry run refuses any
    other), the number tests/test_syncs.py counts on real CPU ranks."""
    assert sum(rank["host_syncs"].values()) == count, (rank["host_syncs"], count)
    assert all(
        where.startswith("tolist at meshtron/host.py:") and where.endswith(f"in {read}") for where in rank["host_syncs"]
    ), rank["host_syncs"]


@pytest.mark.full
def test_document_masks_match_the_plan(shipped):
    """With ``[data] document_mask`` (one packed document per window, the dry run's stated assumption): without
    cp attention keeps a [B, 1, S, S] mask per layer, which the plan counts (0.977; 1.037 before it did);
    with cp the ring's host read of the documents' starts runs on the assumption."""
    for name in ("0.5B documents", "0.5B documents cp2"):
        (rank,) = shipped[name]["ranks"]
        assert 0.95 <= rank["ratio"] <= 1.05, (name, rank)
        _check_comm(rank)
        cfg, _ = _config(name)
        _check_host_syncs(cfg, rank, "document_starts", shipped[name]["microbatches"] if cfg.parallel.cp > 1 else 0)


@pytest.mark.full
def test_hsdp_and_replicate_match_the_plan(shipped):
    """Qwen2.5-0.5B (4 layers) on dp2 x cp2 x tp2 with 4 micro-batches, its data-parallel ranks HSDP (replicated
    over dp, sharded over cp) or replicated: within 5 % of the plan, the bytes equal. Their first micro-batches
    accumulate without reducing, so the warm-up runs two micro-batches: a warm-up of one left 16 DTensor
    ops the traced step met first, and the dry run stopped (``dryrun.ShapeInferences``)."""
    for mode in ("hsdp", "replicate"):
        report = shipped[f"0.5B {mode}"]
        (rank,) = report["ranks"]
        assert report["layout"] == "pp1 x dp2 x cp2 x ep1 x tp2", report["layout"]
        assert 0.95 <= rank["ratio"] <= 1.05, (mode, rank)
        _check_comm(rank)
    hsdp, replicate = (shipped[f"0.5B {mode}"]["ranks"][0]["comm_bytes"] for mode in ("hsdp", "replicate"))
    assert "all_reduce/dp" in hsdp and "all_gather+reduce_scatter/cp" in hsdp, hsdp
    assert not any(key.startswith("all_gather") for key in replicate), replicate


def _gathered_once_bytes(cfg) -> float:
    """Bytes a rank sends per step gathering (compute dtype) and reduce-scattering (fp32) the rank's tp share
    of a tied dense model once, over a ring of the data ranks: q, o, gate, up, down and the vocabulary split
    over tp, one of the k / v heads per tp rank (as many KV heads as tp ranks), the norms whole. Every dim 0
    here divides by the data ranks: no padding."""
    m, p = cfg.model, cfg.parallel
    kv = m.kv_heads // p.tp * m.head_size
    layer = (
        (2 * m.hidden_size**2 + 3 * m.hidden_size * m.intermediate_size) // p.tp
        + m.hidden_size // p.tp
        + 2 * (m.hidden_size * kv + kv)
        + 2 * m.hidden_size
    )
    elements = m.vocab_size * m.hidden_size // p.tp + m.num_hidden_layers * layer + m.hidden_size
    ranks = p.dp * p.cp
    return elements * ((2 if cfg.train.dtype == "bfloat16" else 4) + 4) * (ranks - 1) / ranks


@pytest.mark.full
def test_fsdp_gathered_once_per_step_matches_the_plan(shipped):
    """The 0.5B layout above under FSDP with ``fsdp_gather = "per_step"``: every unit held gathered and its
    gradients unsharded through the 4 micro-batches, within 5 % of the plan (traced 2.83 GiB, planned 2.81;
    gathering per micro-batch, 2.52 and 2.50), the bytes equal, and the data-parallel ones an analytic count
    of one gather and one reduce-scatter per step (:func:`_gathered_once_bytes`; per micro-batch the plan
    and the trace move 4.41 x as much)."""
    report = shipped["0.5B fsdp per step"]
    (rank,) = report["ranks"]
    assert 0.95 <= rank["ratio"] <= 1.05, rank
    _check_comm(rank)
    assert rank["comm_bytes"]["all_gather+reduce_scatter/dp,cp"]["traced"] == _gathered_once_bytes(
        _config("0.5B fsdp per step")[0]
    )


def _dense_parameters(m) -> int:
    """Parameters of a dense Qwen2 from its shapes: per layer q and o (hidden^2 each, q biased), k and v (one
    head-size slice per KV head, biased), gate, up and down, two norms; the embedding (tied: no separate head)
    and the final norm. Qwen2.5-0.5B's 24 layers give 494,032,768, its published count."""
    kv = m.kv_heads * m.head_size
    layer = (
        2 * m.hidden_size**2
        + m.hidden_size
        + 2 * (m.hidden_size * kv + kv)
        + 3 * m.hidden_size * m.intermediate_size
        + 2 * m.hidden_size
    )
    head = 0 if m.tie_word_embeddings else m.vocab_size * m.hidden_size
    return m.num_hidden_layers * layer + m.vocab_size * m.hidden_size + head + m.hidden_size


@pytest.mark.full
def test_offload_host_bytes_match_the_plan(shipped):
    """The 0.5B layout above with ``offload = "optimizer"``: the host bytes counted on the traced step's own
    parameter shards, gradients and AdamW state equal the planner's host state within 5 % (they agree to
    the byte but FSDP's padding), within 1 % of 16 bytes a parameter over the 8 ranks (4 data x 2 tp; norms and
    biases whole over tp are under 0.1 %) of :func:`_dense_parameters` (195,785,088 at 4 layers: 0.365 GiB); its
    peak (host and device one memory on CPU) within 5 % of the plan without offload."""
    (rank,) = shipped["0.5B offload"]["ranks"]
    assert abs(rank["host_gib"] / rank["planned_host_gib"] - 1) <= 0.05, rank
    params = _dense_parameters(_config("0.5B offload")[0].model)
    assert abs(rank["host_gib"] * 2**30 / (params * 16 / 8) - 1) <= 0.01, (rank, params)
    assert 0.95 <= rank["ratio"] <= 1.05, rank
    _check_comm(rank)


@pytest.mark.full
def test_moe_tp_traffic_matches_the_plan(shipped):
    """The tiny MoE with tp 2 and full checkpointing (:data:`TP_MOE`): the bytes sent equal the plan's. It had
    counted a dense MLP's SP gathers for routed experts, which take each rank's sequence shard as it is
    (7,340,032 bytes planned, 4,194,304 traced), not the re-gather of the experts' outputs in a recomputation
    without SP (1,064,960 and 1,589,248), and the etp exchanges as gathers where they are all-to-alls."""
    for name in TP_MOE:
        for rank in shipped[f"MoE tp {name}"]["ranks"]:
            _check_comm(rank)


@pytest.mark.full
def test_fp8_steps_match_the_plan(shipped):
    """FP8 (tensorwise) traced on real shapes (:data:`VARIANTS`' "7B fp8 tp4", "7B fp8 dp8", "57B fp8"): every
    rank within 5 % of the plan, which counts the eager float8 cast (fp32 scaled copy, fp32 clamp, float8
    result: 9 bytes an element) of a layer's widest FP8 operand in its backward and the float8 weights FSDP
    gathers at 1 byte (the dp 8 blocks' gathered bytes: half bf16's). Before those terms the traces were
    1.398, 1.174 and 0.999 x the plan. The all-gathers' bytes equal the plan's: FSDP's of float8 weights,
    SP's of float8 inputs (6 of a 7B layer's 13 tp transfers at tp 4: 28.875 GiB, where the plan said 36.75
    before it counted them). Not compared: the all-reduces of each cast's amax, a few bytes each."""
    from meshtron.plan.memory import rank_breakdown
    from meshtron.plan.parameters import Coords, unit_gathered_bytes

    for name in ("7B fp8 tp4", "7B fp8 dp8", "57B fp8"):
        for rank in shipped[name]["ranks"]:
            assert 0.95 <= rank["ratio"] <= 1.05, (name, rank)
            gathers = {key: c for key, c in rank["comm_bytes"].items() if key.startswith("all_gather")}
            _check_comm({"comm_bytes": gathers})
    (rank,) = shipped["7B fp8 tp4"]["ranks"]
    assert rank["comm_bytes"]["all_gather+reduce_scatter/tp"]["traced"] == 28.875 * 2**30, rank["comm_bytes"]
    cfg, _ = _config("7B fp8 dp8")
    bf16 = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, fp8="none"))
    gathered = unit_gathered_bytes(cfg, 0)["block.0"] / unit_gathered_bytes(bf16, 0)["block.0"]
    assert 0.5 < gathered < 0.51, gathered  # the norms and biases stay bf16
    assert rank_breakdown(cfg, Coords()).terms["activations"] > rank_breakdown(bf16, Coords()).terms["activations"]


@pytest.mark.full
def test_tp_overlap_traffic_matches_the_plan(shipped):
    """tp_overlap traced (:data:`VARIANTS`' "dense tp4 sp overlap"): the blocks' gathers and reduce-scatters
    are sends on the tp group, 3 per ring: 10 rings per layer and 4 more in the checkpointed layer's
    recomputation; the bytes per kind and group equal the plan's (the sends those of the SP collectives)."""
    (rank,) = shipped["dense tp4 sp overlap"]["ranks"]
    _check_comm(rank)
    assert rank["collectives"]["send"] == (2 * 10 + 4) * 3, rank["collectives"]
    (plain,) = shipped["dense tp4 sp"]["ranks"]
    moved = {key: c["traced"] for key, c in rank["comm_bytes"].items() if key.endswith("/tp") and "reduce/" not in key}
    assert rank["comm_bytes"]["p2p/tp"]["traced"] > 0 and "p2p/tp" not in plain["comm_bytes"]
    # Its recomputed down projection adds a ring the unoverlapped checkpoint stops before: one
    # reduce-scatter's bytes, 3 sends of a [B, S / 4, H] shard.
    cfg, _ = _config("dense tp4 sp overlap")
    shard = cfg.train.global_batch_size // cfg.parallel.dp * cfg.train.seq_len // 4 * cfg.model.hidden_size * 4
    assert sum(moved.values()) == plain["comm_bytes"]["all_gather+reduce_scatter/tp"]["traced"] + 3 * shard, moved


def test_dry_run_recipe_and_refusal(capsys):
    """Qwen2.5-7B at its stated 8-GPU layout (dp2 x tp4, SP, full AC): within 5 % of the plan, the bytes
    equal, the documented memory within 5 % of the trace, the FLOPs the analytic count's (1,814 TFLOP;
    3,340 while DTensor ops counted at global shapes), the speed within the physical bound; at 20 GiB per
    device the same report is followed by the pre-flight refusal (exit 2)."""
    code, report, err = _dry_run(capsys, "--recipe", "recipes/qwen2p5_7b.toml", "--dry-run", "8", "--gpu-memory", "20")
    assert code == 2 and err.startswith("meshtron: this layout needs a predicted 30.1 GiB per rank"), err
    assert "(--gpu-memory 20)" in err and "A layout predicted to fit" in err, err
    (rank,) = report["ranks"]
    assert report["world_size"] == 8 and report["layout"] == "pp1 x dp2 x cp1 x ep1 x tp4"
    assert rank["coords"] == dict(pp=0, dp=0, cp=0, ep=0, tp=0)
    assert 0.95 <= rank["ratio"] <= 1.05, rank
    # FSDP gathers every block twice (forward, and again for the checkpointed recomputation) and
    # reduce-scatters its gradients once; SP gathers and reduce-scatters inside every block.
    for op in ("_allgather_base_", "_reduce_scatter_base_", "all_gather_into_tensor", "reduce_scatter_tensor"):
        assert rank["collectives"].get(op, 0) > 0, (op, rank["collectives"])
    assert set(rank["comm_bytes"]) >= {"all_gather+reduce_scatter/tp", "all_gather+reduce_scatter/dp"}
    _check_comm(rank)
    cfg, hardware = _config("qwen2p5_7b")
    assert rank["flops"] == pytest.approx(analytic_flops(cfg), rel=0.05), (rank["flops"], analytic_flops(cfg))
    _check_physical_bound(cfg, report)
    _check_planner_band(cfg, hardware, report)
    _assert_documented_memory("qwen2p5_7b", report)
    # The throughput is the step's tokens over the step time per device.
    assert report["tokens_per_second_per_device"] == pytest.approx(64 * 4096 / rank["step_seconds"] / 8, rel=1e-3)


@pytest.mark.full
def test_dry_run_pipeline_stages_match_the_plan(capsys):
    """Qwen2.5-7B on pp2 x dp2 x tp2 (1F1B, 4 micro-batches): both stages within 5 % of the plan (before
    the planner stopped counting sharded gradients at a 1F1B stage's peak: 0.934 and 0.870)."""
    code, report, err = _dry_run(
        capsys,
        "--recipe",
        "recipes/qwen2p5_7b.toml",
        "--dry-run",
        "8",
        "--parallel.pp",
        "2",
        "--parallel.dp",
        "2",
        "--parallel.tp",
        "2",
        "--parallel.microbatches",
        "4",
    )
    assert code == 0, err
    assert [r["coords"]["pp"] for r in report["ranks"]] == [0, 1]
    for rank in report["ranks"]:
        assert 0.95 <= rank["ratio"] <= 1.05, rank
        _check_comm(rank)


@pytest.mark.full
@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_dry_run_interleaved_and_zero_bubble_stages_match_the_plan(capsys, schedule):
    """Qwen2.5-7B on pp2 x dp2 x tp2, 4 micro-batches, two chunks per rank, no checkpointing (~150 GiB:
    checked against 200 GiB devices so the pre-flight lets it through): interleaved
    (the last stage on rank 1) and zbv (a split backward's W deferred, both ends on rank 0) within 5 % of
    the plan at both stages (before each in-flight micro-batch was weighed by its own stage and sharded
    gradients counted only after a release: interleaved 0.960 and 0.928, zbv 0.930 and 0.974). Their bytes
    sent equal the plan's: zbv's B and W share one backward's tp transfers (rank 0 sent 80.80 GB over tp
    while each W repeated SP's column-parallel backward, 67.65 since)."""
    code, report, err = _dry_run(
        capsys,
        "--recipe",
        "recipes/qwen2p5_7b.toml",
        "--dry-run",
        "8",
        "--parallel.pp",
        "2",
        "--parallel.dp",
        "2",
        "--parallel.tp",
        "2",
        "--parallel.microbatches",
        "4",
        "--parallel.schedule",
        schedule,
        "--parallel.virtual_stages",
        "2",
        "--parallel.activation_checkpointing",
        "none",
        "--gpu-memory",
        "200",
    )
    assert code == 0, err
    assert [r["coords"]["pp"] for r in report["ranks"]] == [0, 1]
    for rank in report["ranks"]:
        assert 0.95 <= rank["ratio"] <= 1.05, rank
        _check_comm(rank)


@pytest.mark.full
def test_a_restarted_w_holds_its_chunks_weight_gradients(capsys):
    """Qwen2.5-0.5B on pp2 x dp4, zbv, 4 one-row micro-batches of 256 tokens, no checkpointing: rank 1 peaks in
    a restarted W, which computes its chunk's 6 layers' weight gradients in bf16 (0.167 GiB) before adding
    them to ``.grad``. The plan counts them: within 5 %, where without them it would be more than 5 % under
    (0.985 with, 1.07 without)."""
    layer = 2 * (896 * 896) + 896 + 2 * (896 * 128 + 128) + 3 * 896 * 4864 + 2 * 896  # q, o, k, v, MLP, norms
    chunk_weight_gradients = 6 * layer * 2 / 2**30
    code, report, err = _dry_run(
        capsys,
        "--recipe",
        "recipes/qwen2p5_0p5b.toml",
        "--dry-run",
        "8",
        "--parallel.pp",
        "2",
        "--parallel.virtual_stages",
        "2",
        "--parallel.dp",
        "4",
        "--parallel.schedule",
        "zbv",
        "--parallel.activation_checkpointing",
        "none",
        "--parallel.microbatches",
        "4",
        "--train.global_batch_size",
        "16",
        "--train.seq_len",
        "256",
    )
    assert code == 0, err
    for rank in report["ranks"]:
        assert 0.95 <= rank["ratio"] <= 1.05, rank
        _check_comm(rank)
    stage = report["ranks"][1]
    assert stage["traced_gib"] - (stage["planned_gib"] - chunk_weight_gradients) > 0.05 * stage["traced_gib"], stage


@pytest.mark.full
def test_dry_run_72b_interleaved_stages_match_the_plan(capsys):
    """Qwen2.5-72B on 64 ranks, pp4 x dp4 x tp4, interleaved (2 chunks per rank), 4 micro-batches, full
    checkpointing: every stage within 5 % of the plan (0.754-0.787 while the planner kept both chunks'
    fp32 gradients and gathered parameters live at once, where each chunk has its own span). The recipe's
    ``microbatches = 0`` takes 4, the fewest the schedule runs (its 1 would be refused for 4 stages)."""
    code, report, err = _dry_run(
        capsys,
        "--recipe",
        "recipes/qwen2p5_72b.toml",
        "--dry-run",
        "64",
        "--parallel.pp",
        "4",
        "--parallel.dp",
        "4",
        "--parallel.tp",
        "4",
        "--parallel.schedule",
        "interleaved",
        "--parallel.virtual_stages",
        "2",
    )
    assert code == 0, err
    assert report["microbatches"] == 4
    assert [r["coords"]["pp"] for r in report["ranks"]] == [0, 1, 2, 3]
    for rank in report["ranks"]:
        assert 0.95 <= rank["ratio"] <= 1.05, rank


@pytest.mark.full
def test_dry_run_moe_recipe_ep_traffic(shipped):
    """Qwen1.5-MoE-A2.7B at its stated layout (dp2 x ep4, full AC): its checkpointed MoE layers dispatch and
    combine again in their recomputation, and the plan counts it (it said 72 GiB where the trace sends 108)."""
    (rank,) = shipped["qwen1p5_moe_a2p7b"]["ranks"]
    sent = rank["comm_bytes"]["all_to_all/ep"]
    assert sent["traced"] == sent["planned"] and sent["traced"] > 100 * 2**30, sent


def test_distinct_ranks_add_ranks_whose_shards_differ():
    """One rank per stage, plus a rank whose uneven dim-0 shards leave it much less (72B at dp 48: the last
    rank holds 155 of 8192 rows where the others hold 171); 0.5B's emptier shards at dp 512 differ by
    8 MiB of a 4.3 GiB peak: not worth a trace."""
    from meshtron.config import load_config
    from meshtron.dryrun import distinct_ranks

    def ranks(recipe, *overrides):
        return distinct_ranks(load_config(f"recipes/{recipe}.toml", list(overrides)))

    assert ranks("qwen2p5_72b", "--parallel.dp", "48", "--parallel.tp", "1", "--train.global_batch_size", "48") == [
        0,
        47,
    ]
    assert ranks(
        "qwen2p5_72b", "--parallel.pp", "4", "--parallel.dp", "4", "--parallel.tp", "4", "--parallel.microbatches", "4"
    ) == [0, 16, 32, 48]
    assert ranks("qwen2p5_0p5b", "--parallel.dp", "512", "--parallel.tp", "2", "--train.global_batch_size", "1024") == [
        0
    ]


@pytest.mark.full
def test_every_rank_traces_in_a_fresh_process(capsys):
    """Ten pipeline stages of a tiny model with tp 2 on 2 CPUs: a pool's task is a chunk of ranks, and a
    rank traced in the process of the one before found that one's groups gone ("Could not resolve the
    process group") until each chunk held one rank."""
    code, report, err = _dry_run(
        capsys,
        "--recipe",
        "recipes/debug_dense.toml",
        "--dry-run",
        "20",
        "--parallel.pp",
        "10",
        "--parallel.dp",
        "1",
        "--parallel.tp",
        "2",
        "--model.num_hidden_layers",
        "10",
        "--parallel.microbatches",
        "10",
        "--train.global_batch_size",
        "10",
    )
    assert code == 0, err
    assert [r["rank"] for r in report["ranks"]] == list(range(0, 20, 2)), report["ranks"]


@pytest.mark.full
def test_dry_run_1024_ranks(capsys):
    """Qwen2.5-0.5B on 1024 ranks (dp 512 x tp 2): one distinct rank, within 5 % of the plan."""
    code, report, err = _dry_run(
        capsys,
        "--recipe",
        "recipes/qwen2p5_0p5b.toml",
        "--dry-run",
        "1024",
        "--parallel.dp",
        "512",
        "--parallel.tp",
        "2",
        "--train.global_batch_size",
        "1024",
    )
    assert code == 0, err
    (rank,) = report["ranks"]
    assert report["world_size"] == 1024 and 0.95 <= rank["ratio"] <= 1.05, rank
    _check_comm(rank)


# Qwen2.5-7B on 1024 ranks, dp 256 x tp 4: a state of 0.1 GiB a rank, where the backward peaks in its first
# layer, beside the LM head's reduce-scatter input. Its report (the dry run's --json) was written by
#   python -m meshtron.train --recipe recipes/qwen2p5_7b.toml --dry-run 1024 --parallel.dp 256
#       --parallel.tp 4 --train.global_batch_size 1024 --json
# (33-140 s here); the test reads the traced peaks, not the planned figures stored beside them.
TRACED_1024 = ROOT / "benchmarks" / "results" / "dry_run_1024_7b.json"
LAYOUT_1024 = ("--parallel.dp", "256", "--parallel.tp", "4", "--train.global_batch_size", "1024")


def test_plan_holds_to_the_stored_1024_rank_7b_trace():
    """Every traced rank of the stored 7B report within 5 % or 0.1 GiB of today's plan for it (the plan
    said 0.894-0.903 of the trace until it counted the head's reduce-scatter input, 0.29 GiB more than a
    layer's), and the dry run would still trace those ranks."""
    from meshtron.config import load_config
    from meshtron.dryrun import TRACE_ASSUMPTIONS, distinct_ranks
    from meshtron.plan.memory import GIB, rank_breakdown
    from meshtron.plan.parameters import Coords

    cfg = load_config(ROOT / "recipes" / "qwen2p5_7b.toml", list(LAYOUT_1024))
    report = json.loads(TRACED_1024.read_text())
    for rank in report["ranks"]:
        planned = rank_breakdown(cfg, Coords(**rank["coords"]), TRACE_ASSUMPTIONS).total / GIB
        assert abs(rank["traced_gib"] - planned) <= max(0.05 * planned, 0.1), (
            rank["rank"],
            rank["traced_gib"],
            planned,
        )
    assert [r["rank"] for r in report["ranks"]] == distinct_ranks(cfg), report["ranks"]


def test_dry_run_pipeline_moe_and_hf_folder(capsys, tmp_path):
    """A pipeline (one traced rank per stage, p2p counted), MoE expert dispatch under balanced routing with
    tp 2 and SP (the routers' partial gradients all-reduced over tp in each backward, in bf16: the plan
    had counted them once in fp32, as the norms' are with pp > 1), a tied embedding's gradient summed
    between the pipeline's ends, and a transformers folder holding nothing but config.json."""
    import transformers

    moe = (
        "--recipe",
        "recipes/debug_moe.toml",
        "--dry-run",
        "16",
        "--train.dtype",
        "bfloat16",
        "--parallel.pp",
        "2",
        "--parallel.dp",
        "0",
        "--parallel.ep",
        "4",
        "--parallel.tp",
        "2",
        "--parallel.sp",
        "true",
        "--parallel.microbatches",
        "4",
        "--train.seq_len",
        "2048",
    )
    code, report, err = _dry_run(capsys, *moe)
    assert code == 0, err
    assert [r["coords"]["pp"] for r in report["ranks"]] == [0, 1] and [r["rank"] for r in report["ranks"]] == [0, 8]
    for rank in report["ranks"]:
        # 1F1B with 4 micro-batches: each stage sends 4 activations or 4 gradients and receives as many.
        assert rank["collectives"]["send"] == 4 and rank["collectives"]["recv_"] == 4, rank["collectives"]
        assert rank["collectives"]["alltoall_base_"] > 0, rank["collectives"]
        _check_comm(rank)
    # A tied embedding under 1F1B: the first and last stage all-reduce its fp32 gradient shard (vocabulary 256
    # over dp 4: 64 rows of 64) once a step, which the plan left out until 2026-11-28 (0.127 GiB for the 0.5B
    # at pp 2 x dp 4).
    code, tied, err = _dry_run(
        capsys,
        "--recipe",
        "recipes/debug_dense.toml",
        "--dry-run",
        "8",
        "--parallel.pp",
        "2",
        "--parallel.dp",
        "4",
        "--parallel.tp",
        "1",
        "--parallel.schedule",
        "1f1b",
        "--parallel.microbatches",
        "2",
        "--model.tie_word_embeddings",
        "true",
    )
    assert code == 0, err
    for rank in tied["ranks"]:
        assert rank["comm_bytes"]["all_reduce/pp"]["traced"] >= 4 * 64 * 64, rank["comm_bytes"]
        _check_comm(rank)
    # Skewed routing: every rank's copies go to ep rank 0 (the traced one), which then receives, computes
    # and returns ep = 4 times the rows it would under balanced routing.
    code, skewed, err = _dry_run(capsys, *moe, "--dry-run-routing", "skewed")
    assert code == 0 and skewed["routing"] == "skewed" and report["routing"] == "balanced", err
    for even, worst in zip(report["ranks"], skewed["ranks"]):
        key = "all_to_all/ep"
        assert worst["comm_bytes"][key]["traced"] > even["comm_bytes"][key]["traced"], (even, worst)
        assert worst["traced_gib"] > even["traced_gib"], (even, worst)
    folder = tmp_path / "qwen3_moe"
    transformers.Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
    ).save_pretrained(folder)
    code, report, err = _dry_run(
        capsys,
        "--recipe",
        "recipes/debug_dense.toml",
        "--model.hf_model",
        str(folder),
        "--dry-run",
        "8",
        "--parallel.dp",
        "2",
        "--parallel.ep",
        "2",
        "--parallel.tp",
        "2",
        "--train.dtype",
        "bfloat16",
    )
    assert code == 0, err
    (rank,) = report["ranks"]
    assert rank["collectives"]["alltoall_base_"] > 0 and rank["traced_gib"] > 0, rank
    # The planner models meshtron's own blocks and FSDP units; of a transformers model, the expert dispatch.
    _check_comm(
        {
            "comm_bytes": {
                k: c for k, c in rank["comm_bytes"].items() if k in ("all_to_all/ep", "all_gather+reduce_scatter/tp")
            }
        }
    )
    # The same folder through [model] hf_model with its experts folded over the dense tp 4 x dp 2 ranks.
    code, report, err = _dry_run(
        capsys,
        "--recipe",
        "recipes/debug_dense.toml",
        "--model.hf_model",
        str(folder),
        "--dry-run",
        "8",
        "--parallel.dp",
        "2",
        "--parallel.tp",
        "4",
        "--parallel.ep",
        "4",
        "--parallel.fold_ep",
        "true",
        "--train.dtype",
        "bfloat16",
    )
    assert code == 0, err
    assert report["layout"].endswith("(experts: ep4 x etp1, folded)"), report["layout"]
    (rank,) = report["ranks"]
    assert rank["collectives"]["alltoall_base_"] > 0 and rank["traced_gib"] > 0, rank


def test_collectives_are_held_to_nccls_rules():
    """Every traced collective as ProcessGroupNCCL would take it (meshtron.dryrun.nccl_rules), on a fake process group
    of 2 ranks: a tensor off the rank's device, a dtype NCCL has no type for, ReduceOp.BAND, AVG of bools and a
    reduction of a fnuz float8 are refused naming the op, its mesh dimension and the call site; what NCCL
    takes (bf16 SUM, AVG, int64 MAX, an all-gather) passes and is counted."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshtron.dryrun import OpCounter
    from meshtron.dryrun.nccl_rules import NcclRefusal, NcclRules

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        counter = OpCounter(1e15, 1e12, NcclRules(torch.device("cpu"), {(0, 1): "dp"}))
        with counter:
            dist.all_reduce(torch.ones(4, dtype=torch.bfloat16))
            dist.all_reduce(torch.ones(4), op=dist.ReduceOp.AVG)
            dist.all_reduce(torch.ones(4, dtype=torch.int64), op=dist.ReduceOp.MAX)
            dist.all_gather_into_tensor(
                torch.empty(8, dtype=torch.float8_e4m3fn), torch.empty(4, dtype=torch.float8_e4m3fn)
            )
        assert counter.calls == {"allreduce_": 3, "_allgather_base_": 1}, counter.calls
        refused = {
            "on meta": lambda: dist.all_reduce(torch.ones(4, device="meta")),
            "torch.int16": lambda: dist.all_reduce(torch.ones(4, dtype=torch.int16)),
            "ReduceOp.BAND": lambda: dist.all_reduce(torch.ones(4, dtype=torch.int32), op=dist.ReduceOp.BAND),
            "AVG of a bool": lambda: dist.all_reduce(torch.ones(4, dtype=torch.bool), op=dist.ReduceOp.AVG),
            "float8_e5m2fnuz": lambda: dist.all_reduce(torch.ones(4).to(torch.float8_e5m2fnuz)),
        }
        for reason, call in refused.items():
            with (
                OpCounter(1e15, 1e12, NcclRules(torch.device("cpu"), {(0, 1): "dp"})),
                pytest.raises(NcclRefusal, match=reason) as refusal,
            ):
                call()
            assert "allreduce_ over dp at " in str(refusal.value) and __file__ in str(refusal.value), refusal.value
    finally:
        dist.destroy_process_group()


def test_unmatched_point_to_point_messages_are_named():
    """A send whose peer receives another shape (or nothing) is named; matched pairs and peers not traced pass."""
    from meshtron.dryrun.nccl_rules import unmatched_p2p

    send = ("send", 4, (2, 8), "torch.bfloat16")
    recv = ("recv", 0, (2, 8), "torch.bfloat16")
    assert unmatched_p2p({0: [send, ("send", 6, (1,), "torch.float32")], 4: [recv]}) == []
    (problem,) = unmatched_p2p({0: [send], 4: [("recv", 0, (2, 4), "torch.bfloat16")]})
    assert problem.startswith("rank 0 sends rank 4 1 messages"), problem


def test_an_undeclared_host_sync_is_refused(monkeypatch):
    """A ``.item()`` added to the step stops the dry run naming itself and its call site, not the fake
    tensors' bare DataDependentOutputException."""
    from meshtron import dryrun
    from meshtron.config import load_config

    def step_that_reads(runner, optimizer, ids, labels, max_grad_norm):
        loss, norm = dryrun.training_step.__wrapped__(runner, optimizer, ids, labels, max_grad_norm)
        loss.item()
        return loss, norm

    step_that_reads.__wrapped__ = dryrun.training_step
    monkeypatch.setattr(dryrun, "training_step", step_that_reads)
    cfg = load_config(ROOT / "recipes" / "debug_dense.toml", ["--parallel.dp", "2", "--model.num_hidden_layers", "1"])
    with pytest.raises(dryrun.HostSyncRefusal, match="_local_scalar_dense at .*test_dryrun.py:.* in step_that_reads"):
        dryrun.trace_rank(cfg, 2, 0)
