"""The GPU check kit: what only a GPU can show, in one command, about 9 minutes on one H200
(561 s, 2026-11-27; the kernels part is half of it), written to bench/history/journal.md as a dated
section part by part (a run cut off keeps the parts it finished). Parts in the order they run
(``--parts`` picks some):

    make gpu-check            # = python3 bench/gpu_check.py --append bench/history/journal.md

Where one command may run 10 minutes at most, split it: ``--parts tests,lce,kernels``, then
``--parts attention,moe,moe-float8,moe-halves,mla,mla-latent,memory`` (and ``microbatch`` when
calibrating the cost model).

1. tests: the GPU test modules (Triton kernels compiled for real against the torch
   references; the step's breakdown on CUDA events).
2. lce: the fused linear + cross-entropy against eager and torch.compile at several shapes and
   both dtypes, over its tunings (rows per chunk, the weight gradient's accumulation dtype),
   with errors against the float32 math (``bench/kernels.py --lce-sweep``).
3. kernels: ``bench/kernels.py``: kernel GB/s against a device copy, eager and torch.compile
   (and the kernel_choice.MEASURED entry for this GPU); step time, tokens/s, MFU and each
   variant's first and last loss and the GPU's busy share (the driver's utilisation: under
   100% where the host's launches bound the step) for `1b` (model.kernels torch / triton /
   auto, with compile, with float8 tensorwise and rowwise; at microbatch 4 against torch +
   compile too) and an 8B-shaped model (Llama 3 8B's layers, 8 of them, microbatch 4).
4. attention: context parallel's attention block with its log-sum-exp at a long sequence (one
   rank of cp 16 at 131K tokens: a 4,096-query chunk against an 8,192-key block,
   Llama-3.1-8B's heads, bf16): the path a rank runs on CUDA in bf16 (the fused flash kernel
   with its log-sum-exp, and its backward given the log-sum-exp), the explicit math over query
   slices (fp32, document masks), and whole SDPA; times, peak memory, and the fused path's
   error against the float32 math.
5. moe: ``torch._grouped_mm`` (what an MoE block uses on CUDA) against the per-expert loop
   (what it uses elsewhere), forward + backward at Mixtral 8x7B's expert shapes and
   DeepSeek-V3's (2048 × 7168, 32 experts: a rank's at ep 8) in bf16, with the tokens spread
   evenly and skewed (half of them to one expert).
6. moe-float8: the experts' float8 grouped GEMMs (torchao's; ``training.float8`` on an MoE
   model: rowwise scales on Hopper, MXFP8 on Blackwell) against the bf16 grouped GEMM at the
   same shapes, tokens not in whole blocks (the padding inside the float8 time) and one
   expert without any, with the float8 output's error and that expert's weight gradients
   (zeros) (added 2026-11-30: not run yet; eager: a compiled run fuses the padding).
7. moe-halves: one MoE block with its exchanges whole or in two halves
   (``parallelism.ep_overlap``) over a 1-rank NCCL group: what the halves cost on a GPU with
   nothing to hide (the cost model's assumed ``HALVES_EXTRA``; added 2026-11-30: not run yet).
8. mla: Multi-head Latent Attention's SDPA at DeepSeek-V3's heads (query/key 192, value
   128; and the values padded to 192, as context parallel moves them) on each backend (flash,
   efficient, cuDNN, math) that takes it, beside 128-wide heads (added 2026-11-29: not run yet).
   mla-latent: what context parallel's latent ring (``parallelism.cp_latent``) adds where a
   block arrives — expanding DeepSeek-V3's latents by ``wkv_b`` (twice: forward and again in
   backward) and folding the gradients back — against the transfer it saves at the device's
   NVLink and network bandwidths (blocks of 2,048–8,192 tokens; added 2026-11-30: not run yet).
9. memory: planned vs measured CUDA memory: one rank builds the `1b` preset the way a job
   does (meta build, FSDP2 over a 1-rank mesh, bf16, seq 2048) and runs two steps
   (activations counted in the first, the peak of the second: steady state, no counting
   hooks), for both ZeRO-3 policies and both kernel sets; its tensors' peak (torch's max
   allocated) and the activations autograd saved are set beside the cost model's prediction.
   A 1-rank mesh: NCCL runs, but no collective crosses a device.
10. microbatch (asked for by name, ``--parts microbatch``, about 100 s on an H200): `1b` with
   `auto`, eager, at microbatch 1, 2, 4 and 8 of a global batch of 16, and 2 and 4 of 8: the
   step time and the GPU's busy share the cost model's per-microbatch device and host terms
   are fitted to (``planning/devices.py``; ``bench/planner.py`` sets them side by side).
   ``--parts microbatch-compile``: the same with `model.compile` (each size compiles anew: a
   few minutes), what a compiled step's host figure would be fitted to (not measured yet).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 1024**3


def _run(cmd: list[str], timeout_s: float, env: dict[str, str]) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True,
                           text=True, timeout=timeout_s)
        return p.returncode, p.stdout + p.stderr, time.perf_counter() - t0
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        return 124, out + f"\n(timed out after {timeout_s:.0f} s)", time.perf_counter() - t0


def environment() -> list[str]:
    import torch
    import triton

    p = torch.cuda.get_device_properties(0)
    return [f"- device: {p.name}, {p.total_memory / GIB:.0f} GiB, {p.multi_processor_count} SMs",
            f"- torch {torch.__version__} (CUDA {torch.version.cuda}, NCCL "
            f"{'.'.join(map(str, torch.cuda.nccl.version()))}), triton {triton.__version__}"]


def gpu_tests() -> list[str]:
    rc, out, dt = _run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                        "tests/test_kernels_gpu.py", "tests/test_step_gpu.py"], 240,
                       {"TRITON_INTERPRET": "0"})
    last = [ln for ln in out.strip().splitlines() if ln.strip()][-1:] or ["(no output)"]
    lines = [f"- `pytest -m gpu tests/test_kernels_gpu.py tests/test_step_gpu.py`: "
             f"{last[0].strip('= ')} ({dt:.0f} s)"]
    if rc != 0:
        lines += ["", "```", *out.strip().splitlines()[-30:], "```"]
    return lines


def kernel_bench() -> list[str]:
    rc, out, dt = _run([sys.executable, "bench/kernels.py", "--steps", "3"], 400,
                       {"TRITON_INTERPRET": "0"})
    tables = [ln for ln in out.splitlines()
              if ln.startswith(("|", "    '", "device-to-device", "model.")) or not ln.strip()]
    if rc != 0:
        return [f"bench/kernels.py failed (exit {rc}, {dt:.0f} s):", "", "```",
                *out.strip().splitlines()[-30:], "```"]
    return [f"bench/kernels.py ({dt:.0f} s):", "", *tables]


def lce_sweep() -> list[str]:
    rc, out, dt = _run([sys.executable, "bench/kernels.py", "--lce-sweep"], 240,
                       {"TRITON_INTERPRET": "0"})
    tables = [ln for ln in out.splitlines() if ln.startswith(("|", "defaults")) or not ln.strip()]
    if rc != 0:
        return [f"bench/kernels.py --lce-sweep failed (exit {rc}, {dt:.0f} s):", "", "```",
                *out.strip().splitlines()[-30:], "```"]
    return [f"bench/kernels.py --lce-sweep ({dt:.0f} s):", "", *tables]


def microbatch_sweep(variant: str = "auto") -> list[str]:
    """1b's step by microbatch size (see the module docstring, 7)."""
    lines: list[str] = []
    for batch, mbs in ((16, 1), (16, 2), (16, 4), (16, 8), (8, 2), (8, 4)):
        rc, out, dt = _run([sys.executable, "bench/kernels.py", "--steps", "3", "--variants", variant,
                            "--microbatch", str(mbs), "--global-batch", str(batch)],
                           180, {"TRITON_INTERPRET": "0"})
        if rc != 0:
            return lines + [f"global batch {batch}, microbatch {mbs} failed (exit {rc}, {dt:.0f} s):",
                            "", "```", *out.strip().splitlines()[-30:], "```"]
        lines += [ln for ln in out.splitlines() if ln.startswith(("|", "model.")) or not ln.strip()]
    return lines


def memory_check() -> list[str]:
    """One 1b rank per ZeRO-3 policy: predicted vs measured (see the module docstring)."""
    import torch
    import torch.distributed as dist

    from trainmesh.cli.loading import load_spec
    from trainmesh.controller.dry_run import memory_rows
    from trainmesh.data.shards import ensure_tiny_corpus
    from trainmesh.engine.engine import Engine
    from trainmesh.parallel.dims import ParallelDims
    from trainmesh.parallel.mesh import Mesh
    from trainmesh.planning.devices import device_spec
    from trainmesh.planning.job_plan import effective_spec, plan_job
    from trainmesh.planning.topology import Topology

    name = "h200" if "h200" in torch.cuda.get_device_name().lower() else "h100"
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    mesh = Mesh.build(ParallelDims(), "cuda", 0)
    device = torch.device("cuda", 0)
    lines = ["| ZeRO-3 policy | kernels | predicted tensors GiB | measured max allocated GiB | "
             "ratio | predicted activations GiB | measured saved GiB | ratio | max reserved GiB | "
             "allocated before GiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = str(ensure_tiny_corpus(os.path.join(tmp, "data")))
        for keep in (True, False):
            for kernels in ("triton", "torch"):
                spec = load_spec(None, ["model.preset=1b", "training.seq_len=2048",
                                        "training.dtype=bfloat16", "training.global_batch_size=8",
                                        "training.microbatch_size=2", f"model.kernels={kernels}",
                                        f"parallelism.keep_gathered={str(keep).lower()}",
                                        "optimizer.warmup_steps=1", "training.steps=2",
                                        "tracking.enabled=false", "runtime.device=cuda"])
                dims, result = plan_job(spec, Topology.uniform(1, 1, name))
                eff = effective_spec(spec, result.best.candidate)
                left = torch.cuda.memory_allocated() / GIB
                torch.cuda.reset_peak_memory_stats()
                engine = Engine(eff, mesh, data_dir, device)
                # Activations counted in a first step (it creates the optimizer state), the
                # peak taken in a second, steady one without the counting hooks.
                engine.train_step(measure_activations=True)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                engine.train_step()
                torch.cuda.synchronize()
                report = {"rank": 0, "node": "local", "device": "cuda:0", **engine.memory_report()}
                row = memory_rows([report], eff, result.best.candidate, dims, device_spec(name),
                                  stepped=True)[0]
                p = row["predicted"]
                tensors = p["total"] - p["framework"]
                reserved = torch.cuda.max_memory_reserved() / GIB
                lines.append(
                    f"| {'keep gathered' if keep else 'reshard per microbatch'} | {kernels} | "
                    f"{tensors:.2f} | {row['measured_peak_gib']:.2f} | "
                    f"{row['measured_peak_gib'] / tensors:.2f} | {p['activations']:.2f} | "
                    f"{row['activations_gib']:.2f} | {row['activations_gib'] / p['activations']:.2f} "
                    f"| {reserved:.2f} | {left:.2f} |")
                del engine, report, row
                gc.collect()  # the engine holds reference cycles: free it before the next one
                torch.cuda.empty_cache()
    dist.destroy_process_group()
    return lines


def moe_float8() -> list[str]:
    """The experts' float8 grouped GEMMs (torchao: rowwise scales on Hopper, MXFP8 on
    Blackwell; ``training.float8`` on an MoE model) against the bf16 grouped GEMM, forward +
    backward, tokens evenly spread but not in whole blocks (the padding made once for the
    three GEMMs is inside the float8 time), and the float8 output's error against bf16's."""
    import torch

    from trainmesh.models.moe.moe import float8_grouped_kind

    kind = float8_grouped_kind("cuda", torch.cuda.get_device_capability())
    if kind is None:
        return ["no float8 grouped GEMM on this GPU (compute capability below 9.0)"]
    lines = [f"float8 kind: {kind}; bf16; forward + backward (ms, median)", "",
             "| experts | bf16 grouped | float8 grouped | bf16 / float8 | output rel. error | "
             "empty expert's weight grad (must be 0) |", "|---|---:|---:|---:|---:|---:|"]
    for model, shape in (("Mixtral 8x7B", (8, 4096, 14336, 8192, 2)),
                         ("DeepSeek-V3", (32, 7168, 2048, 8192, 8))):
        lines.append(_float8_vs_bf16(model, kind, *shape))
    return lines


def _float8_vs_bf16(model: str, kind: str, experts: int, dim: int, ffn: int, tokens: int,
                    k: int) -> str:
    import torch
    from triton.testing import do_bench

    from trainmesh.kernels import kernel_set
    from trainmesh.models.moe.moe import expert_swiglu, float8_expert_swiglu

    g = torch.Generator(device="cuda").manual_seed(0)

    def weight(*shape):
        return (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
                * 0.02).requires_grad_()

    w1, w3, w2 = weight(experts, ffn, dim), weight(experts, ffn, dim), weight(experts, dim, ffn)
    counts = [tokens * k // experts - 3] * (experts - 1)
    counts.append(tokens * k - sum(counts))
    counts[-1] += counts[1]  # one expert without rows: its weight gradients must be zeros
    counts[1] = 0
    x = torch.randn(sum(counts), dim, device="cuda", dtype=torch.bfloat16, generator=g,
                    requires_grad=True)
    up = torch.randn(sum(counts), dim, device="cuda", dtype=torch.bfloat16, generator=g)
    swiglu = kernel_set("torch").swiglu
    runs = {"bf16": lambda: expert_swiglu(x, counts, w1, w2, w3, swiglu, True),
            "float8": lambda: float8_expert_swiglu(x, counts, w1, w2, w3, swiglu, kind)}

    def step(run) -> None:
        for t in (x, w1, w2, w3):
            t.grad = None
        run().backward(up)

    times = [do_bench(lambda run=run: step(run), warmup=3, rep=30, return_mode="median")
             for run in runs.values()]
    step(runs["float8"])
    empty = max(float(w.grad[1].abs().max()) for w in (w1, w2, w3))
    with torch.no_grad():
        ref, got = runs["bf16"]().float(), runs["float8"]().float()
    err = ((got - ref).norm() / ref.norm()).item()
    return (f"| {model} ({experts} × {dim} × {ffn}, {tokens} tokens × top-{k}) | "
            f"{times[0]:.2f} | {times[1]:.2f} | {times[0] / times[1]:.2f}× | {err:.3f} | "
            f"{empty:.1e} |")


def moe_halves() -> list[str]:
    """The split-batch overlap's cost on one GPU (``parallelism.ep_overlap``): one MoE block,
    forward + backward, its exchanges whole or in two halves over a 1-rank NCCL group (each
    all-to-all a copy to itself on NCCL's stream: nothing to hide, so the difference is what
    the halves add in kernels and host time; the cost model assumes a quarter of a block's
    fixed costs, ``cost_model.HALVES_EXTRA``)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    lines = ["bf16, forward + backward (ms, median)", "",
             "| block | whole | halves | halves / whole |", "|---|---:|---:|---:|"]
    for model, shape in (("Mixtral 8x7B (8 experts, a rank's 4096 tokens)",
                          (8, 4096, 14336, 4096, 2, 0)),
                         ("DeepSeek-V3 (32 experts: a rank's at ep 8; shared expert)",
                          (32, 7168, 2048, 4096, 8, 1))):
        times = [_moe_block_ms(*shape, halves=h, device="cuda") for h in (1, 2)]
        lines.append(f"| {model} | {times[0]:.2f} | {times[1]:.2f} | {times[1] / times[0]:.2f}× |")
    return lines


def _moe_block_ms(experts: int, dim: int, ffn: int, tokens: int, k: int, shared: int,
                  halves: int, device: str, timer=None) -> float:
    """One MoE block's forward + backward (ms), its exchanges over the default group of one
    rank, whole (``halves`` 1) or in two halves."""
    import torch
    import torch.distributed as dist

    from trainmesh.kernels import kernel_set
    from trainmesh.models.llama.model import FeedForward
    from trainmesh.models.moe.moe import MoE, MoEArgs
    from trainmesh.parallel.expert import AllToAllDispatch

    class Loopback(AllToAllDispatch):  # the exchange path at ep 1 (which skips it)
        def exchange(self, x_sorted, counts_HE, experts, beside=None):
            return self._over_ep(x_sorted, counts_HE, experts, beside)

    torch.manual_seed(0)
    ops = kernel_set("torch")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    moe = MoE(dim, MoEArgs(experts=experts, top_k=k, expert_ffn_dim=ffn, aux_loss_coef=0.0,
                           shared_experts=shared), ops,
              FeedForward(dim, shared * ffn, ops) if shared else None).to(device, dtype)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.02)
    moe.dispatch = Loopback(dist.group.WORLD, 1, experts, None)
    moe.dispatch.halves = halves
    x = torch.randn(1, tokens, dim, device=device, dtype=dtype, requires_grad=True)

    def step() -> None:
        x.grad = None
        moe(x).sum().backward()
    if timer is None:
        from triton.testing import do_bench
        return do_bench(step, warmup=3, rep=20, return_mode="median")
    return timer(step)


def moe_gemm() -> list[str]:
    """Grouped GEMM vs the per-expert loop (see the module docstring)."""
    lines = []
    # Mixtral 8x7B's experts; DeepSeek-V3's (2048 × 7168), 32 of them: one rank's at ep 8,
    # the 8192 tokens' top-8 copies of an ep group's ranks arriving there
    for model, (experts, dim, ffn, tokens, k) in (("Mixtral 8x7B", (8, 4096, 14336, 8192, 2)),
                                                  ("DeepSeek-V3", (32, 7168, 2048, 8192, 8))):
        lines += [*_grouped_vs_loop(model, experts, dim, ffn, tokens, k), ""]
    return lines[:-1]


def _grouped_vs_loop(model: str, experts: int, dim: int, ffn: int, tokens: int, k: int) -> list[str]:
    import torch
    from triton.testing import do_bench

    from trainmesh.kernels import kernel_set
    from trainmesh.models.moe.moe import expert_swiglu

    g = torch.Generator(device="cuda").manual_seed(0)
    def weight(*shape):
        return (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
                * 0.02).requires_grad_()

    w1, w3, w2 = weight(experts, ffn, dim), weight(experts, ffn, dim), weight(experts, dim, ffn)
    swiglu = kernel_set("torch").swiglu
    rows = tokens * k
    spreads = {"even": [rows // experts] * experts,
               "skewed": [rows // 2] + [rows // 2 // (experts - 1)] * (experts - 2)
               + [rows // 2 - rows // 2 // (experts - 1) * (experts - 2)]}
    lines = [f"{model}: {experts} experts, dim {dim}, expert ffn {ffn}, {tokens} tokens × top-{k}, "
             "bf16, forward + backward (ms, median):", "",
             "| spread | per-expert loop | grouped GEMM | loop / grouped |", "|---|---:|---:|---:|"]
    for name, counts in spreads.items():
        x = torch.randn(sum(counts), dim, device="cuda", dtype=torch.bfloat16, generator=g,
                        requires_grad=True)
        up = torch.randn(sum(counts), dim, device="cuda", dtype=torch.bfloat16, generator=g)
        times = []
        for grouped in (False, True):
            def step(grouped=grouped, x=x, counts=counts, up=up):
                for t in (x, w1, w2, w3):
                    t.grad = None
                expert_swiglu(x, counts, w1, w2, w3, swiglu, grouped).backward(up)
            times.append(do_bench(step, warmup=3, rep=30, return_mode="median"))
        lines.append(f"| {name} | {times[0]:.2f} | {times[1]:.2f} | {times[0] / times[1]:.2f}× |")
    return lines


def attention_lse() -> list[str]:
    """Context parallel's attention block on CUDA (see the module docstring, 5)."""
    import math

    import torch
    from triton.testing import do_bench

    from trainmesh.kernels import attention, reference

    B, Hkv, rep, Tq, Tk, D = 1, 8, 4, 4096, 8192, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, Hkv, rep, Tq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(B, Hkv, 1, Tk, D, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    scale = 1 / math.sqrt(D)
    dout = torch.randn(q.shape, device="cuda", dtype=torch.float32, generator=g)

    def fused():  # what a rank runs on CUDA in bf16: the flash kernel with its log-sum-exp
        out, lse = attention.attention_block(q, k, v, False, None, scale)
        return out, lse, attention.attention_block_backward(dout, q, k, v, out, lse, False,
                                                            None, scale)

    def explicit():  # the explicit math over query slices (fp32 on a GPU, document masks)
        mask = torch.ones(1, 1, 1, Tq, Tk, dtype=torch.bool, device="cuda")  # forces the math
        out, lse = attention.attention_block(q, k, v, False, mask, scale)
        return out, lse, attention.attention_block_backward(dout, q, k, v, out, lse, False,
                                                            mask, scale)

    q4 = q.reshape(B, Hkv * rep, Tq, D)
    k4, v4 = (t.expand(B, Hkv, rep, Tk, D).reshape(B, Hkv * rep, Tk, D) for t in (k, v))

    def whole():
        x = q4.detach().requires_grad_()
        torch.nn.functional.scaled_dot_product_attention(x, k4, v4).backward(
            dout.reshape(q4.shape).to(x.dtype))

    lines = [f"one block: {Tq} queries × {Tk} keys, {Hkv * rep} heads ({Hkv} key/value), head dim "
             f"{D}, bf16, forward + backward", "", "| path | ms (median) | peak GiB |",
             "|---|---:|---:|"]
    for name, fn in (("fused flash with log-sum-exp (trainmesh on CUDA, bf16)", fused),
                     ("explicit math over query slices (fp32, document masks)", explicit),
                     ("whole SDPA (no log-sum-exp)", whole)):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = do_bench(fn, warmup=3, rep=20, return_mode="median")
        peak = (torch.cuda.max_memory_allocated() - base) / GIB
        lines.append(f"| {name} | {ms:.2f} | {peak:.2f} |")
    got = fused()
    want_out, want_lse = reference.attention_block(q.float(), k.float(), v.float(), None, scale)
    want = (want_out, want_lse, reference.attention_block_backward(
        dout, q.float(), k.float(), v.float(), want_out, want_lse, None, scale))
    names = ("out", "lse", "dq", "dk", "dv")
    flat_got = [got[0], got[1], *got[2]]
    flat_want = [want[0], want[1], *want[2]]
    errs = [float((a.float() - b).abs().max() / b.abs().max()) for a, b in zip(flat_got, flat_want, strict=True)]
    lines += ["", "fused (bf16 in) against the float32 math, largest error / largest value: "
              + ", ".join(f"{n} {e:.2g}" for n, e in zip(names, errs, strict=True))
              + " (bf16 rounding is ~4e-3; an error near 1 means the fused backward is wrong "
              "and CUDA must go back to the math: kernels/attention.py)"]
    return lines


def mla_attention() -> list[str]:
    """Multi-head Latent Attention's attention on CUDA (see the module docstring, 6): SDPA over
    DeepSeek-V3's heads — 128 of them, query/key 192 wide (128 + 64 rotary), values 128 — at
    seq 4096, bf16, forward + backward, on each backend that takes it, and with the values
    padded to 192 (what context parallel's ring moves), against GQA's 128-wide heads."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    B, H, T = 1, 128, 4096
    g = torch.Generator(device="cuda").manual_seed(0)

    def tensors(qk: int, v: int):
        q, k = (torch.randn(B, H, T, qk, device="cuda", dtype=torch.bfloat16, generator=g)
                .requires_grad_() for _ in range(2))
        return q, k, torch.randn(B, H, T, v, device="cuda", dtype=torch.bfloat16,
                                 generator=g).requires_grad_()

    cases = {"MLA (qk 192, v 128)": (192, 128), "MLA, v padded (192, 192)": (192, 192),
             "GQA-like (128, 128)": (128, 128)}
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    lines = [f"{H} heads, seq {T}, causal, bf16, forward + backward (ms, median; - : the backend "
             "does not take it)", "", "| heads | " + " | ".join(backends) + " |",
             "|---|" + "---:|" * len(backends)]
    for name, (qk, v) in cases.items():
        q, k, val = tensors(qk, v)
        cells = []
        for backend in backends.values():
            def step(backend=backend, q=q, k=k, val=val):
                with sdpa_kernel([backend]):
                    torch.nn.functional.scaled_dot_product_attention(
                        q, k, val, is_causal=True).sum().backward()
            try:
                cells.append(f"{do_bench(step, warmup=2, rep=10, return_mode='median'):.2f}")
            except RuntimeError:
                cells.append("-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def mla_latent() -> list[str]:
    """Context parallel's latent ring on CUDA (see the module docstring, 8): one arriving
    block of DeepSeek-V3's latents (512 + 64 rotary values a token) expanded by a rank's
    ``wkv_b`` (128 heads × (128 + 128) rows, tp 1) and, in backward, expanded again and its
    keys' and values' gradients folded back (``mla.LatentKeys``), bf16 with fp32
    accumulation; beside it the time the moved bytes would take at the device's links: a
    block travels twice (forward, backward) in bf16 and its gradient once in fp32."""
    import torch
    from triton.testing import do_bench

    from trainmesh.models.llama.mla import LatentKeys, MLAArgs
    from trainmesh.planning.devices import device_spec

    m = MLAArgs(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                q_lora_rank=1536)
    keys, heads = LatentKeys(m, 192), 128
    dev = device_spec("h200" if "h200" in torch.cuda.get_device_name().lower() else "h100")
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(heads * 256, 512, device="cuda", dtype=torch.bfloat16, generator=g) / 23
    lines = ["block tokens | expand ms | fold ms | latent's extra ms (2 expands + fold) | "
             "bytes saved MB | their time over NVLink ms | over the network ms",
             "", "| tokens | expand | fold | extra | saved MB | NVLink | network |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for T in (2048, 4096, 8192):
        block = torch.randn(1, T, 576, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = keys.expand(block, [w])
        dk, dv = (torch.randn(t.shape, device="cuda", generator=g) for t in (k, v))
        d_block = torch.zeros(block.shape, device="cuda")
        d_w = [torch.zeros(w.shape, device="cuda")]
        expand = do_bench(lambda b=block: keys.expand(b, [w]), warmup=5, rep=20,
                          return_mode="median")
        fold = do_bench(lambda b=block, dk=dk, dv=dv, d=d_block, dw=d_w: keys.fold(b, [w], dk, dv, d, dw),
                        warmup=5, rep=20, return_mode="median")
        expanded, latent = 2 * T * heads * 192, T * 576  # elements a block moves
        saved = (expanded - latent) * (2 + 2 + 4)
        lines.append(f"| {T} | {expand:.2f} | {fold:.2f} | {2 * expand + fold:.2f} | "
                     f"{saved / 1e6:.0f} | {saved / (dev.intra_node_gbps * 1e9) * 1e3:.2f} | "
                     f"{saved / (dev.inter_node_gbps * 1e9) * 1e3:.2f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--append", metavar="FILE", help="append the section to FILE (RESULTS.md)")
    ap.add_argument("--parts",
                    default="tests,lce,kernels,attention,moe,moe-float8,moe-halves,mla,mla-latent,"
                            "memory",
                    help="comma-separated subset of tests, lce, kernels, attention, moe, "
                         "moe-float8, moe-halves, mla, mla-latent, memory, microbatch, "
                         "microbatch-compile")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("the GPU check kit needs a CUDA GPU")
    t0 = time.perf_counter()
    today = datetime.date.today().isoformat()
    out = [f"## GPU check kit, {today}", "", *environment(), ""]
    sink = open(args.append, "a") if args.append else None  # noqa: SIM115 - written part by part

    def flush(lines: list[str]) -> None:  # each part lands as it ends: a cut-off run keeps them
        print("\n".join(lines), flush=True)
        if sink:
            sink.write("\n".join(lines) + "\n")
            sink.flush()

    flush(["", *out])
    out = []
    parts = {"tests": ("GPU tests", gpu_tests),
             "lce": ("Fused linear + cross-entropy: shapes, dtypes, tunings", lce_sweep),
             "kernels": ("Kernels and the 1b step", kernel_bench),
             "memory": ("1b memory: planned vs measured (one rank, bf16, seq 2048, microbatch 2 × 4)",
                        memory_check),
             "moe": ("MoE experts: grouped GEMM vs the per-expert loop", moe_gemm),
             "moe-float8": ("MoE experts: float8 grouped GEMMs (torchao) vs bf16", moe_float8),
             "moe-halves": ("An MoE block's exchanges whole or in two halves (one GPU)",
                            moe_halves),
             "mla": ("Multi-head Latent Attention's attention: SDPA backends", mla_attention),
             "mla-latent": ("Context parallel's latent ring: expansion against bytes saved",
                            mla_latent),
             "attention": ("Context parallel's attention block with its log-sum-exp",
                           attention_lse),
             "microbatch": ("1b's step by microbatch size", microbatch_sweep),
             "microbatch-compile": ("1b's step by microbatch size, model.compile",
                                    lambda: microbatch_sweep("auto+compile"))}
    for title, part in (parts[p] for p in args.parts.split(",")):
        out += [f"### {title}", ""]
        try:
            out += part()
        except Exception as err:  # noqa: BLE001 - a failed part is reported, the rest still run
            out += [f"failed: {type(err).__name__}: {err}"]
        out.append("")
        flush(out)
        out = []
    flush([f"(kit wall time {time.perf_counter() - t0:.0f} s)"])
    if sink:
        sink.close()


if __name__ == "__main__":
    main()
