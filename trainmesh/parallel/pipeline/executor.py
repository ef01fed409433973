"""Run one rank's action list: forward/backward of its stages, point-to-point on the "pp" group.

Consecutive communication actions go out as one ``batch_isend_irecv``; a batch's receives are
waited for before the next compute, its sends only at the end of the step, so sends overlap
with compute. Messages carry a tag unique to (direction, stage, microbatch), so ranks need not
post them in the same order. Gradients accumulate across microbatches; a ZeRO-3 stage reduces
its gradients as its ``ZeroPolicy`` says (once per step when kept gathered).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from trainmesh.parallel.pipeline.ir import Action, Op, PipeShape
from trainmesh.parallel.zero import ZeroPolicy


@dataclass(frozen=True)
class P2PSpec:
    group: dist.ProcessGroup
    peers: Sequence[int]  # global rank of each pp coordinate (same dp/tp coordinates)
    act_shape: tuple[int, ...]  # (microbatch, local sequence, dim) sent between stages
    dtype: torch.dtype
    device: torch.device
    timeout: timedelta = timedelta(minutes=5)  # a dead peer fails a receive after this


class PipelineExecutor:
    def __init__(self, shape: PipeShape, actions: list[Action], stages: dict[int, nn.Module],
                 p2p: P2PSpec, loss_context: Callable[[], AbstractContextManager] = nullcontext,
                 zero: ZeroPolicy | None = None,
                 on_phase: Callable[[str], None] = lambda phase: None):
        """``stages[s](x)`` runs stage s; the last stage is called as ``stages[s](x, y)`` and
        returns the microbatch's mean loss."""
        self.shape, self.actions, self.stages, self.p2p = shape, actions, stages, p2p
        self.loss_context = loss_context
        self.zero = zero  # the stages' ZeRO-3 policy (None: stages are not sharded)
        self.on_phase = on_phase  # hears "forward" / "backward" as each action begins
        self.last_backward = {a.stage: a.microbatch for a in actions if a.op is Op.BACKWARD}
        self.timeline: list[tuple[str, float, float]] = []

    def step(self, microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One optimizer step's forwards and backwards; returns this rank's summed loss (0 on
        ranks without the last stage). Gradients are left in ``.grad``."""
        self._inputs: dict[tuple[int, int], torch.Tensor] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._recv: dict[tuple[Op, int, int], torch.Tensor] = {}
        self._mbs = microbatches
        self.timeline = []
        loss_sum = torch.zeros((), device=self.p2p.device)
        pending_sends: list[dist.Work] = []
        i = 0
        while i < len(self.actions):
            a = self.actions[i]
            if a.op in (Op.FORWARD, Op.BACKWARD):
                t0 = time.perf_counter()
                self.on_phase("forward" if a.op is Op.FORWARD else "backward")
                if a.op is Op.FORWARD:
                    loss_sum = loss_sum + self._forward(a)
                else:
                    self._backward(a)
                self.timeline.append((str(a), t0, time.perf_counter()))
                i += 1
                continue
            j = i
            while j < len(self.actions) and self.actions[j].op not in (Op.FORWARD, Op.BACKWARD):
                j += 1
            pending_sends += self._communicate(self.actions[i:j])
            i = j
        for work in pending_sends:
            work.wait(self.p2p.timeout)
        return loss_sum

    # -- compute ---------------------------------------------------------------------------
    def _forward(self, a: Action) -> torch.Tensor:
        stage = self.stages[a.stage]
        x, y = self._mbs[a.microbatch]
        key = (a.stage, a.microbatch)
        if a.stage == 0:
            inp = x
        else:
            inp = self._recv.pop((Op.RECV_FORWARD, a.stage, a.microbatch)).requires_grad_()
            self._inputs[key] = inp
        with self.loss_context():
            if a.stage == self.shape.num_stages - 1:
                out = stage(inp, y) / len(self._mbs)
            else:
                out = stage(inp)
        self._outputs[key] = out
        if a.stage == self.shape.num_stages - 1:
            value = out.detach()
            return value.full_tensor() if isinstance(value, DTensor) else value
        return torch.zeros((), device=self.p2p.device)

    def _backward(self, a: Action) -> None:
        stage = self.stages[a.stage]
        last = self.last_backward[a.stage] == a.microbatch
        if self.zero is not None:  # ZeRO-3: when this stage gathers and reduce-scatters
            self.zero.before_backward(stage, last)
        key = (a.stage, a.microbatch)
        out = self._outputs.pop(key)
        with self.loss_context():
            if a.stage == self.shape.num_stages - 1:
                out.backward()
            else:
                grad = self._recv.pop((Op.RECV_BACKWARD, a.stage, a.microbatch))
                torch.autograd.backward(out, grad_tensors=grad)

    # -- communication ---------------------------------------------------------------------
    def _tag(self, op: Op, stage: int, microbatch: int) -> int:
        # A forward message is named by its sender's stage, a backward one by its receiver's.
        sender_stage = stage if op in (Op.SEND_FORWARD, Op.SEND_BACKWARD) else (
            stage - 1 if op is Op.RECV_FORWARD else stage + 1)
        direction = 0 if op in (Op.SEND_FORWARD, Op.RECV_FORWARD) else 1
        return (sender_stage * self.shape.microbatches + microbatch) * 2 + direction

    def _communicate(self, batch: Sequence[Action]) -> list[dist.Work]:
        """Post ``batch`` together; wait for its receives; return its send handles."""
        ops, t0 = [], time.perf_counter()
        p = self.p2p
        for a in batch:
            tag = self._tag(a.op, a.stage, a.microbatch)
            if a.op is Op.SEND_FORWARD:
                t = self._outputs[(a.stage, a.microbatch)].detach().contiguous()
                ops.append(dist.P2POp(dist.isend, t, p.peers[self.shape.rank_of(a.stage + 1)],
                                      p.group, tag))
            elif a.op is Op.SEND_BACKWARD:
                t = self._inputs.pop((a.stage, a.microbatch)).grad.contiguous()
                ops.append(dist.P2POp(dist.isend, t, p.peers[self.shape.rank_of(a.stage - 1)],
                                      p.group, tag))
            else:
                buf = torch.empty(p.act_shape, dtype=p.dtype, device=p.device)
                src_stage = a.stage - 1 if a.op is Op.RECV_FORWARD else a.stage + 1
                self._recv[(a.op, a.stage, a.microbatch)] = buf
                ops.append(dist.P2POp(dist.irecv, buf, p.peers[self.shape.rank_of(src_stage)],
                                      p.group, tag))
        works = dist.batch_isend_irecv(ops) if ops else []
        sends = []
        if len(works) != len(ops):  # NCCL coalesces a batch into one handle: the batch, its
            for work in works:       # sends too, completes as a whole
                work.wait(p.timeout)
        else:
            for op, work in zip(ops, works, strict=True):
                if op.op is dist.irecv:
                    work.wait(p.timeout)
                else:
                    sends.append(work)
        self.timeline.append(("+".join(str(a) for a in batch), t0, time.perf_counter()))
        return sends
