"""Triton kernels under TRITON_INTERPRET=1 (set in conftest) against their torch references:
outputs and every gradient, float32 and bf16, shapes with non-powers of two and single rows."""

from __future__ import annotations

import os

import pytest
import torch
from kernel_cases import (
    compiled_over_shapes_case,
    linear_cross_entropy_case,
    rand,
    rms_norm_case,
    rope_case,
    swiglu_case,
)

from trainmesh.kernels import kernel_set, resolve
from trainmesh.kernels import reference as ref
from trainmesh.kernels.linear_cross_entropy import chunk_rows

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="these run the kernels in Triton's CPU interpreter")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "dim"), [((1,), 8), ((3, 5), 37), ((2, 16), 64), ((9,), 100)])
def test_rms_norm(rows, dim, dtype):
    rms_norm_case(rows, dim, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7, 19), (2, 16, 176), (1500,)])
def test_swiglu(shape, dtype):
    swiglu_case(shape, dtype)  # (1500,) spans two 1024-element blocks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("b", "t", "h", "d"), [(1, 1, 1, 2), (2, 5, 3, 12), (2, 16, 4, 16), (1, 7, 2, 10)])
def test_rope(b, t, h, d, dtype):
    rope_case(b, t, h, d, dtype)


def test_rope_with_llama3_scaled_tables():
    """Llama 3.1's scaling changes only the tables the kernel is given: short, medium and long
    wavelengths all present (original context 64 over a head of 32: wavelengths 6.3, 14, 32,
    73, ... against the bounds 16 and 64)."""
    rope_case(2, 16, 2, 32, theta=500000.0, scaling={"factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 64})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "dim", "vocab"), [((1,), 8, 5), ((2, 7), 16, 50), ((3, 11), 24, 1500),
                                                    ((40,), 8, 264), ((3,), 8, 33_000)])
def test_linear_cross_entropy(rows, dim, vocab, dtype):
    # (3,) × 33,000 crosses a 32,768-wide vocabulary block; (40,) × 264 with dim 8 takes
    # several row chunks (the logits of one chunk are CHUNK_FACTOR times the size of h).
    linear_cross_entropy_case(rows, dim, vocab, dtype)


@pytest.mark.parametrize(("factor", "accumulate"), [(1, "native"), (1, "fp32"), (8, "fp32")])
def test_linear_cross_entropy_chunking_and_accumulation(factor, accumulate):
    # The kit's sweep settings: one row per chunk up to the whole batch, the weight's gradient
    # summed over chunks in bf16 or float32.
    linear_cross_entropy_case((40,), 8, 264, torch.bfloat16, factor=factor, accumulate=accumulate)


def test_linear_cross_entropy_under_autocast_and_without_gradients():
    """Under autocast (DDP's lower compute dtype) the fused loss computes in autocast's dtype,
    as the reference's matmul does: the same loss as on inputs cast by hand, float32 gradients
    for float32 parameters; without gradients (evaluation) the same loss from its pass alone."""
    from trainmesh.kernels.linear_cross_entropy import linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    h = torch.randn(40, 8, generator=g, requires_grad=True)
    w = (torch.randn(264, 8, generator=g) * 0.5).requires_grad_()
    y = torch.randint(0, 264, (40,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, w, y)
        ref_loss = ref.linear_cross_entropy(h, w, y)
    loss.backward()
    assert loss == linear_cross_entropy(h.detach().bfloat16(), w.detach().bfloat16(), y)
    assert h.grad.dtype == w.grad.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=0)
    want = linear_cross_entropy(h, w, y).detach()  # float32, with its gradients
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, y), want, rtol=1e-6, atol=0)
        assert linear_cross_entropy(h, w, y, factor=1) == linear_cross_entropy(h, w, y, factor=64)
    with pytest.raises(ValueError, match="accumulate='bf16'; use native or fp32"):
        linear_cross_entropy(h, w, y, accumulate="bf16")


def test_linear_cross_entropy_chunks_rows_so_logits_stay_small():
    assert chunk_rows(40, 264, 8, factor=1) == 2  # 2 × 264 logits ≈ 40 × 8 inputs
    assert chunk_rows(40, 264, 8, factor=4) == 5  # 5 × 264 ≈ 4 × 40 × 8
    assert chunk_rows(3, 264, 8, factor=4) == 1 and chunk_rows(40, 16, 64) == 40
    assert chunk_rows(8192, 128_256, 4096, factor=1) == 256
    assert chunk_rows(8192, 128_256, 4096, factor=4) == 1024
    assert chunk_rows(3, 5, 64) == 3  # vocabulary smaller than dim: one chunk
    # a long context's chunk is capped: 2^28 logits, as at 8k tokens (2048 rows × 128k)
    assert chunk_rows(8192, 128_256, 4096) == 2048
    assert chunk_rows(131_072, 128_256, 4096) == (1 << 28) // 128_256 == 2092
    assert chunk_rows(40, 264, 8, max_logits=600) == 2  # 2 × 264 ≤ 600


def test_rope_backward_is_in_place_on_a_contiguous_gradient():
    k = kernel_set("triton")
    cos, sin = torch.rand(4, 3), torch.rand(4, 3)
    x = torch.randn(1, 4, 2, 6, requires_grad=True)
    grad = torch.randn(1, 4, 2, 6)
    seen = []
    y = k.rope(x, cos, sin)
    y.register_hook(lambda g: seen.append(g) or g)
    y.backward(grad.clone())
    # The buffer handed to rope's backward now holds the rotated gradient, not the incoming one.
    torch.testing.assert_close(seen[0], x.grad, rtol=0, atol=0)
    assert not torch.allclose(seen[0], grad)


def test_each_launch_is_a_custom_op_whose_fake_matches_it():
    """Under torch.compile every in-block launch is a ``trainmesh::`` op (the graph calls it
    with real tensors); torch's opcheck holds its schema and its fake (shapes, dtypes, strides,
    no aliasing) to the real launch, with static and dynamic shapes."""
    import importlib

    rms, glu, rot = (importlib.import_module(f"trainmesh.kernels.{m}") for m in ("rms_norm", "swiglu", "rope"))
    x2, w, g, u = rand(6, 16), rand(16, seed=1), rand(5, 7, seed=2), rand(5, 7, seed=3)
    _, rstd = rms._forward(x2, w, 1e-5)
    x, cos, sin = rand(2, 3, 2, 8, seed=4), rand(3, 4, seed=5), rand(3, 4, seed=6)
    strided = rand(6, 20, seed=9)[:, :16]  # rows 20 apart, as as_rows allows
    _, strided_rstd = rms._forward(strided, w, 1e-5)
    cases = [(rms._forward, (x2, w, 1e-5)), (rms._forward, (strided, w, 1e-5)),
             (rms._backward, (rand(6, 16, seed=7), x2, w, rstd)),
             (rms._backward, (rand(6, 20, seed=7)[:, :16], strided, w, strided_rstd)),
             (glu._forward, (g, u)), (glu._backward, (rand(5, 7, seed=8), g, u)),
             (rot._rotate, (x, cos, sin, torch.empty_like(x), 1.0)),
             (rot._rotate, (x, cos, sin, x, -1.0))]  # backward: in place on the gradient
    for launch, args in cases:
        assert launch.op._qualname.startswith("trainmesh::")
        torch.library.opcheck(launch.op, args,
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_kernels_compiled_over_changing_head_counts_and_lengths_equal_eager():
    """Dynamo, the fakes and AOT autograd (inductor in the GPU tests): one graph per direction
    in which every launch is its op, and the results equal the references'."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    backend = AotEagerAndRecordGraphs()
    compiled_over_shapes_case(backend=backend)
    forward, backward = ("\n".join(g.code for g in gs) for gs in (backend.fw_graphs, backend.bw_graphs))
    for op in ("rms_norm_fwd", "rope_rotate", "swiglu_fwd"):
        assert f"torch.ops.trainmesh.{op}" in forward, op
    for op in ("rms_norm_bwd", "rope_rotate", "swiglu_bwd"):
        assert f"torch.ops.trainmesh.{op}" in backward, op


def test_kernel_selection():
    assert resolve("auto", "cpu") == "torch" and resolve("torch", "cuda") == "torch"
    assert resolve("triton", "cpu") == "triton"  # TRITON_INTERPRET=1 here
    with pytest.raises(ValueError, match="model.kernels: 'fast'; use one of auto, triton, torch"):
        resolve("fast", "cpu")
    assert kernel_set("torch").linear_cross_entropy is None  # torch: logits through the head
    assert kernel_set("triton").linear_cross_entropy is not None


def test_auto_takes_what_the_kit_measured_faster_per_op_and_torch_elsewhere():
    """auto runs every kernel the kit measured faster than torch on that GPU class (H100 and
    H200: all four in eager); with model.compile only those faster than torch.compile of the
    reference (SwiGLU ties there: torch), the loss still judged against eager (it runs after
    the compiled blocks); on a GPU with no measurement, torch; a mapping overrides single ops,
    and the planner sees the same choice; no entry of the table can pick a path measured
    slower."""
    from trainmesh.spec import kernel_choice as kc

    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):
        assert set(kc.choose("auto", "cuda", name).values()) == {"triton"}
        assert kc.choose("auto", "cuda", name, compiled=True) == {
            "rms_norm": "triton", "swiglu": "torch", "rope": "triton", "linear_cross_entropy": "triton"}
    assert set(kc.choose("auto", "cuda", "NVIDIA B200").values()) == {"torch"}
    # whole model numbers only: a GH200 is not an H200, an RTX A1000 not an A100
    assert [kc.device_class(n) for n in ("NVIDIA GH200 480GB", "NVIDIA RTX A1000 Laptop GPU",
                                         "NVIDIA H200", "h100", "NVIDIA A100-SXM4-80GB")] == [
        None, None, "h200", "h100", "a100"]
    mixed_choice = kc.choose({"linear_cross_entropy": "torch"}, "cuda", "h100")
    assert mixed_choice == {"rms_norm": "triton", "swiglu": "triton", "rope": "triton",
                            "linear_cross_entropy": "torch"}
    for entry in kc.MEASURED.values():
        for compiled, ratios in ((False, entry.speedup), (True, entry.over_compiled)):
            for op, impl in entry.choice(compiled).items():
                r = entry.speedup if compiled and op in kc.OUTSIDE_BLOCKS else ratios
                assert (impl == "triton") == (r.get(op, 0) >= kc.MARGIN > 1), (entry, op)
    name = kc.key(mixed_choice)
    assert kc.parse_key(name) == mixed_choice and name not in ("torch", "triton")
    mixed = kernel_set(name)  # the three kernels, the loss through the head
    from trainmesh.kernels.rms_norm import rms_norm
    from trainmesh.kernels.swiglu import swiglu

    assert mixed.rms_norm.__wrapped__ is rms_norm and mixed.swiglu.__wrapped__ is swiglu
    assert mixed.linear_cross_entropy is None
    # the planner sees the same choice: the logits are materialised only where the loss is torch's
    from trainmesh.planning.memory_model import uses_fused_kernels
    assert uses_fused_kernels("auto", "h100") == set(kc.OPS)
    assert uses_fused_kernels({"linear_cross_entropy": "torch"}, "h100") == {"rms_norm", "swiglu", "rope"}
    assert uses_fused_kernels("auto", "h100", compiled=True) == {"rms_norm", "rope", "linear_cross_entropy"}
    assert uses_fused_kernels("auto", "cpu") == frozenset()


@pytest.mark.parametrize("value", [{"bogus": "triton"}, {"rope": "compiled"}, "fast"])
def test_a_bad_kernel_choice_names_the_field(value):
    from trainmesh.cli.loading import spec_from_dict
    from trainmesh.spec.problems import SpecError

    with pytest.raises(SpecError, match="model.kernels"):
        spec_from_dict({"model": {"preset": "tiny", "kernels": value}})


def test_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch):
    from trainmesh.cli.loading import load_spec
    from trainmesh.controller.preflight import preflight_problems

    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="triton for rms_norm, swiglu, rope, linear_cross_entropy needs"):
        resolve("triton", "cpu")
    spec = load_spec(None, ["model.kernels=triton", "runtime.device=cpu"])
    [problem] = [p for p in preflight_problems(spec) if p.path == "model.kernels"]
    assert "TRITON_INTERPRET=1" in problem.fix
