"""Ranks for the parallel tests: their point-to-point batches posted under NCCL's rules (what
passes on them cannot deadlock or mismatch messages on GPUs), and a function run on every rank's
built engine (to look into it or adjust it); the looks the parity tests take, as such functions.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from trainmesh.actors.rank_worker import RankWorker
from trainmesh.testing.nccl_rules import NcclRulesP2P


class ProbedRank(RankWorker):
    """A rank whose pipeline and ring messages go through ``NcclRulesP2P``, and that runs
    ``execute(fn, *args)``: ``fn(engine, *args)`` (a function Ray ships by value)."""

    p2p = NcclRulesP2P

    def execute(self, fn, *args):
        return fn(self.engine, *args)


def execute(group, fn, *args) -> list:
    """``fn(engine, *args)`` on every rank of ``group`` (a ``RayWorkerGroup`` of ProbedRanks) at
    once, watched for hung ranks as the controller's collective calls are (collective if ``fn``
    is); the results in rank order."""
    return group.watched("execute", fn, *args, timeout_s=group.timeout)


def _merged(parts: list[dict]) -> dict:
    return {k: v for d in parts for k, v in d.items()}


def full_state(group) -> dict[str, torch.Tensor]:
    """Collective: every parameter, unsharded, on CPU, merged over the pipeline stages."""
    return _merged(execute(group, _full_state))


def full_grads(group) -> dict[str, torch.Tensor]:
    """Collective: every parameter's whole gradient as the last step left it, on CPU."""
    return _merged(execute(group, _full_grads))


def parameter_meshes(group) -> list[dict[str, tuple[str, ...]]]:
    """Per rank: each parameter's mesh dimensions (() for a plain tensor): how it is split."""
    return execute(group, _parameter_meshes)


def save_to(group, directory: str) -> None:
    """A raw collective save of the ranks' state to ``directory`` (no manifest)."""
    group.group.call("save", directory, timeout_s=group.timeout * 2)


def _full_state(engine) -> dict[str, torch.Tensor]:
    opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
    return {k: v.detach().cpu().clone()
            for k, v in get_model_state_dict(engine.model, options=opts).items()}


def _full_grads(engine) -> dict[str, torch.Tensor]:
    out: dict[str, Any] = {}
    for name, p in engine.model.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().cpu().clone()
    return out


def _parameter_meshes(engine) -> dict[str, tuple[str, ...]]:
    return {name: tuple(p.device_mesh.mesh_dim_names) if isinstance(p, DTensor) else ()
            for name, p in engine.model.named_parameters()}
