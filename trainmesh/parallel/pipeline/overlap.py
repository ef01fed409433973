"""A DualPipeV pair run as two threads taking turns, so that one's all-to-alls hide behind the
other's compute.

In a pair (``schedules.dualpipev``) a rank runs the forward of one chunk's microbatch and the
whole backward of its other chunk's. The calling thread runs the forward; a second thread runs
the backward. They hold one baton between them: only its holder runs, and it hands the baton
over where it would wait on communication it has started (``hand_over``: the MoE exchanges,
``parallel/expert.py``), taking it back only when the other thread hands it back or ends. So
each exchange is in flight while the other half computes (on a GPU the exchange runs on the
communicator's stream beside the compute stream; on gloo on its own threads), and every rank
of a group issues its collectives in one order that the program fixes, never the timing: the
same as a single thread would, interleaved at the same points on every rank (the ranks of any
group but the pipeline's run the same actions).

Only the holder runs, so nothing the two share needs a lock; what each half must find as it
left it (a process-wide setting one half reads — the microbatch's balancing-loss share, the
random generators a recomputed block replays) the caller's ``switch`` swaps at every turn.
If one half fails, the other raises at its next hand-over instead of going on alone (its
collectives would no longer meet its peers'). The backward may run on another thread than
the one that called it (autograd's device threads on a GPU): whichever thread is not the
forward's speaks for the backward.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

_active: _Baton | None = None  # the pair running now (one at a time in a process)


class PairFailed(RuntimeError):
    """The other half of a pair failed: this one stops at its next hand-over."""


class _Baton:
    def __init__(self, forward_thread: int, switch: Callable[[int], None] | None):
        self.forward_thread = forward_thread
        self.switch = switch  # called by the half handing over, with the half that runs next
        self.turn = 0  # 0: the forward's, 1: the backward's
        self.done = [False, False]
        self.failed = False
        self.handovers = [0, 0]  # by the half that handed over
        self.last = 0  # the half that ran last
        self.switch_error: BaseException | None = None  # a ``switch`` that raised: the pair fails
        self._cv = threading.Condition()

    def me(self) -> int:
        return 0 if threading.get_ident() == self.forward_thread else 1

    def _give(self, me: int) -> None:  # (holding the lock, and the baton)
        try:
            if self.switch is not None:
                self.switch(1 - me)
        except BaseException as err:  # noqa: BLE001 - the pair fails; the other still wakes
            self.switch_error = self.switch_error or err
            self.failed = True
        finally:
            self.turn = self.last = 1 - me
            self._cv.notify_all()

    def pass_on(self, me: int) -> None:
        with self._cv:
            if self.failed:
                raise PairFailed("the other half of this DualPipeV pair failed")
            if self.done[1 - me]:
                return  # (the other half is over: nothing to let run)
            self.handovers[me] += 1
            self._give(me)
            self._cv.wait_for(lambda: self.turn == me)
            if self.failed:
                raise PairFailed("the other half of this DualPipeV pair failed")

    def wait_turn(self, me: int) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self.turn == me)

    def finish(self, me: int, failed: bool) -> None:
        with self._cv:
            self.done[me] = True
            self.failed = self.failed or failed
            if not self.done[1 - me]:
                self._give(me)


def hand_over() -> None:
    """Called where this thread is about to wait on communication it started: inside a pair,
    the other half runs until it does the same (or ends); elsewhere nothing happens."""
    baton = _active
    if baton is not None:
        baton.pass_on(baton.me())


def run_pair(forward: Callable[[], object], backward: Callable[[], None],
             switch: Callable[[int], None] | None = None) -> tuple[object, tuple[int, int]]:
    """``forward()`` on this thread and ``backward()`` on another, taking turns at
    ``hand_over``; the forward's result and how many times each half handed over.
    ``switch(half)`` is called at every change of turn, before ``half`` (0: the forward,
    1: the backward) resumes, and once more at the end if the backward ran last. An exception
    in either is raised here once both have ended (the other stops at its next hand-over)."""
    global _active
    if _active is not None:
        raise RuntimeError("a pair is already running in this process")
    device = stream = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # (thread-local on a GPU)
        device, stream = torch.cuda.current_device(), torch.cuda.current_stream()
    baton = _active = _Baton(threading.get_ident(), switch)
    out: list = [None]
    errors: list[BaseException | None] = [None, None]

    def run_backward() -> None:
        if device is not None:  # (all of it on the caller's device and stream: ``switch`` too)
            torch.cuda.set_device(device)
            with torch.cuda.stream(stream):
                backward_half()
        else:
            backward_half()

    def backward_half() -> None:
        try:
            baton.wait_turn(1)
            if baton.failed:  # (the forward failed before it first handed over)
                raise PairFailed("the other half of this DualPipeV pair failed")
            backward()
        except BaseException as err:  # noqa: BLE001 - re-raised by the caller's thread
            errors[1] = err
        finally:
            baton.finish(1, errors[1] is not None)

    try:
        helper = threading.Thread(target=run_backward, name="pair-backward", daemon=True)
        helper.start()
        try:
            out[0] = forward()
        except BaseException as err:  # noqa: BLE001 - after the backward has ended
            errors[0] = err
        finally:
            baton.finish(0, errors[0] is not None)
        helper.join()
        if baton.last == 1 and switch is not None:
            try:  # (the forward's settings stay, as after the two one after the other)
                switch(0)
            except BaseException as err:  # noqa: BLE001 - raised below, after the halves' own
                baton.switch_error = baton.switch_error or err
    finally:
        _active = None
    for err in (*errors, baton.switch_error):  # (the cause first: PairFailed follows from it)
        if err is not None and not isinstance(err, PairFailed):
            raise err
    for err in errors:
        if err is not None:
            raise err
    return out[0], tuple(baton.handovers)
