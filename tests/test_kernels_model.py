"""The model on Triton kernels (interpreted on CPU) trains exactly as on the torch references:
in one process (two steps: gradients after the first, parameters after the second), and on
real ranks where the norms see sequence-parallel DTensors and the fused cross-entropy works on
a vocabulary shard (log-sum-exp combined over the "tp" group) — there one step (its loss, every
gradient, and the parameters after the optimizer), as the interpreter is slow."""

from __future__ import annotations

import os

import pytest
import torch
from reference import reference_run
from test_tensor_parallel import BASE, _close, _parallel_run
from tiers import full

from trainmesh.cli.loading import load_spec
from trainmesh.data.shards import ensure_tiny_corpus
from trainmesh.parallel.dims import ParallelDims

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="these run the kernels in Triton's CPU interpreter")
# Small enough for the interpreter (~3000× slower than compiled): 64 tokens a step.
SMALL = [*BASE, "training.global_batch_size=4", "training.seq_len=16"]


def _spec(tmp_path, kernels: str, extra=()):
    return load_spec(None, [*SMALL, f"model.kernels={kernels}", f"runtime.output_dir={tmp_path}",
                            *extra])


@pytest.mark.timeout(200)
def test_three_steps_on_triton_kernels_equal_the_torch_model(tmp_path):
    data_dir = str(ensure_tiny_corpus(tmp_path / "data"))
    got = reference_run(_spec(tmp_path, "triton"), data_dir, steps=2, grads_after=1, model_loss=True)
    want = reference_run(_spec(tmp_path, "torch"), data_dir, steps=2, grads_after=1)
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want[0]), rtol=1e-5, atol=0)
    _close(got[2], want[2])
    # After AdamW: kernels reassociate float32 sums, and AdamW's 1/sqrt(v) turns a
    # rounding-level gradient element into an update of up to ~lr·0.01 (see below).
    _close(got[1], want[1], rtol=1e-5, atol=5e-5)


CASES = {
    "tp2-sp": (ParallelDims(tp=2), ["parallelism.sequence_parallel=true"]),
    "pp2-tp2": (ParallelDims(pp=2, tp=2), ["schedule.name=1f1b"]),
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", list(CASES))
def test_parallel_run_on_triton_kernels_matches_the_torch_reference(rank_pool, tmp_path, case):
    dims, extra = CASES[case]
    degrees = [f"parallelism.pp={dims.pp}", f"parallelism.tp={dims.tp}", f"parallelism.dp={dims.dp}",
               *extra]
    data_dir = str(ensure_tiny_corpus(tmp_path / "data"))
    losses, grads, params, _ = _parallel_run(rank_pool, _spec(tmp_path, "triton", degrees), dims,
                                             data_dir, steps=1, env={"TRITON_INTERPRET": "1"})
    ref_losses, ref_params, ref_grads = reference_run(_spec(tmp_path, "torch"), data_dir, steps=1,
                                                      grads_after=1)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    _close(grads, ref_grads)
    # Kernels + TP reassociate the float32 sums twice over; AdamW's 1/sqrt(v) turns a
    # rounding-level gradient element into an update of up to ~lr·0.01 (lr = 3e-3 here).
    _close(params, ref_params, rtol=1e-5, atol=5e-5)


@full("inductor compiles every block over the interpreted kernels: ~75 CPU-s, a quarter of "
      "make test's budget; make test keeps the kernels' eager model parity and their compiled "
      "forms over changing shapes (test_kernels)")
def test_compiled_blocks_on_triton_kernels_with_recomputation_equal_the_eager_model(tmp_path):
    """``model.compile``: every block compiled in place (names unchanged), on the Triton kernels
    (interpreted) with full recomputation: an optimizer step gives the eager torch model's
    loss, gradients and parameters. (Composed with ZeRO-3 and a zero-bubble pipeline on ranks:
    test_pipeline_parity's compile case.)"""
    from trainmesh.models.llama.parallelize import apply_activation_checkpointing, apply_compile

    args = ["model.preset=tiny", "training.global_batch_size=4", "training.microbatch_size=2",
            "training.seq_len=32", "optimizer.warmup_steps=1", "runtime.device=cpu"]
    data_dir = str(ensure_tiny_corpus(tmp_path / "data"))
    eager = load_spec(None, [*args, "model.kernels=torch"])
    compiled = load_spec(None, [*args, "model.kernels=triton"])
    names = []

    def prepare(model):
        apply_activation_checkpointing(model, "full")
        apply_compile(model)
        names.extend(n for n, _ in model.named_parameters())

    want, want_params, want_grads = reference_run(eager, data_dir, steps=1, grads_after=1)
    got, got_params, got_grads = reference_run(compiled, data_dir, steps=1, grads_after=1,
                                               prepare=prepare, model_loss=True)
    assert names and set(names) <= set(want_params)  # names unchanged by compiling
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    _close(got_grads, want_grads)
    _close(got_params, want_params, rtol=1e-5, atol=5e-5)  # after AdamW: see test_tensor_parallel
