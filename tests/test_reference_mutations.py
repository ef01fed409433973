"""The parity references catch bugs in the pieces every parallel run shares: the step, the
optimizer and the clipping are the project's own on the ranks and stock torch's in the
reference (``tests/reference.py``), so a bug in one of them shows. Each case here plants one
such bug in every rank of a ZeRO-3 run and checks that the comparison the parity tests make
fails (and that it passes without the bug)."""

from __future__ import annotations

import sys

import pytest
import torch
from ray import cloudpickle  # the ranks cannot import this test module: functions go by value
from reference import reference_run
from test_tensor_parallel import BASE

from trainmesh.cli.loading import load_spec
from trainmesh.data.shards import ensure_tiny_corpus
from trainmesh.parallel.dims import ParallelDims
from trainmesh.testing import probes

pytestmark = pytest.mark.cluster


def _wrong_epsilon(engine) -> None:
    """AdamW's epsilon 1e-5 instead of the spec's 1e-8 (a default taken from elsewhere)."""
    for group in engine.optimizer.param_groups:
        group["eps"] = 1e-5


def _clip_per_shard(engine) -> None:
    """Clipping by each rank's own shards' norm, not the global one (a missing all-reduce)."""
    from torch.distributed.tensor import DTensor

    from trainmesh.engine import step

    def per_shard(params, max_norm, across=None, uncounted=()):
        local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
        total = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in local])))
        coef = max_norm / (total + 1e-6)
        if max_norm > 0 and coef < 1.0:
            with torch.no_grad():
                torch._foreach_mul_(local, coef)
        return total

    step._shared_clip = step.grad_norm_and_clip
    step.grad_norm_and_clip = per_shard


def _unplant(engine) -> None:
    from trainmesh.engine import step

    step.grad_norm_and_clip = getattr(step, "_shared_clip", step.grad_norm_and_clip)


def _run(pool, spec, dims: ParallelDims, data_dir: str, plant) -> tuple[list[float], dict]:
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    group = pool.group_for(spec, dims)
    try:
        group.build(spec.model_dump_json(), dims, data_dir)
        if plant is not None:
            probes.execute(group, plant)
        try:
            losses = [group.train_step()[0]["loss"] for _ in range(3)]
            return losses, probes.full_state(group)
        finally:
            probes.execute(group, _unplant)
    finally:
        pool.release(group)


def _matches(got: tuple[list[float], dict], want: tuple[list[float], dict]) -> bool:
    """The parity tests' comparison (losses to 1e-5, parameters to 1e-5 / 5e-5)."""
    try:
        torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want[0]), rtol=1e-5, atol=0)
        for name, value in want[1].items():
            torch.testing.assert_close(got[1][name], value, rtol=1e-5, atol=5e-5)
    except AssertionError:
        return False
    return True


@pytest.mark.timeout(300)
@pytest.mark.parametrize("bug", [None, _wrong_epsilon, _clip_per_shard],
                         ids=["none", "optimizer-epsilon", "clip-per-shard"])
def test_a_bug_in_the_shared_step_fails_the_parity_comparison(rank_pool, tmp_path, bug):
    dims = ParallelDims(dp=2)
    # a clip that bites at every step (the tiny model's gradient norm is ~1-3 early on)
    spec = load_spec(None, [*BASE, "parallelism.dp=2", "optimizer.grad_clip=0.5",
                            f"runtime.output_dir={tmp_path}"])
    data_dir = str(ensure_tiny_corpus(tmp_path / "data"))
    want = reference_run(spec, data_dir, steps=3)
    got = _run(rank_pool, spec, dims, data_dir, bug)
    assert _matches(got, want) is (bug is None)
