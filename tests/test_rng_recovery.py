"""A run with ``model.dropout`` recovered on simulated nodes: the in-memory snapshot holds every
rank's random streams, and the recovery on the same mesh continues them exactly. (Its own
module: a simulated cluster ends the shared local Ray instance, so such tests run after the
modules that use it: ``tests/conftest.py``.)"""

from __future__ import annotations

import pytest
from test_rng import RUN

from trainmesh.cli.loading import load_spec


@pytest.mark.cluster
@pytest.mark.timeout(400)
def test_a_dropout_run_recovered_from_a_memory_snapshot_equals_the_uninterrupted_run(tmp_path):
    """dp 2 over two nodes: rank 1's step 4 raises in its backward (after the forward's draws);
    the recovery on the same mesh restores the step-3 snapshot from memory, the ranks' streams
    with it, and the losses are the uninterrupted run's exactly."""
    from servers import run_losing_nodes, simulated_cluster

    from trainmesh.controller.launch import run_job

    args = [*RUN, "parallelism.dp=2", "training.steps=5", "checkpoint.every=0",
            "checkpoint.in_memory.every=1", "runtime.device=auto", "runtime.cpus_per_rank=0.5",
            "elastic.max_restarts=4"]
    with simulated_cluster(2, num_cpus=1, num_gpus=1):
        plain = run_job(load_spec(None, [*args, f"runtime.output_dir={tmp_path / 'plain'}"]),
                        environ={}, show_progress=False)
        s = run_losing_nodes(None, tmp_path, args, ["raise@rank=1,step=3,phase=backward"], remove=False)
    assert s["status"] == "FINISHED" and s["steps_done"] == 5
    [rec] = s["recoveries"]
    assert rec["restored_from"] == "memory" and rec["step"] == 3, rec
    assert s["losses"] == plain["losses"]
