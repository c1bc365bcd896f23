"""The dry run on fake CUDA devices over the shipped recipes and one layout of each parallelism
(issue 44's coverage): run by benchmarks/cuda_dry_run.sh with a CUDA build of torch.

Per case and distinct rank: the traced peak on the fake GPU (and on the host apart), the CPU dry run's
peak for the same rank (benchmarks/results/dry_run.json, shipped recipes), the planner's figure for the
rank, the host syncs of the traced step and its collectives by kind, every one checked against NCCL's
rules; a case that fails is listed with its error's last line.

    MESHTRON_DEVICE=cuda PYTHONPATH=. V/bin/python benchmarks/cuda_dry_run.py [NAME ...]

Writes benchmarks/results/cuda_dry_run.json (merged by case name) and cuda_dry_run.md.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshtron.config import ConfigError, infer_dp, load_config  # noqa: E402
from meshtron.dryrun import TRACE_ASSUMPTIONS, _check_traceable, dry_run, layout_text  # noqa: E402
from meshtron.hf.runner import with_hf_model  # noqa: E402
from meshtron.parallel.layout import validate_layout  # noqa: E402
from meshtron.plan.memory import GIB, rank_breakdown  # noqa: E402
from meshtron.plan.parameters import Coords  # noqa: E402
from meshtron.plan.recipes import recipe_hardware  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SHIPPED = (
    "qwen2p5_0p5b",
    "qwen2p5_1p5b",
    "qwen2p5_3b",
    "qwen2p5_7b",
    "qwen2p5_14b",
    "qwen2p5_32b",
    "qwen2p5_72b",
    "qwen2p5_72b_8gpu",
    "qwen1p5_moe_a2p7b",
    "qwen2_57b_a14b",
    "qwen2_57b_a14b_8gpu",
)
_SMALL = ["--train.seq_len", "1024", "--train.global_batch_size", "16"]
# recipes/qwen2p5_72b_8gpu.toml's layout until 2026-11-28 (its header says why it changed).
OFFLOAD_72B_EARLIER = (
    "--parallel.dp",
    "4",
    "--parallel.cp",
    "2",
    "--parallel.activation_checkpointing",
    "selective",
    "--parallel.microbatches",
    "8",
)
# name -> (recipe, world size, overrides): one layout of each parallelism the recipes do not state.
LAYOUTS = {
    "pp zbv": (
        "qwen2p5_0p5b",
        8,
        [
            "--parallel.pp",
            "2",
            "--parallel.dp",
            "4",
            "--parallel.schedule",
            "zbv",
            "--parallel.virtual_stages",
            "2",
            "--parallel.microbatches",
            "4",
            *_SMALL,
        ],
    ),
    "cp p2p documents": (
        "qwen2p5_0p5b",
        8,
        [
            "--parallel.dp",
            "2",
            "--parallel.cp",
            "2",
            "--parallel.tp",
            "2",
            "--parallel.sp",
            "true",
            "--parallel.cp_comm_type",
            "p2p",
            "--data.document_mask",
            "true",
            *_SMALL,
        ],
    ),
    "cp a2a": (
        "qwen2p5_0p5b",
        8,
        ["--parallel.dp", "4", "--parallel.cp", "2", "--parallel.cp_comm_type", "a2a", *_SMALL],
    ),
    "folded ep x etp": (
        "debug_moe",
        8,
        [
            "--train.dtype",
            "bfloat16",
            "--parallel.dp",
            "4",
            "--parallel.tp",
            "2",
            "--parallel.sp",
            "true",
            "--parallel.ep",
            "4",
            "--parallel.etp",
            "2",
            "--parallel.fold_ep",
            "true",
            "--parallel.microbatches",
            "2",
            "--train.seq_len",
            "512",
        ],
    ),
    "hsdp": (
        "qwen2p5_0p5b",
        8,
        [
            "--parallel.dp",
            "2",
            "--parallel.cp",
            "2",
            "--parallel.tp",
            "2",
            "--parallel.data_parallel",
            "hsdp",
            "--parallel.microbatches",
            "4",
            *_SMALL,
        ],
    ),
    # The levers, each on a real-size recipe at its stated layout (compile: refused, meshtron.dryrun.COMPILE_REFUSAL).
    # The 72B offload recipe's earlier layout (dp 4 x cp 2, selective AC) at 8 micro-batches, whose later ones
    # accumulate their gradients on the host blocking (1,770 s to trace here), and at one.
    "72b 8gpu offload, 8 micro-batches": ("qwen2p5_72b_8gpu", 8, list(OFFLOAD_72B_EARLIER)),
    "72b 8gpu offload, 1 micro-batch": (
        "qwen2p5_72b_8gpu",
        8,
        [*OFFLOAD_72B_EARLIER, "--parallel.microbatches", "1", "--train.global_batch_size", "4"],
    ),
    "72b 8gpu op recompute, 1 micro-batch": (
        "qwen2p5_72b_8gpu",
        8,
        [
            *OFFLOAD_72B_EARLIER,
            "--parallel.activation_checkpointing",
            "op",
            "--parallel.microbatches",
            "1",
            "--train.global_batch_size",
            "4",
        ],
    ),
    "7b op recompute": ("qwen2p5_7b", 8, ["--parallel.activation_checkpointing", "op"]),
    "7b fp8 tensorwise": ("qwen2p5_7b", 8, ["--train.fp8", "tensorwise"]),
    # SP's rings overlapped with their float8 GEMMs (operands cast whole, float8 rows sent point-to-point).
    "7b fp8 tp_overlap": ("qwen2p5_7b", 8, ["--train.fp8", "rowwise_with_gw_hp", "--parallel.tp_overlap", "true"]),
    # MXFP8 on an H100 (fake CUDA's compute capability 9: no MX GEMM), so emulated: MX casts, dequantized operands.
    "7b mxfp8": ("qwen2p5_7b", 8, ["--train.fp8", "mxfp8"]),
    # The experts' float8 GEMMs through torch._scaled_grouped_mm (fake CUDA: an H100's compute capability).
    "57b fp8 rowwise": ("qwen2_57b_a14b", 32, ["--train.fp8", "rowwise"]),
    "7b activation offload": (
        "qwen2p5_7b",
        8,
        ["--parallel.activation_checkpointing", "selective", "--parallel.offload_activations", "true"],
    ),
    # Both offloads under a pipeline (1F1B, the 0.5B's tied embedding summed across the two stages from the host).
    "pp offload": (
        "qwen2p5_0p5b",
        8,
        [
            "--parallel.pp",
            "2",
            "--parallel.dp",
            "4",
            "--parallel.schedule",
            "1f1b",
            "--parallel.microbatches",
            "4",
            "--parallel.offload",
            "optimizer",
            "--parallel.offload_activations",
            "true",
        ],
    ),
    "0.5b compile": ("qwen2p5_0p5b", 8, ["--parallel.compile", "true"]),
    "hf model": (
        "debug_dense",
        4,
        ["--model.hf_model", "{hf}", "--parallel.dp", "2", "--parallel.tp", "2", "--train.seq_len", "256"],
    ),
    # Qwen2.5-0.5B's shapes as a transformers model, at the 0.5B recipe's layout and at tp 2 + SP.
    "hf model 0.5B": ("qwen2p5_0p5b", 8, ["--model.hf_model", "{hf 0.5B}"]),
    "hf model 0.5B tp2 sp": (
        "qwen2p5_0p5b",
        8,
        ["--model.hf_model", "{hf 0.5B}", "--parallel.dp", "4", "--parallel.tp", "2", "--parallel.sp", "true"],
    ),
}


# The transformers Qwen2 configs of the hf cases (config.json is all a dry run reads).
HF_SIZES = {
    "{hf}": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "{hf 0.5B}": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        rms_norm_eps=1e-06,
    ),
}


def _hf_folder(size: str) -> str:
    import tempfile

    import transformers

    folder = Path(tempfile.mkdtemp()) / "qwen2"
    transformers.Qwen2Config(**HF_SIZES[size]).save_pretrained(folder)
    return str(folder)


def _case(name: str):
    """(config, world size, recipe hardware) of a case."""
    recipe, world, overrides = LAYOUTS.get(name, (name, None, []))
    overrides = [_hf_folder(value) if value in HF_SIZES else value for value in overrides]
    path = ROOT / "recipes" / f"{recipe}.toml"
    hardware = recipe_hardware(path)
    world = world or hardware.world_size
    return with_hf_model(infer_dp(load_config(path, overrides), world)), world, hardware


def replan(rows: list[dict]) -> None:
    """The stored traces' planned GiB and ratio from today's planner (the traces stay as traced)."""
    if not rows or "traced_gib" not in rows[0]:
        return
    cfg = _case(rows[0]["case"])[0]
    for row in rows:
        row["planned_gib"] = rank_breakdown(cfg, Coords(**row["coords"]), TRACE_ASSUMPTIONS).total / GIB
        row["ratio"] = row["traced_gib"] / row["planned_gib"]


def measure(name: str) -> list[dict]:
    cfg, world, hardware = _case(name)
    validate_layout(cfg, world)
    _check_traceable(cfg)
    start = time.perf_counter()
    traces = dry_run(cfg, world, hw=hardware.hardware(), per_node=hardware.per_node)
    seconds = time.perf_counter() - start
    cpu = _cpu_traces(name) if name in SHIPPED else {}
    return [
        {
            "case": name,
            "world_size": world,
            "layout": layout_text(cfg),
            "levers": levers(cfg),
            "rank": t.rank,
            "coords": t.coords,
            "pp": t.coords["pp"],
            "host_gib": t.host_gib,
            "planned_host_gib": t.planned_host_gib,
            "traced_gib": t.traced_gib,
            "host_peak_gib": t.host_peak_gib,
            "cpu_gib": cpu.get(t.rank),
            "planned_gib": t.planned_gib,
            "ratio": t.ratio,
            "syncs": t.syncs,
            "collectives": t.collectives,
            "seconds": seconds,
        }
        for t in traces
    ]


def levers(cfg) -> str:
    """The recipe's memory and speed levers: activation checkpointing, compile, fp8, tp_overlap, host offload."""
    p = cfg.parallel
    out = [
        f"ac {p.activation_checkpointing}"
        + (f"/{p.ac_every}" if p.activation_checkpointing == "selective" else "")
        + (f" {p.ac_policy}" if p.activation_checkpointing == "op" else "")
    ]
    out += ["compile"] if p.compile else []
    out += [f"fp8 {cfg.train.fp8}"] if cfg.train.fp8 != "none" else []
    out += ["tp_overlap"] if p.tp_overlap and p.sp and p.tp > 1 else []
    out += [f"offload {p.offload}"] if p.offload != "none" else []
    out += ["offload activations"] if p.offload_activations else []
    return ", ".join(out)


def _cpu_traces(recipe: str) -> dict[int, float]:
    """Rank -> traced peak GiB of the CPU dry run of ``recipe`` at its stated layout (benchmarks/dry_run_recipes.py)."""
    rows = json.loads((RESULTS / "dry_run.json").read_text())
    return {r["rank"]: r["traced_gib"] for r in rows if r["recipe"] == recipe and not r["overrides"]}


def _kinds(collectives: dict[str, int]) -> str:
    return ", ".join(f"{op} {n}" for op, n in sorted(collectives.items()))


def _syncs(syncs) -> str:
    if syncs is None:
        return "not counted"
    return ", ".join(f"{n} x {where}" for where, n in syncs.items()) or "0"


def _gib(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def table(rows: list[dict]) -> str:
    lines = [
        "| case | ranks | layout | levers | rank (stage) | GPU GiB (traced on CUDA) | host GiB at peak "
        "| offload host GiB traced / planned | CPU dry run GiB | planned GiB "
        "| GPU / planned | host syncs per step | collectives checked | collectives by op | dry run s |",
        "|---" * 15 + "|",
    ]
    for r in rows:
        if "error" in r or "refused" in r:
            what = f"refused: {r['refused']}" if "refused" in r else f"FAILED: {r['error']}"
            lines.append(f"| {r['case']} | | | | | | | | | | | | | {what} | |")
            continue
        offload = f"{r['host_gib']:.2f} / {r['planned_host_gib']:.2f}" if r.get("planned_host_gib") else ""
        lines.append(
            f"| {r['case']} | {r['world_size']} | {r['layout']} | {r.get('levers', '')} | {r['rank']} ({r['pp']}) "
            f"| {r['traced_gib']:.2f} | {_gib(r.get('host_peak_gib'), 4)} | {offload} | {_gib(r.get('cpu_gib'))} "
            f"| {r['planned_gib']:.2f} | {r['ratio']:.3f} "
            f"| {_syncs(r['syncs'])} | {sum(r['collectives'].values())} | {_kinds(r['collectives'])} "
            f"| {r['seconds']:.0f} |"
        )
    return "\n".join(lines)


def _error_line(text: str) -> str:
    """The line of a rank's traceback that says what failed: its last ``...Error: ...`` line."""
    lines = [line for line in text.strip().splitlines() if "Error: " in line or "Refusal: " in line]
    return (lines or text.strip().splitlines())[-1].strip()[:300]


def main(names: list[str]) -> None:
    """Runs the named cases (all by default; ``--table``: none; ``--replan``: none, the stored traces set
    against today's planner) and writes the table of every stored one."""
    assert os.environ.get("MESHTRON_DEVICE") == "cuda", "run with MESHTRON_DEVICE=cuda (benchmarks/cuda_dry_run.sh)"
    store = RESULTS / "cuda_dry_run.json"
    results = json.loads(store.read_text()) if store.exists() else {}
    if names == ["--replan"]:
        for name, rows in results.items():
            try:
                replan(rows)
            except ConfigError as err:  # an extra this environment lacks (torchao for fp8): rows kept as stored
                print(f"{name}: kept as stored: {err}", flush=True)
        store.write_text(json.dumps(results, indent=1) + "\n")
    for name in [] if names in (["--table"], ["--replan"]) else names or [*SHIPPED, *LAYOUTS]:
        try:
            results[name] = measure(name)
        except ConfigError as err:  # what the dry run refuses to trace, in its one line
            results[name] = [{"case": name, "refused": str(err)}]
        except Exception as err:  # noqa: BLE001 - listed in the table, the next case still runs
            traceback.print_exc()
            results[name] = [{"case": name, "error": _error_line(str(err))}]
        print(table(results[name]), flush=True)
        store.write_text(json.dumps(results, indent=1) + "\n")
    order = [*SHIPPED, *LAYOUTS]
    rows = [
        row
        for name in sorted(results, key=lambda n: order.index(n) if n in order else len(order))
        for row in results[name]
    ]
    (RESULTS / "cuda_dry_run.md").write_text(
        "# The dry run on fake CUDA devices\n\n"
        "`benchmarks/cuda_dry_run.sh` (torch 2.14.1+cu130 in a separate environment, no GPU): every shipped recipe "
        "at its stated hardware, one layout of each parallelism and each lever (op recompute, fp8, activation and "
        "optimizer offload; compile is refused, meshtron.dryrun.COMPILE_REFUSAL says why), each distinct rank on fake "
        "`cuda:LOCAL_RANK` (meshtron/dryrun/fake_cuda.py). GPU GiB: the traced step's peak on the rank's fake GPU; "
        "host GiB "
        "at peak: the peak of what the step holds on the host, counted apart; offload host GiB: what "
        '`[parallel] offload = "optimizer"` keeps on the host after the step (each parameter\'s fp32 shard, its '
        "gradient, AdamW's moments), counted on the step's objects, against meshtron.plan's host figure; CPU dry run "
        "GiB: the same rank traced on the CPU path (benchmarks/results/dry_run.json). "
        "Planned: meshtron.plan's figure for the rank without its reserve and slack (of a transformers model: "
        "meshtron's own block model, and the model's head and loss, meshtron.hf.loss: its logits and their gradient). "
        "Every collective passed NCCL's rules (meshtron/dryrun/nccl_rules.py) and every host sync is one "
        "meshtron/host.py "
        "declares: the dry run stops otherwise. Host syncs per step: the reads a real step makes there (the dry "
        "run answers them with its assumption). Dry run s: wall time on a 2-core machine shared with other jobs "
        "(load average 10-220 while these ran).\n\n"
        "Planned figures: today's planner on the stored traces (`--replan`). The levers (2026-11-26): optimizer "
        "offload traces with the host's state equal to the plan's and the GPU at 1.001 x the plan (72B at the "
        "recipe's earlier layout, dp 4 x cp 2 with selective recompute, at 8 micro-batches and one; 1.054 until the "
        "plan counted FSDP2's last all-gather output, the LM head's, held "
        "through the loss: 2.32 GiB at tp 1); each micro-batch after the first "
        "reduce-scatters into gradients already on the host, which FSDP2 copies blocking and adds on the host: "
        "7 x 963 waits a step, declared (meshtron.host.TORCH_WAITS) and costed exposed by meshtron.plan (2026-11-28). "
        "The recipe now runs the search's pick, dp 8 with full recompute and one micro-batch (23.1 s a step "
        "predicted against 50.2): GPU 0.956 x the plan. "
        "Activation offload: GPU 1.023 x the plan (7B), its host peak 102.6 GiB against the plan's 99.4 GiB of "
        "offloaded activations (114.9 until a tensor several ops save was copied to the host once). fp8 tensorwise: "
        "GPU 1.210 x the plan of that day, which had no fp8 term (today's "
        "plan counts the float8 casts: 1.028, tests/test_cuda_dryrun.py). Op recompute "
        "(save_matmuls) traces under torch 2.14: FSDP2's hooks run outside selective checkpointing's record of the "
        "block's ops (meshtron.parallel.recompute.hooks_outside_op_record; the failure this table showed until "
        "2026-11-28 was traced before that fix): 7B GPU 1.008 x the plan, 72B with optimizer offload 1.028 x. compile: "
        "refused (meshtron.dryrun.COMPILE_REFUSAL). "
        "Transformers models (2026-11-28): Qwen2.5-0.5B's shapes as a transformers Qwen2 traced 71.65 GiB at dp 8 and "
        "77.38 at dp 4 x tp 2 + SP against a plan of 46.40 and 45.50 that counted meshtron's fused head and loss; the "
        "traces also built a packed-sequence mask for every attention (transformers takes fake tensors for a traced "
        "graph and skips its device read), which a real step does not build: the runner now answers that read itself "
        "(meshtron.hf.pipeline.whole_sequences, one host sync per micro-batch fewer on a GPU) and the plan counts the "
        "head's logits and their gradient: 63.40 traced against 64.48 planned, 65.38 against 63.81. "
        "qwen2_57b_a14b_8gpu (optimizer offload, op recompute, folded ep 2): GPU 1.031 x the plan, host = plan.\n\n"
        + table(rows)
        + "\n"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
