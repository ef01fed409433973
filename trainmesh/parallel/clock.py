"""One timeline of marks for a rank's step: ``perf_counter`` on CPU; on CUDA, events recorded
on the current stream, turned into seconds after the step (one synchronisation per step), so
that a span is the device's time between two points of the host's program, not the time
the host took to launch it. A mark the device reaches while idle completes as the host
records it: time the device waited for the host (data, a slow launch) lands in the span
that contains it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


class DeviceClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.t0 = time.perf_counter()
        self.origin = self.mark()
        self._synced = False

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._synced = False
        return event

    def sync(self) -> None:
        """Wait until the device has reached every mark (CUDA; nothing on CPU)."""
        if self.cuda and not self._synced:
            torch.cuda.synchronize()
            self._synced = True

    def at(self, mark) -> float:
        """A mark as seconds on the host's ``perf_counter`` scale (after ``sync``)."""
        if not self.cuda:
            return mark
        self.sync()
        return self.t0 + self.origin.elapsed_time(mark) / 1e3

    def seconds(self, start, end) -> float:
        return self.at(end) - self.at(start)


@dataclass(kw_only=True)
class WaitLog:
    """Where a rank was blocked on communication this step (the exposed part): marks on
    ``clock``, the step's DeviceClock (on a GPU the compute stream's wait for the transfer,
    which the host does not see), or host times while no step set one."""

    clock: DeviceClock | None = None
    waits: list = field(default_factory=list)

    def timed(self, fn: Callable, *args, **kwargs):
        """``fn(*args, **kwargs)``, its time kept in ``waits``."""
        mark = self.clock.mark if self.clock is not None else time.perf_counter
        start = mark()
        try:
            return fn(*args, **kwargs)
        finally:
            self.waits.append((start, mark()))

    def start(self, clock: DeviceClock | None) -> None:
        """A new step, its waits marked on ``clock``."""
        self.clock, self.waits = clock, []

    def waited_s(self, since: int = 0, until: int | None = None) -> float:
        """Seconds blocked in ``waits[since:until]`` (resolving a GPU's marks waits for it)."""
        spans = self.waits[since:until]
        if self.clock is None:
            return sum(b - a for a, b in spans)
        return sum(self.clock.seconds(a, b) for a, b in spans)
