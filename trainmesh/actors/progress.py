"""What a rank is doing, readable from another thread while it does it, and the test-only fault
hook that places a fault at an exact point of a step.

A rank bumps a counter per phase (forward and backward per microbatch or pipeline action, the
optimizer step, a checkpoint save); the controller reads them through the rank's control path
(``RankWorker.progress``) while a step runs, to tell a rank that stopped (hung) from ranks
waiting for it.

``TRAINMESH_FAULT`` (tests only; nothing happens unless it is set) reads
``KIND@rank=R,step=S,phase=P,marker=PATH``: rank R, entering phase P of step S (counted from 0),
``hang``s (the whole process stops, as a frozen node would: alive to Ray, silent to its peers),
``raise``s, or ``exit``s (the process dies). It fires once per job: the marker file is created
when it fires and a fault whose marker exists never fires again (a restarted rank reads the
same variable).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

PHASES = ("forward", "backward", "optimizer", "save")
FAULT_ENV = "TRAINMESH_FAULT"
FAULT_KINDS = ("hang", "raise", "exit")


class InjectedFault(RuntimeError):
    pass


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    phase: str
    marker: str

    @classmethod
    def parse(cls, text: str) -> Fault:
        try:
            kind, rest = text.split("@", 1)
            f = dict(kv.split("=", 1) for kv in rest.split(","))
            fault = cls(kind, int(f["rank"]), int(f["step"]), f["phase"], f["marker"])
        except (ValueError, KeyError) as err:
            raise ValueError(f"{FAULT_ENV}={text!r}: expected "
                             "KIND@rank=R,step=S,phase=P,marker=PATH") from err
        if kind not in FAULT_KINDS or fault.phase not in PHASES:
            raise ValueError(f"{FAULT_ENV}={text!r}: kind one of {FAULT_KINDS}, phase one of {PHASES}")
        return fault

    def fire(self) -> None:
        try:
            fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return  # fired already in this job
        os.close(fd)
        if self.kind == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif self.kind == "exit":
            os._exit(17)
        raise InjectedFault(f"injected fault at step {self.step}, {self.phase}")


class Progress:
    def __init__(self, rank: int):
        self.counts = dict.fromkeys(PHASES, 0)
        self.phase, self.step, self.since = "idle", 0, time.monotonic()
        text = os.environ.get(FAULT_ENV)
        fault = Fault.parse(text) if text else None
        self._fault = fault if fault is not None and fault.rank == rank else None

    def mark(self, phase: str) -> None:
        self.counts[phase] += 1
        self.phase, self.since = phase, time.monotonic()
        f = self._fault
        if f is not None and f.step == self.step and f.phase == phase:
            f.fire()

    def snapshot(self) -> dict:
        return {"step": self.step, "phase": self.phase, "counts": dict(self.counts),
                "idle_s": round(time.monotonic() - self.since, 3)}
