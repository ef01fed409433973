"""NCCL's rules emulated on gloo (``testing/nccl_rules.py``: one handle per batch, one stream
per rank, a send done only once its receive is posted, FIFO matching per pair, tags ignored),
for the pipeline executor in two real processes. Every schedule kind runs one step with gloo's
own semantics and under NCCL's rules; both give the single-process reference's loss and
gradients. The executor's old placement (receives next to their compute) deadlocks under the
rules — as it would on GPUs — and the layer reports it, so the emulation is not vacuous."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_pipeline_schedules import _placed_next_to_compute
from tiers import full
from torch import nn

from trainmesh.parallel.pipeline.executor import P2PSpec, PipelineExecutor
from trainmesh.parallel.pipeline.ir import Op
from trainmesh.parallel.pipeline.schedules import build_schedule, pipe_shape
from trainmesh.testing.nccl_rules import NcclRulesP2P

PP, M, MB, DIM = 2, 4, 2, 8
CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zbv", 2),
         ("dualpipev", 2)]


class _Last(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x, y):
        return nn.functional.mse_loss(torch.tanh(self.lin(x)), y)


def _stage(s: int, num_stages: int) -> nn.Module:
    torch.manual_seed(s)
    return _Last() if s == num_stages - 1 else nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())


def _data():
    torch.manual_seed(100)
    return [(torch.randn(MB, DIM), torch.randn(MB, DIM)) for _ in range(M)]


def _grads(stages: dict[int, nn.Module]) -> dict[str, torch.Tensor]:
    return {f"{s}.{k}": p.grad.clone() for s, m in stages.items() for k, p in m.named_parameters()}


def _reference(v: int) -> tuple[float, dict[str, torch.Tensor]]:
    stages = {s: _stage(s, PP * v) for s in range(PP * v)}
    total = 0.0
    for x, y in _data():
        h = x
        for s in range(PP * v - 1):
            h = stages[s](h)
        loss = stages[PP * v - 1](h, y) / M
        loss.backward()
        total += float(loss.detach())
    return total, _grads(stages)


def _worker(rank: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=PP)
    for kind, v in CASES:
        shape = pipe_shape(kind, PP, v, M)
        for mode in ("gloo", "nccl-rules"):
            stages = {s: _stage(s, PP * v) for s in shape.stages_of(rank)}
            post = NcclRulesP2P(timedelta(seconds=60)) if mode == "nccl-rules" else dist.batch_isend_irecv
            p2p = P2PSpec(dist.group.WORLD, [0, 1], (MB, DIM), torch.float32, torch.device("cpu"),
                          post=post)
            loss = PipelineExecutor(shape, build_schedule(kind, PP, v, M)[rank], stages, p2p).step(_data())
            results[(rank, kind, mode)] = (float(loss), _grads(stages))
    # FIFO per pair, tags ignored: rank 1 posts its receives in the other order than rank 0
    # sent, naming each by the other's tag; gloo matches tags, the rules match order.
    for mode, post in (("gloo", dist.batch_isend_irecv), ("nccl-rules", NcclRulesP2P(timedelta(seconds=30)))):
        if rank == 0:
            works = [w for v in (1.0, 2.0) for w in post([dist.P2POp(
                dist.isend, torch.full((3,), v), 1, dist.group.WORLD, tag=int(v))])]
        else:
            bufs = [torch.zeros(3), torch.zeros(3)]
            works = [w for buf, tag in zip(bufs, (2, 1), strict=True) for w in post([dist.P2POp(
                dist.irecv, buf, 0, dist.group.WORLD, tag=tag)])]
        for w in works:
            w.wait(timedelta(seconds=30))
        if rank == 1:
            results[(1, "fifo", mode)] = [float(b[0]) for b in bufs]
    # The old placement under the rules: both ranks block (the layer's timeout says so).
    shape = pipe_shape("interleaved-1f1b", PP, 2, M)
    compute = [[a for a in r if a.op in (Op.FORWARD, Op.BACKWARD)]
               for r in build_schedule("interleaved-1f1b", PP, 2, M)]
    old = _placed_next_to_compute(shape, compute)
    stages = {s: _stage(s, PP * 2) for s in shape.stages_of(rank)}
    p2p = P2PSpec(dist.group.WORLD, [0, 1], (MB, DIM), torch.float32, torch.device("cpu"),
                  timeout=timedelta(seconds=2), post=NcclRulesP2P(timedelta(seconds=2)))
    try:
        PipelineExecutor(shape, old[rank], stages, p2p).step(_data())
        results[(rank, "old", "nccl-rules")] = "ran"
    except RuntimeError as err:
        results[(rank, "old", "nccl-rules")] = f"raised: {err}"
    os._exit(0)  # the deadlocked ops are still posted: leave without tearing the group down


@full("every schedule run on real gloo ranks under NCCL's rules, ~15 s on the Ray tests' worker: "
      "make test keeps every schedule's deadlock check under the rules model "
      "(test_pipeline_schedules) and the pipeline parity cases")
@pytest.mark.timed  # (its own time bounds: with the Ray tests under `make test-all`)
@pytest.mark.timeout(240)
def test_every_schedule_gives_the_reference_step_under_nccl_rules_and_the_old_placement_hangs():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Manager().dict()
    procs = [ctx.Process(target=_worker, args=(r, port, results)) for r in range(PP)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
        if p.exitcode is None:
            p.kill()
        assert p.exitcode == 0, "a rank failed or hung"
    for kind, v in CASES:
        want_loss, want_grads = _reference(v)
        last = pipe_shape(kind, PP, v, M).rank_of(PP * v - 1)
        for mode in ("gloo", "nccl-rules"):
            loss = results[(last, kind, mode)][0]
            assert loss == pytest.approx(want_loss, rel=1e-6), (kind, mode)
            got = {**results[(0, kind, mode)][1], **results[(1, kind, mode)][1]}
            assert set(got) == set(want_grads), (kind, mode)
            for k, g in want_grads.items():
                torch.testing.assert_close(got[k], g, rtol=1e-5, atol=1e-7,
                                           msg=lambda m, k=k, kind=kind, mode=mode: f"{kind} {mode} {k}: {m}")
    assert results[(1, "fifo", "gloo")] == [2.0, 1.0]  # by tag
    assert results[(1, "fifo", "nccl-rules")] == [1.0, 2.0]  # in order, as NCCL would
    for rank in range(PP):
        assert results[(rank, "old", "nccl-rules")].startswith("raised"), results[(rank, "old", "nccl-rules")]
