"""``checkpoint.resume: never`` applies at the job's start only: the run starts from its
initialisation, and every recovery of it restores the run's own newest checkpoint (before, a node
lost mid-run restarted such a job from step 0). A directory that holds an earlier run's
checkpoints is refused under it, naming the fix, before any rank starts."""

from __future__ import annotations

import pytest

from trainmesh.cli.loading import load_spec
from trainmesh.controller.launch import run_job
from trainmesh.spec.problems import SpecError

pytestmark = pytest.mark.cluster

ARGS = ["model.preset=tiny", "training.global_batch_size=8", "training.microbatch_size=2",
        "training.seq_len=32", "optimizer.warmup_steps=1", "runtime.device=auto",
        "runtime.cpus_per_rank=0.5", "tracking.enabled=false", "elastic.ready_ranks_per_node=0",
        "elastic.max_restarts=4", "checkpoint.in_memory.every=0", "checkpoint.async_save=false",
        "checkpoint.resume=never", "checkpoint.every=2", "training.steps=6", "parallelism.dp=4"]


@pytest.mark.timeout(400)
def test_a_node_lost_under_resume_never_restores_the_runs_own_checkpoint(tmp_path):
    from servers import assert_reference_losses, run_losing_nodes, simulated_cluster

    with simulated_cluster(2, num_cpus=2, num_gpus=2) as cluster:
        # ranks 2 and 3 on the second node: it goes as step 5 begins, after step 4's checkpoint
        s = run_losing_nodes(cluster, tmp_path, ARGS, ["wait@rank=3,step=4,phase=forward"])
        assert s["status"] == "FINISHED" and s["steps_done"] == 6
        [rec] = s["recoveries"]
        assert rec["restored_from"] == "storage" and rec["step"] == 4, rec
        assert_reference_losses(s, tmp_path)
        # the same directory again under never: it holds this run's checkpoints now
        again = load_spec(None, [*ARGS, f"runtime.output_dir={tmp_path / 'out'}", "training.steps=8"])
        with pytest.raises(SpecError) as err:
            run_job(again, environ={}, show_progress=False)
        [problem] = err.value.problems
        assert problem.path == "checkpoint.resume" and "step 6" in problem.what
        assert "checkpoint.dir" in problem.fix and "checkpoint.resume=auto" in problem.fix
