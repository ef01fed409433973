"""The rank process's garbage collector (actors/collector.py), in a fresh interpreter (the
schedule switches the process's collector off and freezes objects: not in the test process):
imports frozen out of later collections, collections at the schedule's steps and calls only.
On real ranks: test_tensor_parallel.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CHECK = r"""
import gc, json, weakref
from trainmesh.actors.collector import FULL_EVERY, Collector, frozen_imports

class Cycle:
    pass

seen, freed = [], []
gc.callbacks.append(lambda phase, info: phase == "start" and seen.append(info["generation"]))
out = {}
before = gc.get_freeze_count()
with frozen_imports():
    out["enabled_inside"] = gc.isenabled()
    kept = [[i] for i in range(50_000)]  # enough allocations to trip gen-0 collections
    for _ in range(1000):  # cycles: frozen with the rest, not collected
        cycle = Cycle()
        cycle.me = cycle
        weakref.finalize(cycle, freed.append, 1)
    del cycle
out["during_imports"], seen[:] = list(seen), []
out["cycles_freed"] = len(freed)
out["enabled_after"], out["frozen"] = gc.isenabled(), gc.get_freeze_count() - before

c = Collector(every=3)
seen.clear()
out["enabled_training"] = gc.isenabled()
out["timed"] = []
for step in range(1, 3 * FULL_EVERY + 1):
    [[i] for i in range(20_000)]  # would trip automatic collections
    if c.after_step(step) > 0:  # its seconds (the step's breakdown: gc_s)
        out["timed"].append(step)
out["steps"], seen[:] = list(seen), []
c.after_call()
out["call"], seen[:] = list(seen), []
out["freed_after_full_collection"] = len(freed)  # (frozen: no collection reaches them)
Collector.stop()
out["enabled_stopped"] = gc.isenabled()
c = Collector(every=0)
seen.clear()
c.after_step(30)
c.after_call()
out["automatic"] = [gc.isenabled(), list(seen)]
print(json.dumps(out))
"""


@pytest.mark.timed  # (its own time bounds: with the Ray tests under `make test`)
def test_imports_are_frozen_and_collections_follow_the_schedule():
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    from trainmesh.actors.collector import FULL_EVERY

    # imports: no collection while they run or after (it would walk every object they made);
    # all of it frozen, the 50,000 kept lists and the 1,000 cycles (never freed)
    assert out["enabled_inside"] is False and out["during_imports"] == []
    assert out["cycles_freed"] == 0 and out["freed_after_full_collection"] == 0
    assert out["enabled_after"] is True and out["frozen"] >= 51_000
    # training: the automatic collector off; young generations at steps 3, 6, ..., everything
    # at one in FULL_EVERY of them; everything after a collective call
    assert out["enabled_training"] is False
    assert out["steps"] == [2 if s % (3 * FULL_EVERY) == 0 else 1
                            for s in range(3, 3 * FULL_EVERY + 1, 3)]
    assert out["timed"] == list(range(3, 3 * FULL_EVERY + 1, 3))  # the others take 0.0 s
    assert out["call"] == [2]
    assert out["enabled_stopped"] is True
    assert out["automatic"] == [True, []]  # 0: Python's own collection, none of the schedule's
