"""``batch_isend_irecv`` with NCCL's rules on any backend (gloo here), so that the executor is
tested on CPUs against what it will meet on GPUs:

- a batch comes back as **one** handle (NCCL coalesces a group into one work object);
- a rank's batches run **one after another on one stream**: a batch starts only when the one
  before it has completed, and completes only when every message in it has;
- a send completes only once the peer has **posted the matching receive** (no buffering: a
  ready token travels from the receiver before the data moves);
- messages between two ranks meet **first in, first out, tags ignored**: the k-th send from a
  to b meets the k-th receive at b from a — a pair that posts in different orders gets wrong
  data (or hangs), as on NCCL.

The parallel tests' ranks post their pipeline and ring messages through it
(``testing/probes.ProbedRank``): what passes there cannot deadlock or mismatch on GPUs.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections import defaultdict
from datetime import timedelta

import torch
import torch.distributed as dist


class _Handle:
    """One batch's handle: done when the stream has completed the whole batch."""

    def __init__(self):
        self._done = threading.Event()
        self._error: BaseException | None = None

    def finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        seconds = None if timeout is None else timeout.total_seconds()
        if not self._done.wait(seconds):
            raise RuntimeError(f"NCCL-rules batch not complete after {seconds} s (deadlock?)")
        if self._error is not None:
            raise RuntimeError("NCCL-rules batch failed") from self._error
        return True


class NcclRulesP2P:
    """Call it as ``batch_isend_irecv``. One stream thread per instance (per rank and group),
    ended when the instance is dropped."""

    def __init__(self, timeout: timedelta = timedelta(minutes=5)):
        self.timeout = timeout
        self._sent: dict[int, int] = defaultdict(int)  # peer → messages posted to it
        self._received: dict[int, int] = defaultdict(int)  # peer → receives posted from it
        self._stream: queue.Queue = queue.Queue()
        threading.Thread(target=_stream, args=(self._stream, timeout), daemon=True,
                         name="nccl-rules-stream").start()
        weakref.finalize(self, self._stream.put, None)

    def __call__(self, ops: list[dist.P2POp]) -> list[_Handle]:
        plan = []
        for op in ops:  # FIFO positions are taken in posting order, per peer (global rank)
            if op.op is dist.isend:
                plan.append(("send", op.tensor, op.peer, op.group, self._sent[op.peer]))
                self._sent[op.peer] += 1
            else:
                plan.append(("recv", op.tensor, op.peer, op.group, self._received[op.peer]))
                self._received[op.peer] += 1
        handle = _Handle()
        self._stream.put((plan, handle))
        return [handle]


def _stream(batches: queue.Queue, timeout: timedelta) -> None:
    """A rank's stream: each batch runs to completion before the next starts."""
    while (item := batches.get()) is not None:
        plan, handle = item
        try:
            _batch(plan, timeout)
            handle.finish()
        except BaseException as err:  # noqa: BLE001 - handed to whoever waits
            handle.finish(err)


def _batch(plan, timeout: timedelta) -> None:
    works, sends, errors = [], [], []
    for kind, tensor, peer, group, k in plan:  # post every receive, then say so
        if kind == "recv":
            works.append(dist.irecv(tensor, peer, group, tag=2 * k))
            works.append(dist.isend(torch.ones(1), peer, group, tag=2 * k + 1))
        else:
            token = dist.irecv(torch.zeros(1), peer, group, tag=2 * k + 1)
            sends.append(threading.Thread(target=_send, args=(token, tensor, peer, group, k,
                                                              timeout, errors)))
    for s in sends:  # each send goes once its receiver is ready: all of them concurrently
        s.start()
    for w in works:
        w.wait(timeout)
    for s in sends:
        s.join()
    if errors:
        raise errors[0]


def _send(token, tensor, peer, group, k, timeout, errors) -> None:
    try:
        token.wait(timeout)
        dist.isend(tensor, peer, group, tag=2 * k).wait(timeout)
    except BaseException as err:  # noqa: BLE001 - raised by the batch
        errors.append(err)
