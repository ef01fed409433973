"""Shared by the interpreter and GPU kernel tests: each kernel against its torch reference,
outputs and every input gradient, under one upstream gradient."""

from __future__ import annotations

import torch

from trainmesh.kernels import kernel_set
from trainmesh.kernels import reference as ref

TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2}}


def check(kernel, reference, *inputs: torch.Tensor, dtype: torch.dtype = torch.float32,
          out_dtype: torch.dtype | None = None, summed_rows: int = 1) -> None:
    """bf16 kernels (float32 inside, one rounding per store) are held to the float32
    reference on the same bf16 values, within bf16 resolution. A 1-D input's gradient is a
    sum over ``summed_rows`` rows: two fp32 summation orders differ by about √rows roundings
    of the terms, so its absolute tolerance grows with √(rows / 64) beyond 64 rows."""
    got_in = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    want_in = [(x.detach().float() if x.is_floating_point() else x).requires_grad_(x.is_floating_point())
               for x in inputs]
    got, want = kernel(*got_in), reference(*want_in)
    assert got.dtype == (out_dtype or dtype) and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, **TOL[dtype])
    upstream = torch.randn(want.shape, generator=torch.Generator().manual_seed(1)).to(want)
    (got * upstream.to(got.dtype)).sum().backward()
    (want * upstream.to(got.dtype).float()).sum().backward()
    for i, (g, w) in enumerate(zip(got_in, want_in, strict=True)):
        if w.grad is not None:
            assert g.grad is not None and g.grad.dtype == dtype, f"input {i}"
            tol = dict(TOL[dtype])
            if g.ndim == 1:
                tol["atol"] *= max(1.0, (summed_rows / 64) ** 0.5)
            torch.testing.assert_close(g.grad.float(), w.grad, **tol,
                                       msg=lambda m, i=i: f"gradient of input {i}: {m}")


def rand(*shape: int, dtype=torch.float32, device="cpu", seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def rms_norm_case(rows_shape, dim, dtype=torch.float32, device="cpu"):
    k = kernel_set("triton")
    x, w = rand(*rows_shape, dim, dtype=dtype, device=device), rand(dim, dtype=dtype, device=device, seed=2)
    check(lambda a, b: k.rms_norm(a, b, 1e-5), lambda a, b: ref.rms_norm(a, b, 1e-5), x, w, dtype=dtype,
          summed_rows=x.numel() // dim)


def swiglu_case(shape, dtype=torch.float32, device="cpu"):
    k = kernel_set("triton")
    g, u = rand(*shape, dtype=dtype, device=device), rand(*shape, dtype=dtype, device=device, seed=3)
    check(k.swiglu, ref.swiglu, g, u, dtype=dtype)


def rope_case(b, t, h, d, dtype=torch.float32, device="cpu", theta=10000.0, scaling=None):
    from trainmesh.models.llama.model import rope_tables

    k = kernel_set("triton")
    cos, sin = (c[:t].to(device) for c in rope_tables(d, t + 3, theta, scaling))
    x = rand(b, t, h, d, dtype=dtype, device=device)
    check(lambda a: k.rope(a, cos, sin), lambda a: ref.rope(a, cos, sin), x, dtype=dtype)


def linear_cross_entropy_case(rows_shape, dim, vocab, dtype=torch.float32, device="cpu", **tuning):
    from trainmesh.kernels.linear_cross_entropy import linear_cross_entropy

    k = kernel_set("triton")
    h = rand(*rows_shape, dim, dtype=dtype, device=device)
    w = rand(vocab, dim, dtype=dtype, device=device, seed=4) * 0.5
    y = torch.randint(0, vocab, rows_shape, generator=torch.Generator().manual_seed(5)).to(device)
    fused = (lambda a, b: linear_cross_entropy(a, b, y, **tuning)) if tuning else (
        lambda a, b: k.linear_cross_entropy(a, b, y))
    check(fused,
          lambda a, b: ref.linear_cross_entropy(a.flatten(0, -2), b, y.flatten()), h, w, dtype=dtype,
          out_dtype=torch.float32)  # the loss is float32 whatever the inputs


def _block_ops(ops, x, w, cos, sin, g, u):
    """What a transformer block asks of the kernels: RMSNorm over the heads' width, RoPE on its
    heads, SwiGLU; the scalar summed in float32 (the gradients reaching the kernels, twice their
    outputs, stay exact in any dtype)."""
    B, T, H, D = x.shape
    h = ops.rms_norm(x.flatten(2), w, 1e-5).view(B, T, H, D)
    return ops.rope(h, cos[:T], sin[:T]).float().square().sum() + ops.swiglu(g, u).float().square().sum()


def compiled_over_shapes_case(device="cpu", backend="inductor", dtype=torch.float32):
    """The kernels inside one torch.compile'd function (one graph: fullgraph), called with a
    second and third head count and sequence length (dynamic shapes, as a mesh re-formed in the
    same process brings): each call's value and gradients equal the same kernels' run eagerly
    on the same inputs, and the float32 references' on the same values (within the dtype's
    rounding, measured against the largest value: in bf16 RMSNorm's backward subtracts two
    terms of the size of the largest gradients, so a small element carries their rounding,
    4.7% of itself on an H100, 2026-11-27). Traced by dynamo, the launches once met a symbolic
    head count in their ``num_warps`` and CUDA could not compile them."""
    k = kernel_set("triton")
    compiled = torch.compile(lambda *a: _block_ops(k, *a), backend=backend, dynamic=True, fullgraph=True)
    for i, (h, t, d) in enumerate([(2, 8, 16), (3, 5, 16), (4, 8, 8)]):
        x, w = rand(2, t, h, d, dtype=dtype, device=device, seed=i), rand(h * d, dtype=dtype, device=device)
        cos, sin = (rand(8, d // 2, dtype=dtype, device=device, seed=s) for s in (10, 11))
        g, u = (rand(t, 24, dtype=dtype, device=device, seed=s) for s in (12, 13))
        inputs = [x, w, cos, sin, g, u]
        wide = [a.float() for a in inputs]
        leaves = [[a[j].requires_grad_() for j in (0, 1, 4, 5)] for a in (inputs, wide)]  # not cos, sin
        want = _block_ops(ref, *wide)
        want_grads = torch.autograd.grad(want, leaves[1])
        eager = _block_ops(k, *inputs)
        eager_grads = torch.autograd.grad(eager, leaves[0])
        got = compiled(*inputs)
        got_grads = torch.autograd.grad(got, leaves[0])
        torch.testing.assert_close(got.float(), want, **TOL[dtype])
        for a, e, b in zip(got_grads, eager_grads, want_grads, strict=True):
            torch.testing.assert_close(a, e, **TOL[dtype])
            assert (a.float() - b).abs().max() <= TOL[dtype]["rtol"] * b.abs().max(), (a, b)
