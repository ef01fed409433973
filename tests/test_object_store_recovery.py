"""A node lost with the checkpoints in a bucket (an S3 endpoint on loopback: moto's server,
``tests/servers.py``): recovered from the survivors' in-memory snapshot or from the bucket. (Its
own module: a simulated cluster ends the shared local Ray instance, so such tests run after the
modules that use it: ``tests/conftest.py``.)"""

from __future__ import annotations

import pytest

from trainmesh.checkpoint.manifest import CheckpointStore


@pytest.mark.cluster
@pytest.mark.timeout(400)
@pytest.mark.parametrize("source", ["memory", "storage"])
def test_a_node_lost_with_checkpoints_on_s3_recovers_from_memory_or_the_bucket(s3_server, tmp_path,
                                                                               source):
    """dp 4 over two simulated nodes, checkpoints every 2 steps in the bucket; the second node
    goes as step 5 begins. With in-memory snapshots the survivors restore step 4 from their
    memory; without, from the bucket. Either way the job ends on 2 ranks with the single
    process's losses, and the bucket holds the run's verified checkpoints."""
    from servers import assert_reference_losses, run_losing_nodes, simulated_cluster

    ckpt = f"s3://{s3_server.bucket()}/ckpt"
    args = ["model.preset=tiny", "training.global_batch_size=8", "training.microbatch_size=2",
            "training.seq_len=32", "optimizer.warmup_steps=1", "runtime.device=auto",
            "runtime.cpus_per_rank=0.5", "tracking.enabled=false", "elastic.ready_ranks_per_node=0",
            "elastic.max_restarts=4", "checkpoint.async_save=false", "checkpoint.every=2",
            "checkpoint.keep_last=2", f"checkpoint.dir={ckpt}", "training.steps=6",
            "parallelism.dp=4", f"checkpoint.in_memory.every={1 if source == 'memory' else 0}"]
    with simulated_cluster(2, num_cpus=2, num_gpus=2) as cluster:
        s = run_losing_nodes(cluster, tmp_path, args, ["wait@rank=3,step=4,phase=forward"],
                             job_env=s3_server.env)
    assert s["status"] == "FINISHED" and s["steps_done"] == 6
    [rec] = s["recoveries"]
    assert rec["restored_from"] == source and rec["step"] == 4, rec
    assert rec["new_mesh"]["world_size"] == 2
    assert_reference_losses(s, tmp_path)
    assert CheckpointStore(ckpt).verified_steps() == [4, 6]
