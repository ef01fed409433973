"""The optimizer's share of a rank's first step after a build or a re-form: DTensor's dispatch
of the step's list ops against the same ops on each parameter's local shard, in one run.

DTensor caches the sharding it works out for an op, per layout; its first call of a list op
(``_fused_adamw_``, ``_foreach_mul_``) works it out for every element, and a re-form clears the
caches (rank_worker._forget_dtensor_caches), so every rank pays it again at the first step of
every formation: a recovery's first step. Measured in one process on torch's fake process group
(a mesh of dp × tp ranks whose collectives do nothing: neither op needs one for these layouts),
for a Llama-shaped parameter list: per layer 4 column-parallel and 3 row-parallel matrices and
2 norm weights, laid out as FSDP2 on dp with TP on tp lays them out, plus the embedding,
output and final norm.

Rows: AdamW's step (torch's fused AdamW on the DTensors; trainmesh's ``ShardwiseAdamW``), the
gradient norm (torch's ``get_total_norm`` on the DTensors; ``engine/step.shard_squares`` on
their local shards, one all-reduce per sharded mesh dim) and the clip's scaling
(``_foreach_mul_`` on the DTensors; on their local shards, as
``engine/step.grad_norm_and_clip`` does), each at its first call and its later ones (median).

    .venv/bin/python bench/first_step.py [--layers 2,8,32] [--mesh 2x2] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from trainmesh.engine.step import ShardwiseAdamW, shard_squares

DIM = 64  # the tensors' size hardly matters: the cost is per element of the list


def parameters(mesh, layers: int) -> list[torch.nn.Parameter]:
    """Local shards (this rank's) of a Llama-shaped list, as DTensors."""
    dp, tp = mesh.shape
    col, row, norm = [Shard(0), Shard(0)], [Shard(0), Shard(1)], [Shard(0), Replicate()]
    shapes = ([(col, (4 * DIM, DIM))] * 4 + [(row, (DIM, 4 * DIM))] * 3 + [(norm, (DIM,))] * 2) * layers
    shapes += [(col, (8 * DIM, DIM)), (col, (8 * DIM, DIM)), (norm, (DIM,))]
    out = []
    for placements, shape in shapes:
        local = list(shape)
        for dim, p in zip(mesh.shape, placements, strict=True):
            if isinstance(p, Shard):
                local[p.dim] //= dim
        t = DTensor.from_local(torch.randn(local), mesh, placements, run_check=False,
                               shape=torch.Size(shape), stride=torch.empty(shape).stride())
        out.append(torch.nn.Parameter(t))
    return out


def timed(fn, repeat: int) -> tuple[float, float]:
    """(first call, median of the next ``repeat``) in seconds."""
    times = []
    for _ in range(repeat + 1):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times[0], statistics.median(times[1:])


def optimizer_step(cls, params: list[torch.nn.Parameter]):
    opt = cls([{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
               {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
              lr=1e-3, fused=True)
    return opt.step


def norm_dtensor(grads):
    return lambda: torch.nn.utils.get_total_norm(grads, foreach=True).full_tensor()


def norm_local(grads):
    return lambda: shard_squares(grads).sqrt()


def clip_dtensor(grads):
    return lambda: torch._foreach_mul_(grads, 0.999)


def clip_local(grads):
    def run():
        with torch.no_grad():
            torch._foreach_mul_([g.to_local() for g in grads], 0.999)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="2,8,32")
    ap.add_argument("--mesh", default="2x2", help="dp x tp")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    dp, tp = (int(x) for x in args.mesh.split("x"))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dp * tp)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    print(f"mesh dp {dp} x tp {tp}, torch {torch.__version__}; first call / later calls (median of {args.repeat})")
    print(f"{'layers':>6} {'params':>6} | {'AdamW on DTensors':>20} {'ShardwiseAdamW':>20} {'first x':>8} | "
          f"{'norm on DTensors':>20} {'norm on shards':>20} {'first x':>8} | "
          f"{'clip on DTensors':>20} {'clip on shards':>20} {'first x':>8}")
    from trainmesh.actors.rank_worker import _forget_dtensor_caches

    for layers in (int(x) for x in args.layers.split(",")):
        row = []
        for make in (lambda ps: optimizer_step(torch.optim.AdamW, ps),
                     lambda ps: optimizer_step(ShardwiseAdamW, ps),
                     lambda ps: norm_dtensor([p.grad for p in ps]),
                     lambda ps: norm_local([p.grad for p in ps]),
                     lambda ps: clip_dtensor([p.grad for p in ps]),
                     lambda ps: clip_local([p.grad for p in ps])):
            _forget_dtensor_caches()  # as a re-form leaves them
            params = parameters(mesh, layers)
            for p in params:  # gradients laid out as their parameters
                p.grad = DTensor.from_local(torch.randn_like(p.to_local()), mesh, p.placements,
                                            run_check=False, shape=p.shape, stride=p.stride())
            row.append(timed(make(params), args.repeat))
        n = len(parameters(mesh, layers))
        cells = [f"{first * 1e3:>9.0f} / {later * 1e3:>5.1f} ms" for first, later in row]
        print(f"{layers:>6} {n:>6} | {cells[0]} {cells[1]} {row[0][0] / row[1][0]:>7.1f}x | "
              f"{cells[2]} {cells[3]} {row[2][0] / row[3][0]:>7.1f}x | "
              f"{cells[4]} {cells[5]} {row[4][0] / row[5][0]:>7.1f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
