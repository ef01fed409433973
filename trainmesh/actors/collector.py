"""A rank process's garbage collector, run on a schedule instead of whenever allocations trip
Python's thresholds.

- **Imports.** A rank imports torch, DTensor, FSDP2 and DCP: hundreds of thousands of objects
  that live as long as the process. With the collector on, the allocations trip full
  collections that walk all of them again and again (measured on the 2-core CI machine: 2.8 s
  of a core with it, 2.0 s without). They are imported with the collector off and frozen as
  they are (``gc.freeze``): no later collection walks them. Not collected first: that one
  collection walks every object the imports made (~350,000) to free ~10,000 (the cycles
  imports leave), 0.27 s of a core per rank process for no memory the process would get back
  (its resident size was the same either way), paid by every rank a job or a recovery starts.
- **Steps.** A collection pauses the rank that runs it; with every rank collecting when its own
  thresholds trip, each step waits for whichever rank paused last (at a thousand ranks, some
  rank nearly every step). Instead the automatic collector is off while the rank trains, and
  every rank collects the young generations at the same step, every ``runtime.gc_every`` steps
  (as TorchTitan's ``gc_freq`` and Megatron's manual GC do), and every generation at one step
  in ten of those, so that cycles that outlived a young collection are freed too; and fully at
  the ends of the calls every rank makes together — build, restore, save, evaluation — whose
  garbage (a restored state's buffers, a failed write's traceback) should not wait for a
  step. 0 keeps Python's own collection. (Ray's own full collections, which its raylet asks a
  worker for on its own timer or under object-store pressure, still happen unaligned.)
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import time
from collections.abc import Iterator

FULL_EVERY = 10  # a full collection at one scheduled collection in ten


@contextlib.contextmanager
def frozen_imports() -> Iterator[None]:
    """Import inside this block with the collector off; then everything the imports made (the
    modules' objects, for the process's life, and the few cycles they left) is frozen out of
    every later collection, uncollected."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        # back before the interpreter's end, whose last collection then frees them (frozen,
        # Triton's bindings report each of their objects as leaked when a rank exits)
        atexit.unregister(gc.unfreeze)
        atexit.register(gc.unfreeze)
        if was_on:
            gc.enable()


class Collector:
    """The schedule of one rank process while it trains (``every`` steps; 0: Python's
    automatic collection). Disables the automatic collector until ``stop``."""

    def __init__(self, every: int):
        self.every = every
        gc.collect()  # what came before (an engine dropped, a build's garbage) goes first
        if every:
            gc.disable()
        else:
            gc.enable()

    def after_step(self, step: int) -> float:
        """``step`` (counted from 1) has ended: collect if it is one of the schedule's; the
        seconds that took (0.0 at other steps)."""
        if not (self.every and step % self.every == 0):
            return 0.0
        t0 = time.perf_counter()
        gc.collect(2 if step % (self.every * FULL_EVERY) == 0 else 1)
        return time.perf_counter() - t0

    def after_call(self) -> None:
        """A collective call other than a step (restore, save, evaluation) has ended: collect
        everything, on every rank at the same point."""
        if self.every:
            gc.collect()

    @staticmethod
    def stop() -> None:
        """The rank no longer trains (its engine dropped: a re-form, an abort): Python's
        automatic collection again."""
        gc.enable()
