"""Faults placed at exact points of a job, for the fault matrix and the soak bench.

A job run with ``rank_cls=FaultyRank`` and ``job_env={FAULT_ENV: ...}`` (``run_job``; the
variable is read in each rank's process) holds faults separated by ``;``, each
``KIND@rank=R[,step=S],phase=P,marker=PATH``: the rank that is rank R, entering phase P (one
of ``actors/progress.PHASES``) at step S (the steps it has done: for a step, the steps before
it; for a save or a restore, the checkpoint's step; any step when left out), then

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
  hung (about a hang bound: nobody moves).

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

from trainmesh.actors.progress import PHASES, Progress
from trainmesh.actors.rank_worker import RankWorker

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


class FaultListener:
    """Fires ``faults`` at their rank's phases (a ``Progress`` listener); ``settle``: what a
    ``wait`` fault lets finish before it fires (the rank's in-flight snapshot)."""

    def __init__(self, faults: list[Fault], settle=None):
        self.faults, self.settle = faults, settle

    def __call__(self, progress: Progress, phase: str) -> None:
        for f in self.faults:
            if f.rank == progress.rank and f.phase == phase and f.step in (None, progress.step):
                f.fire(self.settle)


class FaultyRank(RankWorker):
    """A rank that fires the faults its environment holds (``FAULT_ENV``)."""

    def __init__(self, rank: int, world_size: int, cpu_threads: int):
        super().__init__(rank, world_size, cpu_threads)
        text = os.environ.get(FAULT_ENV)
        if text:
            # a node is lost at a fault's point with this rank's snapshot in flight landed
            self._progress.listeners.append(FaultListener(Fault.parse(text), self._snapshots.settle))


def fault_run(faults: str) -> dict:
    """``run_job``'s keyword arguments for a job whose ranks fire ``faults``."""
    return {"rank_cls": FaultyRank, "job_env": {FAULT_ENV: faults}}
