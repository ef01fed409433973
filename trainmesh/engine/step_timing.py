"""Where one rank's step goes: the step's phases on its ``DeviceClock`` (data, forward and
backward, the optimizer, the loss's mean), the communication waits its blocks log
(``WaitLog``: context parallel's ring, the MoE blocks' all-to-alls), the blocks' own forward
compute, and the breakdown a step reports (``Engine.train_step``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from trainmesh.engine.memory import peak_process_bytes
from trainmesh.parallel.clock import DeviceClock, WaitLog


class StepClock:
    """Where one rank's step goes, on the rank's ``DeviceClock``: device time between the
    host's phase boundaries on CUDA (events, resolved once the step's loss has reached the
    host), the host clock on CPU. ``phase`` passes a step's phases on (progress) and notes
    when the optimizer starts; ``lap`` closes a span."""

    def __init__(self, device: torch.device, on_phase: Callable[[str], None]):
        self.device, self.on_phase = device, on_phase
        self.clock = DeviceClock(device)
        self.t0 = self.last = self.clock.origin
        self.spans: dict[str, list[tuple[object, object]]] = {}
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def phase(self, name: str) -> None:
        if name == "optimizer":
            now = self.clock.mark()
            self.spans["forward_backward"] = [(self.last, now)]
            self.last = now
        self.on_phase(name)

    def lap(self, name: str) -> None:
        now = self.clock.mark()
        self.spans.setdefault(name, []).append((self.last, now))
        self.last = now

    def seconds(self, name: str) -> float:
        return sum(self.clock.seconds(a, b) for a, b in self.spans.get(name, ()))

    def breakdown(self, ring_s: float, a2a_s: float, bubble_s: float, forward_s: float
                  ) -> dict[str, float]:
        """Seconds: the step; data wait; exposed communication that is measured (context
        parallel's blocked waits, the MoE blocks' waits on their all-to-alls — ``a2a_s``,
        forward, backward and recomputation —, the loss's mean over the replicas); the
        pipeline's bubble;
        compute, the rest (it includes what ZeRO-3's gathers and reduce-scatters expose inside
        forward and backward, which these marks cannot tell from compute); the blocks' own
        forward compute, which they can (``_ForwardTimer``); the optimizer; peak memory."""
        total = self.clock.seconds(self.t0, self.last)
        data = self.seconds("data")
        comm = ring_s + a2a_s + self.seconds("loss")
        out = {"step_s": total, "data_s": data, "comm_s": comm, "a2a_s": a2a_s,
               "bubble_s": bubble_s,
               "compute_s": max(0.0, total - data - comm - bubble_s),
               "forward_s": forward_s, "optimizer_s": self.seconds("optimizer")}
        if self.device.type == "cuda":
            out["memory_allocated_peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            out["memory_reserved_peak_gib"] = torch.cuda.max_memory_reserved(self.device) / 2**30
            try:
                out["gpu_utilization"] = float(torch.cuda.utilization(self.device))
            except Exception:  # noqa: BLE001 - the driver may not say (no NVML)
                pass
        else:
            out["memory_peak_gib"] = peak_process_bytes(self.device) / 2**30
        return out


class ForwardTimer:
    """The seconds ``blocks`` spend in their own forward, hooked after ZeRO-3's hooks so that
    waiting for a block's all-gather is not counted, less the waits inside it that ``logs``
    hold (context parallel's ring, the MoE blocks' all-to-alls): the compute a slow rank
    shows, where the ranks that wait for it show little. Recomputation in backward is not
    counted (it runs inside the checkpoint, under the hooks' one call). Marks on the step's
    ``DeviceClock``: on a GPU the device's time from a block's first kernel to its last."""

    def __init__(self, blocks, logs: list[WaitLog]):
        self.logs = logs
        self.clock: DeviceClock | None = None
        self._start: dict[int, tuple[object, int]] = {}
        self._spans: list[tuple[object, object, int, int]] = []
        for block in blocks:
            block.register_forward_pre_hook(self._pre)
            block.register_forward_hook(self._post)

    def start(self, clock: DeviceClock | None) -> None:
        """A new step, on ``clock`` (None: stop timing)."""
        self.clock = clock
        self._start.clear()
        self._spans = []

    def _waits(self) -> tuple[int, ...]:
        return tuple(len(log.waits) for log in self.logs)

    def seconds(self) -> float:
        if self.clock is None:
            return 0.0
        total = 0.0
        for a, b, w0, w1 in self._spans:
            total += self.clock.seconds(a, b)
            for log, since, until in zip(self.logs, w0, w1, strict=True):
                if until > since:
                    total -= log.waited_s(since, until)
        return total

    @torch.compiler.disable  # a compiled block: the hooks stay outside its graph
    def _pre(self, module, args) -> None:
        if self.clock is not None:
            self._start[id(module)] = (self.clock.mark(), self._waits())

    @torch.compiler.disable
    def _post(self, module, args, output) -> None:
        start = self._start.pop(id(module), None)
        if start is not None:
            self._spans.append((start[0], self.clock.mark(), start[1], self._waits()))
