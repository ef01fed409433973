"""What one rank trains: its model part wrapped for the mesh, optimizer, data, checkpoint IO.

No Ray here: :class:`trainmesh.actors.rank_worker.RankWorker` hosts an Engine inside an actor.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from trainmesh.actors.step import StepStats, build_lr_scheduler, build_optimizer, train_step
from trainmesh.checkpoint import dcp_io
from trainmesh.data.dataset import TokenDataset
from trainmesh.data.shards import read_tokens
from trainmesh.jobs.spec import JobSpec
from trainmesh.models.llama.model import Llama, LlamaArgs
from trainmesh.models.llama.parallelize import apply_activation_checkpointing, apply_tensor_parallel
from trainmesh.parallel.dims import Axis
from trainmesh.parallel.mesh import Mesh
from trainmesh.parallel.zero import apply_zero3


def build_model(spec: JobSpec, device: torch.device) -> Llama:
    """The whole single-device model, initialised from ``training.seed``."""
    model = Llama(LlamaArgs.from_config(spec.model))
    model.init_weights(spec.training.seed)
    return model.to(device)


class Engine:
    """Model + optimizer + data for one rank of ``mesh``."""

    def __init__(self, spec: JobSpec, mesh: Mesh, data_dir: str, device: torch.device):
        self.spec, self.mesh, self.device = spec, mesh, device
        self.model = build_model(spec, device)
        self.loss_context = contextlib.nullcontext
        if mesh.size(Axis.TP) > 1:
            apply_tensor_parallel(self.model, mesh[Axis.TP], spec.parallelism.sequence_parallel)
            self.loss_context = loss_parallel
        ac = spec.activation_checkpoint
        apply_activation_checkpointing(self.model, ac.mode, ac.stride)
        self.model = apply_zero3(self.model, mesh[Axis.DP], getattr(torch, spec.training.dtype))
        self.optimizer = build_optimizer(self.model, spec.optimizer)
        self.scheduler = build_lr_scheduler(self.optimizer, spec.optimizer, spec.training.steps)
        self.dataset = TokenDataset(read_tokens(data_dir), spec.training.seq_len)
        self.step = 0  # optimizer steps done

    def train_step(self) -> StepStats:
        tr = self.spec.training
        mbs = self.dataset.microbatches(tr.seed, self.step, tr.global_batch_size,
                                        self.mesh.coord(Axis.DP), self.mesh.size(Axis.DP),
                                        tr.microbatch_size)
        mbs = [(x.to(self.device), y.to(self.device)) for x, y in mbs]
        stats = train_step(self.model, self.optimizer, self.scheduler, mbs,
                           self.spec.optimizer.grad_clip, self.model.set_requires_gradient_sync,
                           self.loss_context)
        self.step += 1
        return StepStats(loss=self._dp_mean(stats.loss), grad_norm=stats.grad_norm, lr=stats.lr,
                         tokens=stats.tokens)

    def _dp_mean(self, value: float) -> float:
        if self.mesh.size(Axis.DP) == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.mesh[Axis.DP].get_group())
        return float(t.item()) / self.mesh.size(Axis.DP)

    def save(self, directory: str) -> None:
        dcp_io.save(directory, self.model, self.optimizer)

    def load(self, directory: str, step: int, rng_state: torch.Tensor | None) -> None:
        """Restore model + optimizer shards, then the schedule position and RNG."""
        dcp_io.load(directory, self.model, self.optimizer)
        self.step = step
        self.scheduler.last_epoch = step
        for group, base, fn in zip(self.optimizer.param_groups, self.scheduler.base_lrs,
                                   self.scheduler.lr_lambdas, strict=True):
            group["lr"] = base * fn(step)
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        if rng_state is not None:
            torch.random.set_rng_state(rng_state)

    def full_state(self) -> dict[str, torch.Tensor]:
        return dcp_io.full_model_state(self.model)

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Collective: every parameter's whole gradient (as left by the last step), on CPU."""
        out = {}
        for name, p in self.model.named_parameters():
            g = p.grad
            out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().cpu().clone()
        return out
