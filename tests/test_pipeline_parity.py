"""Pipeline parallel (GPipe, 1F1B, interleaved 1F1B, zero-bubble ZB-H1 and ZBV, DualPipeV) alone and
with TP and ZeRO-3, on real ranks over gloo under NCCL's point-to-point rules (the rank pool's
the rank pool's ProbedRank), against the single-process model."""

from __future__ import annotations

import sys

import pytest
import torch
from ray import cloudpickle  # the ranks cannot import this test module: functions go by value
from reference import reference_grad_norms, reference_run
from test_tensor_parallel import BASE, UNEVEN, _close, _parallel_run, _same_norm
from tiers import cases

from trainmesh.cli.loading import load_spec
from trainmesh.data.shards import ensure_tiny_corpus
from trainmesh.parallel.dims import ParallelDims
from trainmesh.testing import probes

ZB_BATCH = "training.global_batch_size=32"
CASES = {  # largest meshes first: the rank pool then only shrinks
    "3d-pp2-vpp2-tp2-dp2": (ParallelDims(pp=2, dp=2, tp=2),
                            ["schedule.name=interleaved-1f1b", "parallelism.vpp=2",
                             "parallelism.sequence_parallel=true"]),
    # Zero-bubble: split backward (I now, W later), ZeRO-3 reducing after a stage's last W;
    # 8 microbatches per replica, so W's are deferred in the steady state, not only at the end.
    "zb-h1-pp4-dp2": (ParallelDims(pp=4, dp=2), ["schedule.name=zb-h1", ZB_BATCH]),
    "zbv-pp4-dp2": (ParallelDims(pp=4, dp=2), ["schedule.name=zbv", "parallelism.vpp=2",
                                               "model.n_layers=8", ZB_BATCH]),
    # ... DualPipeV under hybrid sharding (2 shard groups of 2 replicas): a stage whose last
    # backward is a W (the drain's split ones) still all-reduces across the groups
    "dualpipev-pp2-dp4-hsdp2": (ParallelDims(pp=2, dp=4), [
        "schedule.name=dualpipev", "parallelism.vpp=2", "parallelism.dp_replicate=2",
        ZB_BATCH]),
    "zbv-pp2-tp2-dp2": (ParallelDims(pp=2, dp=2, tp=2),
                        ["schedule.name=zbv", "parallelism.vpp=2", "parallelism.sequence_parallel=true",
                         ZB_BATCH]),
    # dp 3 over 8 microbatches (shares 3, 3, 2): the short replica's pipeline runs a padding
    # microbatch of weight 0, so its schedule and ZeRO-3's collectives match the others'.
    "pp2-dp3-1f1b-uneven-regather": (ParallelDims(pp=2, dp=3), [
        "schedule.name=1f1b", *UNEVEN, "parallelism.keep_gathered=false"]),
    "pp2-dp3-1f1b-uneven-keep": (ParallelDims(pp=2, dp=3), [
        "schedule.name=1f1b", *UNEVEN, "parallelism.keep_gathered=true"]),
    # ... interleaved, 3 microbatches a replica over pp 2: one group of 3 through both chunks
    "pp2-vpp2-dp3-interleaved-uneven": (ParallelDims(pp=2, dp=3), [
        "schedule.name=interleaved-1f1b", "parallelism.vpp=2", *UNEVEN]),
    # torch.compile per block (regional) with full recomputation, ZeRO-3 over dp and a
    # zero-bubble schedule's split backward (ZBV: two chunks per rank in a V)
    "compile-zbv-pp2-dp2-full-ac": (ParallelDims(pp=2, dp=2), [
        "model.compile=true", "schedule.name=zbv", "parallelism.vpp=2", ZB_BATCH,
        "activation_checkpoint.mode=full"]),
    "pp4-gpipe": (ParallelDims(pp=4), ["schedule.name=gpipe"]),
    "pp4-1f1b": (ParallelDims(pp=4), ["schedule.name=1f1b"]),
    "pp4-vpp2-interleaved": (ParallelDims(pp=4), ["schedule.name=interleaved-1f1b",
                                                  "parallelism.vpp=2", "model.n_layers=8"]),
    "zb-h1-pp2-dp2": (ParallelDims(pp=2, dp=2), ["schedule.name=zb-h1", ZB_BATCH]),
    "zbv-pp2-dp2": (ParallelDims(pp=2, dp=2), ["schedule.name=zbv", "parallelism.vpp=2", ZB_BATCH]),
    # DualPipeV: a V, forwards paired with other microbatches' whole backwards, the drain's
    # backwards split (ZeRO-3 reducing after a stage's last B or W, whichever comes last)
    "dualpipev-pp2-dp2": (ParallelDims(pp=2, dp=2), ["schedule.name=dualpipev",
                                                     "parallelism.vpp=2", ZB_BATCH]),
    # Stages of unequal size: 5 blocks over 2 × 2 interleaved chunks (1, 2, 1, 1), and a pinned
    # split (1 and 3) beside ZeRO-3 (5 blocks over 2 stages, 3 and 2: the checkpoint test below)
    "pp2-vpp2-interleaved-5-blocks": (ParallelDims(pp=2), [
        "schedule.name=interleaved-1f1b", "parallelism.vpp=2", "model.n_layers=5"]),
    "pp2-dp2-zb-h1-pinned-1-3": (ParallelDims(pp=2, dp=2), [
        "schedule.name=zb-h1", ZB_BATCH, "parallelism.stage_layers=[1, 3]"]),
    "pp2-gpipe": (ParallelDims(pp=2), ["schedule.name=gpipe"]),
    "pp2-1f1b": (ParallelDims(pp=2), ["schedule.name=1f1b"]),
    "pp2-vpp2-interleaved": (ParallelDims(pp=2), ["schedule.name=interleaved-1f1b",
                                                  "parallelism.vpp=2"]),
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", cases(CASES, {
    "pp2-vpp2-interleaved": "the pipeline axis, on the default interleaved 1F1B schedule",
    "zbv-pp2-dp2": "a zero-bubble schedule (split backward), beside ZeRO-3"}))
def test_pipeline_matches_single_process(rank_pool, tmp_path, case):
    dims, extra = CASES[case]
    spec = load_spec(None, [*BASE, f"parallelism.pp={dims.pp}", f"parallelism.tp={dims.tp}",
                            f"parallelism.dp={dims.dp}", f"runtime.output_dir={tmp_path}", *extra])
    data_dir = str(ensure_tiny_corpus(tmp_path / "data"))
    losses, grads, params, norms = _parallel_run(rank_pool, spec, dims, data_dir)
    ref_losses, ref_params, ref_grads = reference_run(spec, data_dir, steps=3, grads_after=1)
    _same_norm(norms, reference_grad_norms(spec, data_dir, steps=3, grads_after=1))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    _close(grads, ref_grads)
    _close(params, ref_params, rtol=1e-5, atol=5e-5)  # after AdamW: see test_tensor_parallel


@pytest.mark.timeout(200)
def test_a_rank_dying_mid_schedule_makes_the_others_raise(ray_local, tmp_path):
    """Kill the last stage while the first waits on it: the first raises within the
    collective timeout instead of hanging."""
    import time

    import ray

    from trainmesh.controller.ray_group import RayWorkerGroup, placement_for
    from trainmesh.planning.topology import Topology

    dims = ParallelDims(pp=2)
    spec = load_spec(None, [*BASE, "parallelism.pp=2", "runtime.collective_timeout_s=10",
                            f"runtime.output_dir={tmp_path}"])
    group = RayWorkerGroup(spec, dims, placement_for(spec, dims, Topology.uniform(1, 2, "cpu")),
                      {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
    try:
        group.build(spec.model_dump_json(), dims, str(ensure_tiny_corpus(tmp_path / "data")))
        first, last = group.group.workers
        ref = first.train_step.remote()
        ray.kill(last)
        t0 = time.monotonic()
        with pytest.raises(ray.exceptions.RayTaskError):
            ray.get(ref, timeout=60)
        assert time.monotonic() - t0 < 30
    finally:
        group.shutdown()


@pytest.mark.timeout(300)
def test_a_checkpoint_of_one_split_restores_on_another_with_the_same_losses(rank_pool, tmp_path):
    """5 blocks: saved at pp 2 split 3 + 2 (the default), restored at pp 2 split 1 + 4
    (pinned): checkpoints name blocks by their global index, so each rank reads the blocks its
    stage now holds, and the losses and parameters are the single process's."""
    from test_tensor_parallel import resumed_elsewhere

    from trainmesh.models.llama.model_math import stage_split

    args = [*BASE, "model.n_layers=5", "parallelism.pp=2", "schedule.name=1f1b",
            f"runtime.output_dir={tmp_path}", "training.steps=4"]
    before = load_spec(None, args)
    after = load_spec(None, [*args, "parallelism.stage_layers=[1, 4]"])
    assert stage_split(5, 2) == [3, 2]

    def holding(blocks):
        def check(group):
            cloudpickle.register_pickle_by_value(sys.modules[__name__])
            assert probes.execute(group, _blocks_held) == blocks
        return check

    resumed_elsewhere(rank_pool, tmp_path, (before, ParallelDims(pp=2)), (after, ParallelDims(pp=2)),
                      check=holding([[0, 1, 2], [3, 4]]), check_after=holding([[0], [1, 2, 3, 4]]))


def _blocks_held(engine) -> list[int]:
    return sorted(int(i) for i in engine.model.layers)
