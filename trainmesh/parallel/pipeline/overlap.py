"""A DualPipeV pair run as two threads taking turns, so that one's all-to-alls hide behind the
other's compute.

In a pair (``schedules.dualpipev``) a rank runs the forward of one chunk's microbatch and the
whole backward of its other chunk's. The calling thread runs the forward; a second thread runs
the backward. They hold one baton between them: only its holder runs, and it hands the baton
over where it would wait on communication it has started (``hand_over``: the MoE exchanges,
``parallel/expert.py``), taking it back only when the other thread hands it back or ends. So
each exchange is in flight while the other half of the pair computes (on a GPU the exchange
runs on the communicator's stream beside the compute stream; on gloo on its own threads),
and every rank of a group issues its collectives in one order that the program fixes, never
the timing: the same as a single thread would, interleaved at the same points on every rank
(the ranks of any group but the pipeline's run the same actions).

Only the holder runs, so nothing the two share needs a lock. The backward may run on another
thread than the one that called it (autograd's device threads on a GPU): whichever thread is
not the forward's speaks for the backward.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

_active: _Baton | None = None  # the pair running now (one at a time in a process)


class _Baton:
    def __init__(self, forward_thread: int):
        self.forward_thread = forward_thread
        self.turn = 0  # 0: the forward's, 1: the backward's
        self.done = [False, False]
        self.handovers = 0
        self._cv = threading.Condition()

    def me(self) -> int:
        return 0 if threading.get_ident() == self.forward_thread else 1

    def pass_on(self, me: int) -> None:
        with self._cv:
            if self.done[1 - me]:
                return  # (the other half is over: nothing to let run)
            self.turn = 1 - me
            self.handovers += 1
            self._cv.notify_all()
            self._cv.wait_for(lambda: self.turn == me)

    def wait_turn(self, me: int) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self.turn == me)

    def finish(self, me: int) -> None:
        with self._cv:
            self.done[me] = True
            self.turn = 1 - me
            self._cv.notify_all()


def hand_over() -> None:
    """Called where this thread is about to wait on communication it started: inside a pair,
    the other half runs until it does the same (or ends); elsewhere nothing happens."""
    baton = _active
    if baton is not None:
        baton.pass_on(baton.me())


def run_pair(forward: Callable[[], object], backward: Callable[[], None]) -> tuple[object, int]:
    """``forward()`` on this thread and ``backward()`` on another, taking turns at
    ``hand_over``; the forward's result and how many times the baton passed. An exception in
    either is raised here once both have ended (the other goes on alone meanwhile)."""
    global _active
    if _active is not None:
        raise RuntimeError("a pair is already running in this process")
    baton = _active = _Baton(threading.get_ident())
    out: list = [None]
    errors: list[BaseException | None] = [None, None]

    def run_backward() -> None:
        try:
            baton.wait_turn(1)
            backward()
        except BaseException as err:  # noqa: BLE001 - re-raised by the caller's thread
            errors[1] = err
        finally:
            baton.finish(1)

    helper = threading.Thread(target=run_backward, name="pair-backward", daemon=True)
    helper.start()
    try:
        try:
            out[0] = forward()
        except BaseException as err:  # noqa: BLE001 - after the backward has ended
            errors[0] = err
        finally:
            baton.finish(0)
        helper.join()
    finally:
        _active = None
    for err in errors:
        if err is not None:
            raise err
    return out[0], baton.handovers
