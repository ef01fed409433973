"""Run one rank's action list: forward/backward of its stages, point-to-point on the "pp" group.

Consecutive communication actions go out as one ``batch_isend_irecv``. A receive is posted
where the lowering put it (as early as it can be) and waited for just before the compute that
uses it; sends are waited for at the end of the step, so both overlap with compute. Whatever
handles a batch comes back with are honoured: one per op (gloo) or one for the whole batch
(NCCL). Messages carry a tag unique to (direction, stage, microbatch), which gloo matches and
NCCL ignores (the lowering posts every pair's messages in the same order on both sides).

A split backward (zero-bubble schedules) runs I — input gradients only, with torch's
``stage_backward_input``, keeping what the weight gradients will need — and later W, with
``stage_backward_weight``; on the first stage, which has no input gradient to send, I does
nothing and W runs the whole backward, as torch.distributed.pipelining does; on a stage whose
backward cannot be split (``unsplit``: the multi-token modules' stage, whose lookup of the
tokens ahead torch's split backward fails on) I runs the whole backward and W nothing. Gradients
accumulate across microbatches; a ZeRO-3 stage reduces its gradients as its ``ZeroPolicy``
says, and under a split backward once, after the stage's last W (DualPipeV, whose drain
alone is split: its last B or W, whichever comes last).

Each action is timed: host clocks on CPU, CUDA events on GPUs (resolved after the step, so the
timeline shows when the GPU ran each action, not when it was launched).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from trainmesh.parallel.clock import DeviceClock
from trainmesh.parallel.pipeline.ir import COMPUTE, Action, Op, PipeShape, message, peer_stage
from trainmesh.parallel.zero import ZeroPolicy

Post = Callable[[list[dist.P2POp]], list[dist.Work]]


@dataclass(frozen=True)
class P2PSpec:
    group: dist.ProcessGroup
    peers: Sequence[int]  # global rank of each pp coordinate (same dp/tp coordinates)
    act_shape: tuple[int, ...]  # (microbatch, local sequence, dim) sent between stages
    dtype: torch.dtype
    device: torch.device
    timeout: timedelta = timedelta(minutes=5)  # a dead peer fails a receive after this
    post: Post = dist.batch_isend_irecv  # how a batch goes out (tests: NCCL's rules on gloo)


class _Clock(DeviceClock):
    """Start/end marks of each action on the rank's timeline (``DeviceClock``)."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.spans: list[tuple[str, object, object]] = []

    def span(self, name: str, start) -> None:
        self.spans.append((name, start, self.mark()))

    def resolve(self) -> list[tuple[str, float, float]]:
        return [(n, self.at(s), self.at(e)) for n, s, e in self.spans]


def _wait(work, timeout: timedelta | None) -> None:
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)


_WHOLE = object()  # a split backward's state where I ran the whole backward (``unsplit``)


def pair_end(actions: Sequence[Action], i: int, pairs: Collection[tuple[int, int]]) -> int | None:
    """Where ``actions[i]`` is a pair's forward (its (stage, microbatch) in ``pairs``): the
    index of its backward, the next compute action, if that needs no message posted between
    the two (its own input's receive: the backward could not start before the forward's end);
    else None (the two run one after the other, as any actions)."""
    a = actions[i]
    if a.op is not Op.FORWARD or (a.stage, a.microbatch) not in pairs:
        return None
    j = i + 1
    while actions[j].op not in COMPUTE:
        j += 1
    b = actions[j]
    if b.op is not Op.BACKWARD:
        raise RuntimeError(f"a pair's second action must be a whole backward, not {b}")
    if any(c.op is Op.RECV_BACKWARD and (c.stage, c.microbatch) == (b.stage, b.microbatch)
           for c in actions[i + 1:j]):
        return None
    return j


def _autograd_backward(out: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Backward from a stage's output: the loss itself (``grad`` None) or with ``grad``."""
    if grad is None:
        out.backward()
    else:
        torch.autograd.backward(out, grad_tensors=grad)


def _rng_state(device: torch.device) -> tuple:
    """The process's random generators that a stage draws from: the CPU's, and the device's."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(device: torch.device, state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


class PipelineExecutor:
    def __init__(self, shape: PipeShape, actions: list[Action], stages: dict[int, nn.Module],
                 p2p: P2PSpec, loss_context: Callable[[], AbstractContextManager] = nullcontext,
                 zero: ZeroPolicy | None = None,
                 on_phase: Callable[[str], None] = lambda phase: None,
                 set_weight: Callable[[float], None] | None = None,
                 unsplit: frozenset[int] = frozenset(),
                 pairs: frozenset[tuple[int, int]] = frozenset(), overlap: bool = False):
        """``stages[s](x)`` runs stage s; the last stage is called as ``stages[s](x, y)`` and
        returns the microbatch's mean loss. ``set_weight`` hears the weight of each compute
        action's microbatch before it runs (a loss the stages add themselves, MoE balancing,
        takes the microbatch's share of the step from its forward). ``unsplit``: stages whose
        split backward runs whole at I (the module docstring). ``pairs``: the (stage,
        microbatch) of the forwards that run as one with the backward after them (DualPipeV);
        with ``overlap`` the two take turns on two threads (``overlap.run_pair``: one's
        all-to-alls in flight while the other computes), else one after the other."""
        self.shape, self.actions, self.stages, self.p2p = shape, actions, stages, p2p
        self.loss_context = loss_context
        self.zero = zero  # the stages' ZeRO-3 policy (None: stages are not sharded)
        self.on_phase = on_phase  # hears "forward" / "backward" as each action begins
        self.set_weight = set_weight
        self.unsplit = unsplit
        self.pairs, self.overlap = pairs, overlap
        # the last step's pairs taking turns, and how often their forwards and backwards
        # handed over (``overlap.run_pair``)
        self.pairs_overlapped, self.handovers = 0, (0, 0)
        last = {}
        for a in actions:
            if a.op in (Op.BACKWARD, Op.WEIGHT):
                last[a.stage] = a.microbatch
        self.last_backward = last  # per stage: the microbatch whose B (or W) ends the step
        self.split = any(a.op is Op.WEIGHT for a in actions)
        if self.split and zero is not None and not zero.keep_gathered:
            raise ValueError("a split backward needs its stages kept gathered through the step "
                             "(ZeroPolicy.keep_gathered): each W uses the forward's parameters")
        # NCCL: a wait with a timeout holds the CPU until the GPU is done (ProcessGroupNCCL
        # polls); without one it only orders the streams, and the watchdog enforces the timeout.
        self._timeout = None if p2p.device.type == "cuda" else p2p.timeout
        self.timeline: list[tuple[str, float, float]] = []

    def step(self, microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]],
             weights: Sequence[float] | None = None) -> torch.Tensor:
        """One optimizer step's forwards and backwards; returns this rank's summed loss, each
        microbatch's mean loss × its weight (default 1/len; 0 on ranks without the last stage).
        Gradients are left in ``.grad``."""
        self._inputs: dict[tuple[int, int], torch.Tensor] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._recv: dict[tuple[Op, int, int], tuple[torch.Tensor, dist.Work]] = {}
        self._split_state: dict[tuple[int, int], tuple] = {}
        self._mbs = microbatches
        n = len(microbatches)
        self._weights = [1.0 / n] * n if weights is None else list(weights)
        if self.split and self.zero is not None:
            for stage in self.stages.values():
                self.zero.before_split_backward(stage)
        clock = _Clock(self.p2p.device)
        loss_sum = torch.zeros((), device=self.p2p.device)
        pending_sends: list[dist.Work] = []
        run = {Op.BACKWARD: self._backward, Op.BACKWARD_INPUT: self._backward_input,
               Op.WEIGHT: self._weight}
        self.pairs_overlapped, self.handovers = 0, (0, 0)
        i = 0
        while i < len(self.actions):
            a = self.actions[i]
            j = pair_end(self.actions, i, self.pairs) if self.overlap else None
            if j is not None:  # F, its sends (and receives), B: on two threads taking turns
                b = self.actions[j]
                self.on_phase("forward")
                self.on_phase("backward")  # (both begin: they take turns from here)
                self._await_input(a)
                self._await_input(b)
                if self.set_weight is not None:  # (a backward takes its share from its forward)
                    self.set_weight(self._weights[a.microbatch])
                start = clock.mark()
                loss, sends = self._pair(a, self.actions[i + 1:j], b)
                self.pairs_overlapped += 1
                loss_sum, pending_sends = loss_sum + loss, pending_sends + sends
                clock.span(f"{a}|{b}", start)
                i = j + 1
                continue
            if a.op in COMPUTE:
                self.on_phase("forward" if a.op is Op.FORWARD else "backward")
                self._await_input(a)  # outside the action's time: waiting is not computing
                if self.set_weight is not None:
                    self.set_weight(self._weights[a.microbatch])
                start = clock.mark()
                if a.op is Op.FORWARD:
                    loss_sum = loss_sum + self._forward(a)
                else:
                    run[a.op](a)
                clock.span(str(a), start)
                i += 1
                continue
            j = i
            while j < len(self.actions) and self.actions[j].op not in COMPUTE:
                j += 1
            start = clock.mark()
            pending_sends += self._communicate(self.actions[i:j])
            clock.span("+".join(str(a) for a in self.actions[i:j]), start)
            i = j
        for work in pending_sends:
            _wait(work, self._timeout)
        self.timeline = clock.resolve()
        return loss_sum

    # -- compute ---------------------------------------------------------------------------
    def _await_input(self, a: Action) -> None:
        """Wait for the message ``a`` computes on, if it comes from another rank (once per
        receive: a gloo receive may not be waited for twice)."""
        op = Op.RECV_FORWARD if a.op is Op.FORWARD else Op.RECV_BACKWARD
        pending = self._recv.get((op, a.stage, a.microbatch))
        if pending is not None:
            _wait(pending[1], self._timeout)

    def _received(self, op: Op, a: Action) -> torch.Tensor:
        return self._recv.pop((op, a.stage, a.microbatch))[0]  # waited for by _await_input

    def _forward(self, a: Action, enter: bool = True) -> torch.Tensor:
        """``enter``: inside the loss context (False: the caller is already)."""
        stage = self.stages[a.stage]
        x, y = self._mbs[a.microbatch]
        key = (a.stage, a.microbatch)
        if a.stage == 0:
            inp = x
        elif (a.stage - 1, a.microbatch) in self._outputs and a.stage - 1 in self.stages:
            inp = self._outputs[(a.stage - 1, a.microbatch)].detach().requires_grad_()
            self._inputs[key] = inp  # the previous stage is on this rank (V-shape turn)
        else:
            inp = self._received(Op.RECV_FORWARD, a).requires_grad_()
            self._inputs[key] = inp
        with self.loss_context() if enter else nullcontext():
            if a.stage == self.shape.num_stages - 1:
                out = stage(inp, y) * self._weights[a.microbatch]
            else:
                out = stage(inp)
        self._outputs[key] = out
        if a.stage == self.shape.num_stages - 1:
            value = out.detach()
            return value.full_tensor() if isinstance(value, DTensor) else value
        return torch.zeros((), device=self.p2p.device)

    def _pair(self, a: Action, between: Sequence[Action], b: Action
              ) -> tuple[torch.Tensor, list[dist.Work]]:
        """Forward ``a``, then the messages ``between`` it and ``b`` posted (as the list places
        them: right after the forward), beside ``b``'s whole backward, on two threads taking
        turns at the MoE exchanges (``overlap.run_pair``). The loss context is entered once
        around both (what it sets holds for both threads: loss_parallel's handlers are global;
        pipeline stages take no thread-local autocast). Returns the forward's loss and its
        sends' handles."""
        from trainmesh.parallel.pipeline.overlap import run_pair

        out, grad = self._backward_inputs(b)

        def forward() -> tuple[torch.Tensor, list[dist.Work]]:
            loss = self._forward(a, enter=False)
            return loss, self._communicate(between) if between else []

        # What each half must find as it left it at every turn: its microbatch's share of the
        # step (a recomputed block's balancing loss reads it) and the random generators (a
        # recomputed block replays its forward's; the forward's own go on as if alone)
        weights = (self._weights[a.microbatch], self._weights[b.microbatch])
        device = self.p2p.device
        saved: list = [None, None]

        def switch(to: int) -> None:
            saved[1 - to] = _rng_state(device)
            if saved[to] is not None:
                _set_rng_state(device, saved[to])
            if self.set_weight is not None and weights[0] != weights[1]:  # (a padding one)
                self.set_weight(weights[to])

        with self.loss_context():
            (loss, sends), handovers = run_pair(forward, lambda: _autograd_backward(out, grad),
                                                switch)
        self.handovers = (self.handovers[0] + handovers[0], self.handovers[1] + handovers[1])
        return loss, sends

    def _output_grad(self, a: Action) -> torch.Tensor | None:
        """The gradient flowing into stage ``a.stage``'s output: None for the loss."""
        if a.stage == self.shape.num_stages - 1:
            return None
        nxt = (a.stage + 1, a.microbatch)
        if nxt in self._inputs and a.stage + 1 in self.stages:  # next stage on this rank
            return self._inputs.pop(nxt).grad
        return self._received(Op.RECV_BACKWARD, a)

    def _backward(self, a: Action) -> None:
        self._whole_backward(*self._backward_inputs(a))

    def _backward_inputs(self, a: Action) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A whole backward's output and the gradient into it, its ZeRO-3 policy set."""
        if self.zero is not None:  # ZeRO-3: when this stage gathers and reduce-scatters
            self.zero.before_backward(self.stages[a.stage],
                                      self.last_backward[a.stage] == a.microbatch)
        return self._outputs.pop((a.stage, a.microbatch)), self._output_grad(a)

    def _whole_backward(self, out: torch.Tensor, grad: torch.Tensor | None) -> None:
        with self.loss_context():
            _autograd_backward(out, grad)

    def _backward_input(self, a: Action) -> None:
        out = self._outputs.pop((a.stage, a.microbatch))
        grad = self._output_grad(a)
        state = None
        if a.stage in self.unsplit:  # the whole backward now, W nothing (the docstring)
            self._whole_backward(out, grad)
            out, grad, state = None, None, _WHOLE
        elif a.stage > 0:  # the first stage has no input gradient: its W does it all
            # (imported here: torch's pipelining package brings in dynamo, ~0.5 s of every
            # rank's start, and only split-backward schedules need it)
            from torch.distributed.pipelining._backward import stage_backward_input

            inp = self._inputs[(a.stage, a.microbatch)]
            with self.loss_context():
                _, state = stage_backward_input([out], None if grad is None else [grad], [inp],
                                                self.stages[a.stage].parameters())
        self._split_state[(a.stage, a.microbatch)] = (out, grad, state)

    def _weight(self, a: Action) -> None:
        stage = self.stages[a.stage]
        out, grad, state = self._split_state.pop((a.stage, a.microbatch))
        with self.loss_context():
            if state is _WHOLE:
                pass  # (run whole at I)
            elif state is None:
                torch.autograd.backward(out, grad_tensors=grad)
            else:
                from torch.distributed.pipelining._backward import stage_backward_weight

                stage_backward_weight(stage.parameters(), state)
        if self.zero is not None and self.last_backward[a.stage] == a.microbatch:
            self.zero.reduce_after_split_backward(stage)

    # -- communication ---------------------------------------------------------------------
    def _tag(self, a: Action) -> int:
        """Unique per message, the same at both ends (gloo matches it; NCCL ignores it)."""
        direction, sender, microbatch = message(a)
        return (sender * self.shape.microbatches + microbatch) * 2 + (direction == "bwd")

    def _communicate(self, batch: Sequence[Action]) -> list[dist.Work]:
        """Post ``batch`` together; keep its receives' handles for the compute that needs them;
        return the handles to wait for at the end of the step."""
        ops, recvs = [], []
        p = self.p2p
        for a in batch:
            peer = p.peers[self.shape.rank_of(peer_stage(a))]
            if a.op is Op.SEND_FORWARD:
                t = self._outputs[(a.stage, a.microbatch)].detach().contiguous()
                ops.append(dist.P2POp(dist.isend, t, peer, p.group, self._tag(a)))
            elif a.op is Op.SEND_BACKWARD:
                t = self._inputs.pop((a.stage, a.microbatch)).grad.contiguous()
                ops.append(dist.P2POp(dist.isend, t, peer, p.group, self._tag(a)))
            else:
                buf = torch.empty(p.act_shape, dtype=p.dtype, device=p.device)
                recvs.append(((a.op, a.stage, a.microbatch), buf, len(ops)))
                ops.append(dist.P2POp(dist.irecv, buf, peer, p.group, self._tag(a)))
        works = p.post(ops) if ops else []
        per_op = len(works) == len(ops)  # else one coalesced handle for the whole batch
        for key, buf, index in recvs:
            self._recv[key] = (buf, works[index] if per_op else works[0])
        if not per_op:
            return list(works)
        return [w for op, w in zip(ops, works, strict=True) if op.op is dist.isend]
