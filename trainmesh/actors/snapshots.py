"""A rank's side of the in-memory checkpoint tier: taking a snapshot costs training only the
copy of its shards to host memory (``checkpoint/host_copy.py``: pinned buffers and one
synchronisation on GPUs, kept from one snapshot to the next); saving that copy as a Distributed Checkpoint in this
process's memory (``checkpoint/memory_fs.py``) and handing it to the buddy rank on another node
go on in a background thread while training goes on. The next snapshot first waits for the last
one's (at most one in flight), so a node lost meanwhile costs the step before at most."""

from __future__ import annotations

import concurrent.futures
import logging
import time

import ray

from trainmesh.checkpoint import dcp_io, memory_fs
from trainmesh.checkpoint.host_copy import HostCopy

log = logging.getLogger(__name__)


class Snapshots:
    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="snapshot")
        self._inflight: concurrent.futures.Future | None = None
        self._host: HostCopy | None = None  # one engine's state in host memory (``forget`` drops it)

    def take(self, directory: str, rank: int, model, optimizer, buddy, timeout_s: float) -> dict:
        """Snapshot this rank's shards as ``directory``; returns the seconds training waited
        (the last snapshot's end, and the copy) and the bytes copied."""
        t0 = time.perf_counter()
        self.settle(timeout_s)
        if self._host is None:
            self._host = HostCopy(next(model.parameters()).device)
        staged = self._host.copy(dcp_io.rank_state(model, optimizer))
        blocked = time.perf_counter() - t0
        self._inflight = self._pool.submit(self._write, directory, rank, staged, buddy, timeout_s)
        return {"blocked_s": blocked, "bytes": self._host.nbytes}

    def settle(self, timeout_s: float | None = None) -> None:
        """Wait for the snapshot in flight: saved in this process's memory and its copy at the
        buddy (or the buddy found gone)."""
        f, self._inflight = self._inflight, None
        if f is not None:
            f.result(timeout=timeout_s)

    def forget(self, timeout_s: float) -> None:
        """Before this process takes another part (a re-formed mesh): the snapshot in flight
        finished (a recovery may restore it), the old part's host buffers dropped."""
        try:
            self.settle(timeout_s)
        except Exception as err:  # noqa: BLE001 - the snapshot is then simply not complete
            log.warning("in-memory snapshot not finished: %s", err)
        if self._host is not None:
            self._host.close()
            self._host = None

    @staticmethod
    def _write(directory: str, rank: int, staged: dict, buddy, timeout_s: float) -> None:
        hidden = f".{directory}-{rank}"
        dcp_io.snapshot(memory_fs.uri(hidden), rank, staged)
        files = memory_fs.commit(hidden, directory)
        memory_fs.keep_newest(2)
        if buddy is None:
            return
        try:
            ray.get(buddy.keep_replica.remote(directory, files), timeout=timeout_s)
        except (ray.exceptions.RayError, TimeoutError) as err:
            log.warning("in-memory snapshot %s: the copy to the buddy failed (%s)", directory, err)
