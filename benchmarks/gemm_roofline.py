"""The planner's GEMM-size compute model (``meshtron.plan.gemm``) against GEMMs timed on this device.

The planner times a step from its GEMMs at their sharded shapes, the flash-attention kernel and the
elementwise bytes; its kernel rates were set from published figures (``gemm.SOURCES``, the FlashAttention-3
paper's FlashAttention-2 curves), never from a run of its own. This script runs those kernels:

* every distinct forward GEMM of layer 0 and its two backward GEMMs (input and weight gradient) for the
  shipped recipes and Megatron-LM's published GPT shapes at their tensor-parallel degree, one micro-batch
  of ``--seq`` tokens, in bf16 (``torch.mm``; fp32 accumulation as cuBLAS does);
* the same forward shapes in float8 (``torch._scaled_mm``, e4m3 with tensorwise scales, bf16 output), the
  kernel ``[train] fp8`` runs;
* causal ``scaled_dot_product_attention`` (flash kernel only) forward and backward, head dim 128, at the
  sequence lengths of the published curves.

Each row gives the measured TFLOP/s, the planner's rate for the same kernel (the roofline it uses, before
``STEP_OVERHEAD``) and measured / planned. The device's peak is read from ``meshtron.watch.metrics.datasheet``;
the planner is asked for the H100 SXM's figures, so on another card the ratio includes the cards' difference.

Run on a GPU: ``PYTHONPATH=. python benchmarks/gemm_roofline.py --out benchmarks/results/gemm_roofline``
(writes ``.md`` and ``.json``); ``--fit benchmarks/results/gemm_roofline.json`` prints the constants
``meshtron.plan.gemm.FIT`` holds, fitted to that run (no GPU needed). ``--tiny`` times three small GEMMs on the CPU in
fp32 (a smoke test of the script; its ratios mean nothing, as the planner models an H100).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshtron.config import load_config  # noqa: E402
from meshtron.plan import gemm  # noqa: E402
from meshtron.plan.hardware import Hardware  # noqa: E402

# (name, recipe, overrides): the shipped Qwen2.5 shapes and Megatron-LM's published GPT rows (core_r0.8.0
# weak-scaling table: heads, hidden, tp), as benchmarks/published_speed.py builds them.
SHAPES = (
    ("qwen2.5-7b tp1", "qwen2p5_7b.toml", {"parallel.tp": 1}),
    ("qwen2.5-7b tp2", "qwen2p5_7b.toml", {"parallel.tp": 2}),
    ("qwen2.5-72b tp8", "qwen2p5_72b.toml", {"parallel.tp": 8}),
    (
        "gpt-7.1b tp2",
        "qwen2p5_7b.toml",
        {
            "model.hidden_size": 4096,
            "model.num_attention_heads": 32,
            "model.num_key_value_heads": 32,
            "model.intermediate_size": 10920,
            "parallel.tp": 2,
        },
    ),
    (
        "gpt-32b tp8",
        "qwen2p5_7b.toml",
        {
            "model.hidden_size": 8192,
            "model.num_attention_heads": 64,
            "model.num_key_value_heads": 64,
            "model.intermediate_size": 21848,
            "parallel.tp": 8,
        },
    ),
)
ATTENTION_SEQS = (1024, 2048, 4096, 8192)
HEAD_DIM = 128


def _timed(fn, iters: int) -> float:
    """Median seconds of ``fn`` over ``iters`` runs after two warm-ups (CUDA events on a GPU)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _config(recipe: str, overrides: dict, seq: int):
    sp = "true" if overrides.get("parallel.tp", 1) > 1 else "false"  # SP needs tp > 1
    args = [f"--{k}={v}" for k, v in {**overrides, "train.seq_len": seq, "parallel.sp": sp}.items()]
    return load_config(ROOT / "recipes" / recipe, args)


def distinct_gemms(seq: int) -> list[tuple[str, str, gemm.Gemm]]:
    """(model, pass, GEMM) for each distinct layer-0 GEMM shape of ``SHAPES``, forward and backward."""
    rows, seen = [], set()
    for name, recipe, overrides in SHAPES:
        for g in gemm.layer_gemms(_config(recipe, overrides, seq), 0, seq):
            for kind, shape in [("fwd", g)] + list(zip(("dgrad", "wgrad"), gemm.backward(g, False))):
                key = (shape.m, shape.n, shape.k)
                if key not in seen:
                    seen.add(key)
                    rows.append((name, kind, shape))
    return rows


def operands(g: gemm.Gemm, kind: str, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``[m, k]`` and ``[k, n]`` laid out as the training step's pass has them (cuBLAS's speed depends on the
    leading dimensions): forward ``x @ W.t()`` (W stored ``[n, k]``); input gradient ``dy @ W`` (W stored
    ``[k, n]`` here); weight gradient ``dy.t() @ x`` (dy stored ``[k, m]``: tokens first)."""

    def random(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, device=device).to(dtype)

    a = random(g.k, g.m).t() if kind == "wgrad" else random(g.m, g.k)
    b = random(g.n, g.k).t() if kind == "fwd" else random(g.k, g.n)
    return a, b


def time_gemm(g: gemm.Gemm, kind: str, device: torch.device, dtype: torch.dtype, fp8: bool, iters: int) -> float:
    a, b = operands(g, kind, device, dtype)
    if not fp8:
        return _timed(lambda: torch.mm(a, b), iters)
    scale = torch.ones((), device=device)
    a8, b8 = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()  # _scaled_mm: b column-major
    return _timed(lambda: torch._scaled_mm(a8, b8, scale, scale, out_dtype=torch.bfloat16), iters)


def time_attention(seq: int, heads: int, device: torch.device, iters: int) -> tuple[float, float]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (
        torch.randn(1, heads, seq, HEAD_DIM, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    grad = torch.randn_like(q)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        forward = _timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), iters)

        def both():
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(out, (q, k, v), grad)

        return forward, _timed(both, iters) - forward


def gemm_rows(args, device) -> list[dict]:
    out = []
    shapes = distinct_gemms(args.seq)
    if args.tiny:
        shapes = [
            ("tiny", "fwd", gemm.Gemm(256, 256, 256)),
            ("tiny", "fwd", gemm.Gemm(512, 128, 256)),
            ("tiny", "wgrad", gemm.Gemm(128, 256, 512)),
        ]
    dtypes = [("bf16", False)] + ([("fp8", True)] if device.type == "cuda" else [])
    for name, kind, g in shapes:
        for label, fp8 in dtypes:
            if fp8 and (kind != "fwd" or g.m % 16 or g.n % 16 or g.k % 16):  # _scaled_mm's rule
                continue
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
            seconds = time_gemm(g, kind, device, dtype, fp8, args.iters)
            out.append(
                {
                    "model": name,
                    "pass": kind,
                    "dtype": label,
                    "m": g.m,
                    "n": g.n,
                    "k": g.k,
                    "measured_tflops": g.flops / seconds / 1e12,
                }
            )
    return out


def _attention_flops(seq: int) -> dict[str, float]:
    forward = 4.0 * seq * seq * 32 * HEAD_DIM * gemm.causal_block_share(seq)
    return {"fwd": forward, "bwd": gemm.FLASH_BACKWARD_FLOPS * forward}


def attention_rows(args, device) -> list[dict]:
    out = []
    for seq in ATTENTION_SEQS:
        seconds = dict(zip(("fwd", "bwd"), time_attention(seq, 32, device, args.iters)))
        out += [
            {"seq": seq, "pass": kind, "measured_tflops": work / seconds[kind] / 1e12}
            for kind, work in _attention_flops(seq).items()
        ]
    return out


def with_plan(result: dict) -> dict:
    """``result``'s rows with the rate ``meshtron.plan.gemm`` gives each kernel (an H100 SXM) and the ratio."""
    hw = Hardware()
    for r in result["gemms"]:
        shape = gemm.Gemm(r["m"], r["n"], r["k"], fp8=r["dtype"] == "fp8")
        r["planned_tflops"] = shape.flops / gemm.gemm_seconds(shape, hw) / 1e12
    for r in result["attention"]:
        cfg = _config(
            "qwen2p5_7b.toml",
            {
                "parallel.tp": 1,
                "model.num_attention_heads": 32,
                "model.num_key_value_heads": 32,
                "model.hidden_size": 32 * HEAD_DIM,
            },
            r["seq"],
        )
        seconds = dict(zip(("fwd", "bwd"), gemm.attention_seconds(cfg, r["seq"], hw)))[r["pass"]]
        r["planned_tflops"] = _attention_flops(r["seq"])[r["pass"]] / seconds / 1e12
    for r in result["gemms"] + result["attention"]:
        r["ratio"] = r["measured_tflops"] / r["planned_tflops"]
    return result


TILES, SPLITS, FILLS = (128, 192, 256), (512, 1024, 2048, 4096, 8192), (128, 256, 512, 1024)


def _aligned(row: dict) -> bool:
    return gemm.aligned(row["m"], row["n"], row["k"])


def fit(gemms: list[dict]) -> gemm.KernelFit:
    """The shape constants of ``meshtron.plan.gemm`` that predict ``gemms`` (this script's JSON rows) with
    the least mean absolute log error, over a grid; for each candidate the ceilings are the median ratio of
    measured to modelled rate over the aligned GEMMs of the dtype, and the misaligned factor the median over
    the others (rounded to 2 figures: the fit is a model, not a table of the measurements)."""
    peaks = {"bf16": Hardware().peak_tflops, "fp8": Hardware().fp8_peak_tflops}

    def shape(r: dict, candidate: gemm.KernelFit) -> float:
        return r["measured_tflops"] / (peaks[r["dtype"]] * gemm.shape_efficiency(r["m"], r["n"], r["k"], fit=candidate))

    best = None
    for tile, split_k, k_fill in ((t, s, f) for t in TILES for s in SPLITS for f in FILLS):
        candidate = gemm.KernelFit(tile, split_k, k_fill, 1.0, {})
        ceiling = {
            d: round(statistics.median_high([shape(r, candidate) for r in gemms if r["dtype"] == d and _aligned(r)]), 2)
            for d in peaks
        }
        rest = [shape(r, candidate) / ceiling["bf16"] for r in gemms if r["dtype"] == "bf16" and not _aligned(r)]
        misaligned = round(statistics.median_high(rest), 2) if rest else 1.0
        candidate = candidate._replace(misaligned=misaligned, ceiling=ceiling)
        error = sum(abs(math.log(shape(r, candidate) / candidate.ceiling[r["dtype"]])) for r in gemms) / len(gemms)
        if best is None or error < best[0]:
            best = (error, candidate)
    return best[1]


def markdown(device_name: str, gemms: list[dict], attention: list[dict], seq: int) -> str:
    lines = [
        f"# The planner's kernel rates against {device_name}",
        "",
        "Written by `benchmarks/gemm_roofline.py` (its docstring says what is timed). planned: "
        "`meshtron.plan.gemm` for an H100 SXM before `STEP_OVERHEAD`; ratio = measured / planned "
        f"(above 1: the planner is pessimistic). GEMM rows: layer 0 at {seq} tokens a micro-batch.",
        "",
        "| model | pass | dtype | m | n | k | measured TFLOP/s | planned TFLOP/s | ratio |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['model']} | {r['pass']} | {r['dtype']} | {r['m']} | {r['n']} | {r['k']} | "
        f"{r['measured_tflops']:.3g} | {r['planned_tflops']:.0f} | {r['ratio']:.2f} |"
        for r in gemms
    ]
    for dtype in sorted({r["dtype"] for r in gemms}):
        ratios = sorted(r["ratio"] for r in gemms if r["dtype"] == dtype)
        lines.append(
            f"\n{dtype}: {len(ratios)} GEMMs, ratio min {ratios[0]:.2f}, median "
            f"{ratios[len(ratios) // 2]:.2f}, max {ratios[-1]:.2f}"
        )
    if attention:
        lines += [
            "",
            "| causal flash attention, 32 heads x 128 | pass | measured TFLOP/s | planned TFLOP/s | ratio |",
            "|---:|---|---:|---:|---:|",
        ]
        lines += [
            f"| seq {r['seq']} | {r['pass']} | {r['measured_tflops']:.0f} | {r['planned_tflops']:.0f} | "
            f"{r['ratio']:.2f} |"
            for r in attention
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gemm_roofline"))
    parser.add_argument("--fit", metavar="JSON", help="print the model constants fitted to a stored run; time nothing")
    parser.add_argument(
        "--replan",
        metavar="JSON",
        help="rewrite a stored run's planned rates with today's model (and its .md); time nothing",
    )
    args = parser.parse_args(argv)
    if args.fit:
        print(fit(json.loads(Path(args.fit).read_text())["gemms"]))
        return
    if args.replan:
        args.out = args.replan.removesuffix(".json")
        result = json.loads(Path(args.replan).read_text())
    else:
        device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
        result = {
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "the CPU (smoke test)",
            "torch": torch.__version__,
            "seq": args.seq,
            "gemms": gemm_rows(args, device),
            "attention": attention_rows(args, device) if device.type == "cuda" else [],
        }
    result = with_plan(result)
    text = markdown(result["device"], result["gemms"], result["attention"], result.get("seq", args.seq))
    Path(args.out + ".md").write_text(text)
    Path(args.out + ".json").write_text(json.dumps(result, indent=1))
    print(text)


if __name__ == "__main__":
    main()
