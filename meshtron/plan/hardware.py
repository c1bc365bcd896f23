"""The device and network figures the step-time model reads (:class:`Hardware`)."""

from __future__ import annotations

from dataclasses import dataclass

from meshtron.watch.metrics import datasheet

# NVIDIA H100 SXM datasheet (nvidia.com/en-us/data-center/h100): FP8 Tensor Core 3,958 TFLOP/s "with
# sparsity", half of it dense; twice the dense bf16 989. The H200 SXM lists the same compute.
H100_FP8_TFLOPS = 1979.0
# Recipes whose GEMMs the devices planned for (H100, H200) have no kernel for: MXFP8's block-scaled GEMM needs
# Blackwell (compute capability 10; meshtron.parallel.mxfp8.runs_mx_kernel), so elsewhere it is emulated, the
# MX values dequantized into a GEMM in the training dtype, and planned as one (the casts around it not timed).
EMULATED_FP8_RECIPES = ("mxfp8",)


# Keyword-only: CLIs build it from flags, and a field inserted later must not shift their values into
# its neighbours.
@dataclass(frozen=True, kw_only=True)
class Hardware:
    """Per-device figures (defaults: an H100 SXM node with 400 Gb/s InfiniBand per GPU). ``mfu``: None
    times compute with :mod:`meshtron.plan.gemm`'s model (each GEMM by its shape, attention as the
    kernel runs it, elementwise work at the memory bandwidth); a number pins every training FLOP
    (``flops_per_token``) at that fraction of the peak instead."""

    gpus_per_node: int = 8
    memory_gib: float = 80.0
    peak_tflops: float = datasheet("H100")[0]  # dense bf16
    memory_tbps: float = datasheet("H100")[1]
    mfu: float | None = None
    fp8_peak_tflops: float = H100_FP8_TFLOPS  # dense FP8, the GEMMs of [train] fp8
    intra_gbps: float = 450.0  # GB/s per direction per GPU inside a node (NVLink)
    inter_gbps: float = 50.0  # GB/s per GPU between nodes
    # Host offload ([parallel] offload, offload_activations). The host link: PCIe Gen5 x16 per H100 is
    # 64 GB/s per direction nominal, about 50 in practice (a GH200's NVLink-C2C: 450). Host memory: a DGX
    # H100's 2 TiB; its two Xeon 8480C read DDR5-4800 over 16 channels, 614 GB/s nominal, 77 per GPU's
    # share of a node of 8, of which a fused AdamW on the host reaches about half (assumed, not measured).
    host_link_gbps: float = 50.0  # GB/s per direction per GPU between host and device
    host_memory_gib: float = 2048.0  # host memory per node
    host_memory_gbps: float = 40.0  # GB/s of host memory bandwidth one rank's optimizer step reaches


H200 = Hardware(memory_gib=141.0, memory_tbps=datasheet("H200")[1])

__all__ = ["EMULATED_FP8_RECIPES", "H100_FP8_TFLOPS", "H200", "Hardware"]
