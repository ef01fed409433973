"""Expert parallel (and MoE blocks under TP, PP and ZeRO-3) on real ranks over gloo, against
the single-process model: loss at every step, every full gradient after the first step, every
parameter and balancing bias after the last."""

from __future__ import annotations

import pytest
import torch
from reference import reference_run
from test_tensor_parallel import _close

from trainmesh.cli.loading import load_spec
from trainmesh.data.shards import ensure_tiny_corpus
from trainmesh.parallel.dims import ParallelDims

BASE = ["model.preset=tiny-moe", "training.global_batch_size=8", "training.microbatch_size=1",
        "training.seq_len=32", "optimizer.warmup_steps=1", "tracking.enabled=false",
        "runtime.device=cpu", "runtime.collective_timeout_s=60", "training.steps=3"]

CASES = {  # largest meshes first: the rank pool then only shrinks
    "ep2-tp2-dp2-sp": (ParallelDims(tp=2, dp=2, ep=2), ["parallelism.sequence_parallel=true"]),
    "pp2-ep2-dp2-dense-stage": (ParallelDims(pp=2, dp=2, ep=2), [
        "model.moe.dense_layers=2", "model.moe.balance=bias", "model.moe.bias_update_rate=0.01"]),
    "ep4-dp4": (ParallelDims(dp=4, ep=4), []),
    "ep2-dp4-bias-shared": (ParallelDims(dp=4, ep=2), [
        "model.moe.balance=bias", "model.moe.router=sigmoid", "model.moe.shared_experts=1",
        "model.moe.dense_layers=1", "model.moe.bias_update_rate=0.01"]),
    "ep2-dp2-capacity": (ParallelDims(dp=2, ep=2), ["model.moe.capacity_factor=1.0"]),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_matches_single_process(rank_pool, tmp_path, case):
    dims, extra = CASES[case]
    spec = load_spec(None, [*BASE, f"parallelism.tp={dims.tp}", f"parallelism.dp={dims.dp}",
                            f"parallelism.pp={dims.pp}", f"parallelism.ep={dims.ep}",
                            f"runtime.output_dir={tmp_path}", *extra])
    data_dir = str(ensure_tiny_corpus(tmp_path / "data"))
    group = rank_pool.group_for(spec, dims)
    try:
        group.build(spec.model_dump_json(), dims, data_dir)
        # The experts are split over "ep" (and ZeRO-3 over "edp"); the rest over all of "dp".
        for rank_meshes in group.parameter_meshes():
            for name, dims_here in rank_meshes.items():
                if ".experts." in name:
                    assert dims_here == ("edp", "ep"), (name, dims_here)
                else:
                    assert dims_here[0] == "dp", (name, dims_here)
        losses = [group.train_step()[0]["loss"]]
        grads = group.full_grads()
        losses += [group.train_step()[0]["loss"] for _ in range(2)]
        params = group.full_state()
    finally:
        rank_pool.release(group)
    ref_losses, ref_params, ref_grads = reference_run(spec, data_dir, steps=3, grads_after=1)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    _close(grads, ref_grads)
    _close(params, ref_params, rtol=1e-5, atol=5e-5)
    if spec.model.moe.balance == "bias":  # the bias moved, and equally on every mesh
        bias = {k: v for k, v in params.items() if k.endswith("expert_bias")}
        assert bias and all(v.abs().sum() > 0 for v in bias.values())
