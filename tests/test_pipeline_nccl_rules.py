"""NCCL's rules emulated on gloo, for the pipeline executor: ``batch_isend_irecv`` on NCCL
returns one coalesced handle for a whole batch (gloo returns one per op). Two real processes
run the same step with gloo's handles and with one handle per batch; the losses and every
gradient must be identical. (Interleaved 1F1B is not here: waiting for a batch's sends with
its receives deadlocks the executor's current send/receive placement for it — issue #15.)"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from trainmesh.parallel.pipeline.executor import P2PSpec, PipelineExecutor
from trainmesh.parallel.pipeline.ir import PipeShape
from trainmesh.parallel.pipeline.schedules import build_schedule

PP, VPP, M, MB, DIM = 2, 1, 4, 2, 8


class _Coalesced:
    """One handle for a batch, as NCCL gives: waiting on it waits for every op."""

    def __init__(self, works):
        self.works = works

    def wait(self, timeout=None):
        for w in self.works:
            w.wait(timeout)
        return True


class _Last(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.lin(x), y)


def _stages(rank: int) -> dict[int, nn.Module]:
    out = {}
    for s in PipeShape(PP, VPP, M).stages_of(rank):
        torch.manual_seed(s)
        out[s] = _Last() if s == PP * VPP - 1 else nn.Linear(DIM, DIM)
    return out


def _worker(rank: int, port: int, coalesce: bool, schedule: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=PP)
    if coalesce:
        plain = dist.batch_isend_irecv
        dist.batch_isend_irecv = lambda ops: [_Coalesced(plain(ops))]
    torch.manual_seed(100)
    mbs = [(torch.randn(MB, DIM), torch.randn(MB, DIM)) for _ in range(M)]
    shape = PipeShape(PP, VPP, M)
    stages = _stages(rank)
    p2p = P2PSpec(dist.group.WORLD, [0, 1], (MB, DIM), torch.float32, torch.device("cpu"))
    loss = PipelineExecutor(shape, build_schedule(schedule, PP, VPP, M)[rank], stages,
                            p2p).step(mbs)
    results[rank] = (float(loss), {f"{s}.{k}": p.grad.clone() for s, m in stages.items()
                                   for k, p in m.named_parameters()})
    dist.destroy_process_group()


def _run(coalesce: bool, schedule: str) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Manager().dict()
    procs = [ctx.Process(target=_worker, args=(r, port, coalesce, schedule, results)) for r in range(PP)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        if p.exitcode is None:
            p.kill()
        assert p.exitcode == 0, "a rank failed or hung"
    return dict(results)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_one_coalesced_handle_per_batch_gives_the_same_step(schedule):
    per_op, coalesced = _run(False, schedule), _run(True, schedule)
    for rank in range(PP):
        assert per_op[rank][0] == coalesced[rank][0]
        for k, g in per_op[rank][1].items():
            assert torch.equal(g, coalesced[rank][1][k]), k
