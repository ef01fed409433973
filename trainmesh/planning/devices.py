"""Facts about accelerators the cost model and MFU need (vendor dense bf16 peaks)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_gib: float
    peak_tflops: float  # dense bf16 (fp32 for the CPU entry)
    intra_node_gbps: float  # per-device bandwidth to peers in the node, GB/s
    inter_node_gbps: float  # per-device bandwidth to other nodes, GB/s
    # Memory a rank uses beyond its tensors: CUDA context, allocator slack and NCCL buffers on
    # a GPU; on a CPU rank, the process itself with Python, torch and Ray loaded (measured).
    framework_gib: float = 2.0
    # Collectives on their own CUDA streams run beside compute; a CPU rank has none: FSDP2
    # waits for each all-gather and reduce-scatter (measured), while DDP's all-reduce still
    # overlaps backward there (gloo runs it on its own thread).
    streams: bool = True
    # Per block and microbatch, forward and backward: the device's fixed cost (each kernel's
    # launch latency and tail, the small ops that never fill it) and the host's time to issue
    # the block's work (Python, autograd, FSDP2's hooks). A microbatch takes the larger of the
    # two, so small microbatches leave a GPU waiting for its host. Fitted to `1b` eager on an
    # H200 (bench/history/journal.md, "Microbatch size on a GPU", 2026-11-27: 16 blocks, microbatch 1,
    # 2, 4 and 8 of 16 sequences of 2048; bench/planner.py sets the model beside runs it was
    # not fitted to); the other GPUs assume the H200's figures (the host is a host; launch
    # latencies are close). Under model.compile the host issues fewer calls: not measured
    # apart yet, so the host figure bounds it.
    kernel_overhead_s: float = 0.78e-3
    host_dispatch_s: float = 3.8e-3
    # Dense float8 peak (0: no float8 matmuls: ``training.float8`` is refused there, or on CPU
    # emulated and not priced) and memory bandwidth (float8's casts are memory-bound), GB/s
    float8_tflops: float = 0.0
    hbm_gbps: float = 0.0
    # Whether an MoE block's experts run float8 grouped GEMMs there (``moe.float8_grouped_kind``:
    # Hopper's rowwise; Blackwell's MXFP8 only where torchao's SM100 kernels are installed,
    # so not assumed; not on Ada): elsewhere they stay bf16 under training.float8
    float8_grouped: bool = False


DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec("h100", 80, 989.0, 450.0, 50.0, float8_tflops=1979.0, hbm_gbps=3350.0,
                       float8_grouped=True),
    "h200": DeviceSpec("h200", 141, 989.0, 450.0, 50.0, float8_tflops=1979.0, hbm_gbps=4800.0,
                       float8_grouped=True),
    "a100-40gb": DeviceSpec("a100-40gb", 40, 312.0, 300.0, 25.0, hbm_gbps=1555.0),
    "a100-80gb": DeviceSpec("a100-80gb", 80, 312.0, 300.0, 25.0, hbm_gbps=2039.0),
    "b200": DeviceSpec("b200", 192, 2250.0, 900.0, 50.0, float8_tflops=4500.0, hbm_gbps=8000.0),
    "l40s": DeviceSpec("l40s", 48, 362.0, 32.0, 12.5, float8_tflops=733.0, hbm_gbps=864.0),
    # One CPU rank (one core's share): a nominal fp32 figure so MFU has a denominator.
    # Its host is its device: per-op costs sit inside the nominal throughput.
    "cpu": DeviceSpec("cpu", 8, 0.1, 5.0, 1.0, framework_gib=0.65, streams=False,
                      kernel_overhead_s=0.0, host_dispatch_s=0.0),
}


def device_spec(name: str) -> DeviceSpec:
    key = name.lower()
    if key not in DEVICES:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(sorted(DEVICES))}")
    return DEVICES[key]
