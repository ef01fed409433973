"""What a rank is doing, readable from another thread while it does it, and the test-only fault
hook that places faults at exact points of a job.

A rank bumps a counter per phase (forward and backward per microbatch or pipeline action, the
optimizer step, a checkpoint save, a background save's write, a restore, a warm re-form); the
controller reads them through the rank's control path (``RankWorker.progress``) while a step
runs, to tell a rank that stopped (hung) from ranks waiting for it.

``TRAINMESH_FAULT`` (tests only; nothing happens unless it is set) holds faults separated by
``;``, each ``KIND@rank=R[,step=S],phase=P,marker=PATH``: the rank that is rank R, entering
phase P at step S (the steps it has done: for a step, the steps before it; for a save or a
restore, the checkpoint's step; any step when left out), then

- ``hang``: the whole process stops (SIGSTOP), as a frozen node would: alive to Ray, silent
  (continued by a SIGCONT, it stops again: only its end ends it);
- ``raise``: the call raises;
- ``exit``: the process is killed (SIGKILL), its node unharmed;
- ``wait``: the rank blocks there (for the test to remove its node at that exact point);
- ``term``: a preemption notice (SIGTERM) to the rank;
- ``hold``: the rank blocks there until a file ``PATH.go`` (PATH: its marker) appears, then
  goes on (for the test to change the cluster at that exact point before the job may go past
  it). Only where the hang watcher judges by silence alone (a restore, a save, a snapshot),
  and for less than the peers' collective timeout; in a step's phase a held rank is found
  hung (~1.5 hang bounds).

Each fault fires once per job: its marker file (holding the rank's node id and pid) is
created when it fires, and a fault whose marker exists never fires again (a restarted rank
reads the same variable).
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass

PHASES = ("forward", "backward", "optimizer", "save", "write", "restore", "reform", "snapshot")
FAULT_ENV = "TRAINMESH_FAULT"
FAULT_KINDS = ("hang", "raise", "exit", "wait", "term", "hold")


class InjectedFault(RuntimeError):
    pass


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int | None
    phase: str
    marker: str

    @classmethod
    def parse(cls, text: str) -> list[Fault]:
        return [cls.parse_one(part.strip()) for part in text.split(";") if part.strip()]

    @classmethod
    def parse_one(cls, text: str) -> Fault:
        try:
            kind, rest = text.split("@", 1)
            f = dict(kv.split("=", 1) for kv in rest.split(","))
            step = int(f["step"]) if "step" in f else None
            fault = cls(kind, int(f["rank"]), step, f["phase"], f["marker"])
        except (ValueError, KeyError) as err:
            raise ValueError(f"{FAULT_ENV}={text!r}: expected "
                             "KIND@rank=R[,step=S],phase=P,marker=PATH") from err
        if kind not in FAULT_KINDS or fault.phase not in PHASES:
            raise ValueError(f"{FAULT_ENV}={text!r}: kind one of {FAULT_KINDS}, phase one of {PHASES}")
        return fault

    def fire(self, settle=None) -> None:
        if os.path.exists(self.marker):
            return  # fired already in this job
        if self.kind == "wait" and settle is not None:
            settle()  # the rank's background work landed first: the node is lost right here
        try:
            fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return  # fired already in this job
        import ray

        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
        os.write(fd, json.dumps({"node": node, "pid": os.getpid()}).encode())
        os.close(fd)
        if self.kind == "hang":
            while True:  # a frozen node stays frozen: continued (SIGCONT), it stops again
                os.kill(os.getpid(), signal.SIGSTOP)
        elif self.kind == "exit":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.kind == "term":
            os.kill(os.getpid(), signal.SIGTERM)
            return
        elif self.kind == "wait":
            while True:
                time.sleep(60)
        elif self.kind == "hold":
            while not os.path.exists(self.marker + ".go"):
                time.sleep(0.05)
            return
        raise InjectedFault(f"injected fault at step {self.step}, {self.phase}")


class Progress:
    def __init__(self, rank: int):
        self.rank = rank  # a warm re-form may change it
        self.counts = dict.fromkeys(PHASES, 0)  # since the step began (comparable across ranks)
        self.phase, self._step, self.since = "idle", 0, time.monotonic()
        text = os.environ.get(FAULT_ENV)
        self._faults = Fault.parse(text) if text else []
        self.settle = None  # what a ``wait`` fault lets finish before it fires (the rank's)

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        if value != self._step:
            self.counts = dict.fromkeys(PHASES, 0)
        self._step = value

    def mark(self, phase: str) -> None:
        self.counts[phase] += 1
        self.phase, self.since = phase, time.monotonic()
        for f in self._faults:
            if f.rank == self.rank and f.phase == phase and f.step in (None, self.step):
                f.fire(self.settle)

    def snapshot(self) -> dict:
        return {"step": self.step, "phase": self.phase, "counts": dict(self.counts),
                "idle_s": round(time.monotonic() - self.since, 3)}
