"""Triton kernels against torch eager and torch.compile of their references, then a whole
training step with and without them.

    TRITON_INTERPRET=0 .venv/bin/python bench/kernels.py              # on a GPU
    TRITON_INTERPRET=1 .venv/bin/python bench/kernels.py --smoke      # CPU: checks the script

Part 1, per kernel at model-sized shapes (8k tokens × 4096 hidden, 14336 FFN, vocab 128k):
forward + backward time for each implementation, the bytes each must move at least, the
achieved GB/s against a measured device-to-device copy, and the peak memory the call adds.
The fused linear + cross-entropy is matmul-bound; its point is memory (no tokens × vocab
logits), so its GB/s column is left empty.

Part 2: one rank training the `1b` preset (seq 2048, global batch 8, microbatch 2, bf16,
ZeRO-3 over a 1-rank mesh: the production code path) with model.kernels = torch, triton and
auto, torch / auto with model.compile (each block compiled; the warm-up step compiles), and
on a GPU auto + compile with training.float8 tensorwise and rowwise (torchao); then an
8B-shaped model (8 of Llama 3 8B's layers, microbatch 4: torch, auto, auto + compile, and
float8 tensorwise): step time, tokens/s, MFU against the device table's dense bf16 peak (float8
variants too), peak memory. ``--variants`` times chosen variants only.

--smoke runs tiny shapes in Triton's CPU interpreter (torch.compile and MFU are skipped): the
numbers mean nothing, it only proves the script runs.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from collections.abc import Callable

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def _timer(device: str, reps: int) -> Callable[[Callable[[], object]], float]:
    """Median seconds of ``fn()``: triton's do_bench (CUDA events, L2 flushed) on a GPU."""
    import torch

    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=5, rep=50, return_mode="median") / 1e3

    def cpu(fn):
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    _ = torch
    return cpu


def _fwd_bwd(fn: Callable, inputs: list, upstream):
    """A closure running forward and backward of ``fn`` once (grads reset)."""

    def run():
        for x in inputs:
            x.grad = None
        out = fn(*inputs)
        out.backward(upstream if out.dim() else None)

    return run


def _peak_bytes(run: Callable[[], None], device: str) -> int | None:
    import torch

    if device != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def kernel_table(device: str, smoke: bool, dtype_name: str) -> list[dict]:
    import torch

    from trainmesh.kernels import kernel_set
    from trainmesh.kernels import reference as ref
    from trainmesh.models.llama.model import rope_tables

    dtype = getattr(torch, dtype_name)
    timer = _timer(device, reps=2 if smoke else 20)
    tri = kernel_set("triton")
    if smoke:
        tokens, dim, ffn, heads, head_dim, vocab = 64, 64, 176, 4, 16, 264
    else:
        tokens, dim, ffn, heads, head_dim, vocab = 8192, 4096, 14336, 32, 128, 128_256
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(shape, generator=gen, device=device) * scale).to(dtype).requires_grad_()

    e = torch.finfo(dtype).bits // 8
    copy_src = torch.empty(64 * 2**20 if not smoke else 2**20, dtype=torch.uint8, device=device)
    copy_dst = torch.empty_like(copy_src)
    copy_gbs = 2 * copy_src.numel() / timer(lambda: copy_dst.copy_(copy_src)) / 1e9

    cos, sin = (t[:tokens // 4].to(device) for t in rope_tables(head_dim, tokens // 4, 10000.0))
    cases = [
        # name, {impl: fn}, inputs, bytes moved forward + backward (at least)
        ("rms_norm", {"triton": lambda x, w: tri.rms_norm(x, w, 1e-5),
                      "torch": lambda x, w: ref.rms_norm(x, w, 1e-5)},
         [rand(tokens, dim), rand(dim)], e * tokens * dim * (2 + 3)),
        ("swiglu", {"triton": tri.swiglu, "torch": ref.swiglu},
         [rand(tokens, ffn), rand(tokens, ffn)], e * tokens * ffn * (3 + 5)),
        ("rope", {"triton": lambda x: tri.rope(x, cos, sin), "torch": lambda x: ref.rope(x, cos, sin)},
         [rand(4, tokens // 4, heads, head_dim)], e * tokens * heads * head_dim * (2 + 2)),
    ]
    targets = torch.randint(0, vocab, (tokens,), generator=gen, device=device)
    cases.append(("linear_cross_entropy",
                  {"triton": lambda h, w: tri.linear_cross_entropy(h, w, targets),
                   "torch": lambda h, w: ref.linear_cross_entropy(h, w, targets)},
                  [rand(tokens, dim), rand(vocab, dim, scale=0.02)], None))
    rows = []
    for name, impls, inputs, nbytes in cases:
        if not smoke:
            impls["torch.compile"] = torch.compile(impls["torch"])
        out = impls["torch"](*inputs)
        upstream = torch.randn(out.shape, generator=gen, device=device).to(out.dtype) if out.dim() else None
        times = {}
        for impl, fn in impls.items():
            run = _fwd_bwd(fn, inputs, upstream)
            run()  # compile / autotune / warm up
            times[impl] = timer(run)
            peak = _peak_bytes(run, device)
            rows.append({"kernel": name, "impl": impl, "ms": times[impl] * 1e3,
                         "gb_s": nbytes / times[impl] / 1e9 if nbytes else None,
                         "of_copy": nbytes / times[impl] / 1e9 / copy_gbs if nbytes else None,
                         "vs_eager": times["torch"] / times[impl] if "torch" in times else None,
                         "peak_mib": peak / 2**20 if peak is not None else None})
        for r in rows:
            if r["kernel"] == name:
                r["vs_eager"] = times["torch"] / (r["ms"] / 1e3)
    print(f"\ndevice-to-device copy: {copy_gbs:.0f} GB/s  ({tokens} tokens, dim {dim}, ffn {ffn}, "
          f"vocab {vocab}, {dtype_name}; forward + backward)")
    return rows


LARGER = ["model.preset=8b", "model.n_layers=8"]  # Llama 3 8B's layers, 8 of them: ~2.8B params


DEFAULT_VARIANTS = ("torch", "triton", "auto", "torch+compile", "auto+compile")
CUDA_VARIANTS = ("auto+compile+tensorwise", "auto+compile+rowwise")  # float8 only emulated off CUDA
LARGER_VARIANTS = ("torch", "auto", "auto+compile", "auto+compile+tensorwise")


def parse_variant(text: str) -> tuple[str, bool, str]:
    """``kernels[+compile][+tensorwise|+rowwise]`` -> (model.kernels, model.compile, training.float8)."""
    kernels, *rest = text.strip().split("+")
    unknown = set(rest) - {"compile", "tensorwise", "rowwise"}
    if kernels not in ("torch", "triton", "auto") or unknown or ("tensorwise" in rest and "rowwise" in rest):
        raise SystemExit(f"--variants: {text!r} is not kernels[+compile][+tensorwise|+rowwise] "
                         "with kernels one of torch, triton, auto")
    float8 = "tensorwise" if "tensorwise" in rest else "rowwise" if "rowwise" in rest else "none"
    return kernels, "compile" in rest, float8


def step_table(device: str, smoke: bool, steps: int, larger: bool = False,
               variants: list[str] | None = None, microbatch: int = 2,
               global_batch: int = 8) -> list[dict]:
    import torch
    import torch.distributed as dist

    from trainmesh.cli.loading import load_spec
    from trainmesh.data.shards import ensure_tiny_corpus
    from trainmesh.engine.engine import Engine
    from trainmesh.parallel.dims import ParallelDims
    from trainmesh.parallel.mesh import Mesh
    from trainmesh.planning.devices import device_spec

    if not dist.is_initialized():
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=0,
                                world_size=1)
    mesh = Mesh.build(ParallelDims(), device, 0)
    shape = (["model.preset=tiny", "training.seq_len=32", "training.dtype=float32"] if smoke else
             [*(LARGER if larger else ["model.preset=1b"]), "training.seq_len=2048",
              "training.dtype=bfloat16"])
    peak = device_spec("h100" if device == "cuda" else "cpu").peak_tflops
    if device == "cuda":
        name = torch.cuda.get_device_name().lower()
        peak = device_spec("h200" if "h200" in name else "h100").peak_tflops
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = str(ensure_tiny_corpus(os.path.join(tmp, "data")))
        if variants is None:
            variants = list(LARGER_VARIANTS if larger else
                            DEFAULT_VARIANTS + (CUDA_VARIANTS if device == "cuda" else ()))
        for kernels, compiled, float8 in map(parse_variant, variants):
            spec = load_spec(None, [*shape, f"training.global_batch_size={global_batch}",
                                    f"training.microbatch_size={microbatch}",
                                    f"training.steps={steps + 1}", "optimizer.warmup_steps=1",
                                    f"model.kernels={kernels}", f"model.compile={compiled}",
                                    f"training.float8={float8}",
                                    "tracking.enabled=false", f"runtime.device={device}"])
            engine = Engine(spec, mesh, data_dir, torch.device(device))
            first = engine.train_step()  # warm-up (compiles the blocks with model.compile)
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            busy = []  # the driver's share of time a kernel ran (NVML, where it says), per step
            for _ in range(steps):
                stats = engine.train_step()
                busy.append((stats.breakdown or {}).get("gpu_utilization"))
            if device == "cuda":
                torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) / steps
            busy = [b for b in busy if b is not None]
            tokens_s = stats.tokens / dt
            flops = engine.model.args.flops_per_token(spec.training.seq_len) * tokens_s
            label = kernels + (" + compile" if compiled else "") + (
                f" + float8 {float8}" if float8 != "none" else "")
            rows.append({"kernels": label, "step_s": dt,
                         "tokens_s": tokens_s,
                         "tflops": flops / 1e12, "mfu": flops / (peak * 1e12),
                         "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
                         "gpu_busy": statistics.median(busy) if busy else None,
                         "first_loss": first.loss, "loss": stats.loss})
            del engine, stats, first
            gc.collect()  # the engine holds reference cycles: free it before the next one
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def lce_sweep(device: str, smoke: bool) -> list[str]:
    """The fused linear + cross-entropy against eager and torch.compile at several shapes and
    both dtypes, over its tunings (rows per chunk as a multiple of h's size; the weight's
    gradient summed in its dtype or in float32): time, peak memory added, and the largest
    error of the loss and both gradients against the float32 math."""
    import torch

    from trainmesh.kernels import reference as ref
    from trainmesh.kernels.linear_cross_entropy import ACCUMULATE, CHUNK_FACTOR, linear_cross_entropy

    timer = _timer(device, reps=2 if smoke else 10)
    shapes = ([(64, 32, 1000, "float32", True)] if smoke else
              [(8192, 4096, 128_256, "bfloat16", True), (8192, 4096, 128_256, "float32", False),
               (4096, 2048, 128_256, "bfloat16", False), (16384, 4096, 32_000, "bfloat16", False)])
    lines = [f"defaults: CHUNK_FACTOR {CHUNK_FACTOR}, ACCUMULATE {ACCUMULATE!r}", "",
             "| tokens × dim × vocab | dtype | impl | ms | vs eager | peak MiB | vs eager | "
             "err loss | err dh | err dW |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for tokens, dim, vocab, dtype_name, full in shapes:
        dtype = getattr(torch, dtype_name)
        gen = torch.Generator(device=device).manual_seed(0)
        h = torch.randn(tokens, dim, generator=gen, device=device).to(dtype).requires_grad_()
        w = (torch.randn(vocab, dim, generator=gen, device=device) * 0.02).to(dtype).requires_grad_()
        y = torch.randint(0, vocab, (tokens,), generator=gen, device=device)
        hf, wf = (t.detach().float().requires_grad_() for t in (h, w))
        want = ref.linear_cross_entropy(hf, wf, y)
        want.backward()
        want = [want.detach(), hf.grad, wf.grad]
        del hf, wf
        impls = {"eager": lambda a, b, y=y: ref.linear_cross_entropy(a, b, y)}
        if not smoke and (full or dtype_name == "bfloat16"):
            impls["torch.compile"] = torch.compile(impls["eager"])
        tunings = ([(f, a) for f in (1, 4, 8) for a in ("native", "fp32")] if full else
                   [(CHUNK_FACTOR, ACCUMULATE)])
        for f, a in tunings:
            impls[f"triton ×{f} {a}"] = (lambda a_, b_, f=f, a=a, y=y:
                                        linear_cross_entropy(a_, b_, y, factor=f, accumulate=a))
        base_ms = base_peak = None
        for name, fn in impls.items():
            run = _fwd_bwd(fn, [h, w], None)
            run()
            got = [fn(h, w).detach(), h.grad.float(), w.grad.float()]
            errs = [float((g - r).abs().max() / r.abs().max()) for g, r in zip(got, want, strict=True)]
            del got
            ms = timer(run) * 1e3
            peak = _peak_bytes(run, device)
            peak = peak / 2**20 if peak is not None else None
            base_ms = base_ms or ms
            base_peak = base_peak or peak
            lines.append(f"| {tokens} × {dim} × {vocab} | {dtype_name} | {name} | {ms:.2f} | "
                         f"{base_ms / ms:.2f}× | {_fmt(peak, '.0f')} | "
                         f"{_fmt(peak / base_peak if peak and base_peak else None, '.2f')} | "
                         + " | ".join(f"{e:.1e}" for e in errs) + " |")
        del h, w, want, impls
        if device == "cuda":
            torch.cuda.empty_cache()
    return lines


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def measured_entry(rows: list[dict], device: str) -> str:
    """This run's per-op speed-ups of Triton over torch eager, as an entry of
    ``trainmesh/spec/kernel_choice.py``'s MEASURED table (what ``model.kernels: auto`` takes
    on this device class once the entry is added)."""
    import datetime

    import torch

    from trainmesh.spec.kernel_choice import device_class

    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreted)"
    ms = {(r["kernel"], r["impl"]): r["ms"] for r in rows}
    speedup = {r["kernel"]: round(r["vs_eager"], 2) for r in rows if r["impl"] == "triton"}
    compiled = {op: round(ms[op, "torch.compile"] / ms[op, "triton"], 2) for op in speedup
                if (op, "torch.compile") in ms}
    return (f"\nkernel_choice.MEASURED entry for this device:\n\n    {device_class(name)!r}: "
            f"Measurement({datetime.date.today().isoformat()!r}, {name!r}, {speedup!r}, "
            f"{compiled!r}),\n")


def print_steps(steps: list[dict], larger: bool, smoke: bool, microbatch: int, global_batch: int) -> None:
    name = " ".join(LARGER) if larger else "model.preset=" + ("tiny" if smoke else "1b")
    print(f"\n{name}, seq 2048, global batch {global_batch}, microbatch {microbatch}:\n")
    # GPU busy: the driver's utilisation (a kernel running, % of its last sample period),
    # median over the timed steps; well under 100 where the host's launches bound the step
    print("| model.kernels | step s | tokens/s | TFLOP/s | MFU | GPU busy % | peak GiB | first loss | loss |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = steps[0]["step_s"]
    for r in steps:
        print(f"| {r['kernels']} | {r['step_s']:.3f} ({base / r['step_s']:.2f}×) | "
              f"{r['tokens_s']:.0f} | {r['tflops']:.1f} | {r['mfu']:.1%} | {_fmt(r['gpu_busy'], '.0f')} | "
              f"{_fmt(r['peak_gib'], '.1f')} | {r['first_loss']:.4f} | {r['loss']:.4f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, interpreted")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--variants", help="only the step table, for these comma-separated variants, "
                    "each kernels[+compile][+tensorwise|+rowwise] (e.g. auto,torch+compile+tensorwise)")
    ap.add_argument("--model", choices=["1b", "8b8"], default="1b",
                    help="with --variants: the 1b preset or the 8B-shaped model (8 of Llama 3 8B's layers)")
    ap.add_argument("--microbatch", type=int, default=2, help="with --variants: training.microbatch_size")
    ap.add_argument("--global-batch", type=int, default=8, help="with --variants: training.global_batch_size")
    ap.add_argument("--lce-sweep", action="store_true",
                    help="only the fused linear + cross-entropy sweep (shapes, dtypes, tunings)")
    args = ap.parse_args()
    import torch

    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--smoke needs TRITON_INTERPRET=1 in the environment")
        device = "cpu"
    elif not torch.cuda.is_available():
        raise SystemExit("bench/kernels.py needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)")
    else:
        device = "cuda"
    if args.lce_sweep:
        print("\n".join(lce_sweep(device, args.smoke)))
        return
    if args.variants:
        larger = args.model == "8b8"
        steps = step_table(device, args.smoke, 2 if args.smoke else args.steps, larger,
                           args.variants.split(","), args.microbatch, args.global_batch)
        print_steps(steps, larger, args.smoke, args.microbatch, args.global_batch)
        return
    rows = kernel_table(device, args.smoke, "float32" if args.smoke else args.dtype)
    print("| kernel | impl | ms | GB/s | of copy | speed-up vs eager | peak MiB |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kernel']} | {r['impl']} | {r['ms']:.3f} | {_fmt(r['gb_s'], '.0f')} | "
              f"{_fmt(r['of_copy'], '.2f')} | {r['vs_eager']:.2f} | {_fmt(r['peak_mib'], '.0f')} |")
    print(measured_entry(rows, device))
    # The 8B-shaped model at microbatch 4 (8k tokens a matmul, as a real 8B run has): float8's
    # gain grows with the matmuls (1.16x bf16 at microbatch 2, 1.25x at 4; H200, 2026-11-27).
    # `1b` at microbatch 4 too: at 2 its eager step varied 0.33-0.42 s between runs on an H100
    # (2026-11-27), 0.28 s at 4 (half the launches per token): the GPU busy column tells.
    tables = ((False, 2, 8, None), (False, 4, 8, ["torch+compile", "auto", "auto+compile"]),
              (True, 4, 16, None))
    for larger, mb, gb, variants in tables if not args.smoke else ((False, 2, 8, None),):
        print_steps(step_table(device, args.smoke, 2 if args.smoke else args.steps, larger, variants,
                               microbatch=mb, global_batch=gb), larger, args.smoke, mb, gb)
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
