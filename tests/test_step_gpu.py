"""The step's breakdown on a real GPU: CUDA events, not the host's launch times.

    TRITON_INTERPRET=0 .venv/bin/python -m pytest -m gpu tests/test_step_gpu.py

Skipped without CUDA (run by the GPU check kit, bench/gpu_check.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _device_seconds(work) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    work()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def test_forward_time_is_the_devices_time(tmp_path):
    """A block whose forward enqueues device work (torch.cuda._sleep) returns to the host at
    once: the host clock would see nothing, the events see it all; the parts still add up to
    the step. The sleep counts clock cycles, so its length follows the SM clock: it is timed
    right after the step, at the step's clocks. It must outlast the host's own time in the
    forward: the tiny model's forward is the host launching kernels (~11 ms on an H100), and a
    device that had been waiting for them absorbed two 5 ms sleeps (2026-11-27); two of ~100 ms
    cannot hide."""
    from trainmesh.cli.loading import load_spec
    from trainmesh.data.shards import ensure_tiny_corpus
    from trainmesh.engine.engine import Engine
    from trainmesh.parallel.dims import ParallelDims
    from trainmesh.parallel.mesh import Mesh

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        spec = load_spec(None, ["model.preset=tiny", "training.seq_len=32", "training.steps=4",
                                "training.global_batch_size=4", "training.microbatch_size=2",
                                "optimizer.warmup_steps=1", "tracking.enabled=false", "runtime.device=cuda",
                                f"runtime.output_dir={tmp_path}"])
        engine = Engine(spec, Mesh.build(ParallelDims(), "cuda", 0),
                        str(ensure_tiny_corpus(tmp_path / "data")), torch.device("cuda", 0))
        engine.train_step()  # warm-up
        plain = engine.train_step().breakdown
        block = next(iter(engine.model.layers.values()))
        # a pre-hook registered after the timer's: the sleep is queued inside the block's span
        block.register_forward_pre_hook(lambda *_: torch.cuda._sleep(2 * 10**8))
        b = engine.train_step().breakdown
        sleep_s = _device_seconds(lambda: torch.cuda._sleep(2 * 10**8))
    finally:
        dist.destroy_process_group()
    # 2 microbatches, one sleep each in the first block's forward: the device's forward holds
    # both, the host's (what the host clock would see) only its launches
    assert sleep_s > 3 * plain["forward_s"], (plain, sleep_s)
    assert b["forward_s"] > 1.8 * sleep_s, (b, plain, sleep_s)
    assert b["data_s"] + b["compute_s"] + b["comm_s"] + b["bubble_s"] == pytest.approx(b["step_s"])
    assert b["step_s"] > b["forward_s"] and b["memory_allocated_peak_gib"] > 0
