"""A rank's side of the in-memory checkpoint tier: taking a snapshot costs training only the
copy of its shards to host memory (``checkpoint/host_copy.py``: pinned buffers and one
synchronisation on GPUs, kept from one snapshot to the next); saving that copy as a Distributed
Checkpoint in the rank's memory store (``checkpoint/memory_fs.py``) goes on in a background thread
while training goes on, and the files then travel to the buddy rank on another node (a Ray call
not waited for). The next snapshot first waits for the last one's save (the host buffers are
then free; at most one copy to the buddy travels at a time), so a node lost meanwhile costs the
step before at most.

The tier is best effort: a snapshot that fails, or whose predecessor is still being saved, is
logged and skipped (a recovery then finds an older snapshot whole, or storage) — it never
fails a training step."""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import TYPE_CHECKING

import ray

from trainmesh.checkpoint import memory_fs
from trainmesh.checkpoint.memory_fs import MemoryStore

if TYPE_CHECKING:
    from trainmesh.checkpoint.host_copy import HostCopy

log = logging.getLogger(__name__)


class Snapshots:
    def __init__(self, store: MemoryStore) -> None:
        self.store = store  # the rank's: its snapshots and its buddies' copies
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="snapshot")
        self._saving: concurrent.futures.Future | None = None  # holds the host copy's buffers
        self._replica: ray.ObjectRef | None = None  # the last copy handed to a buddy
        self._host: HostCopy | None = None  # one engine's state in host memory (``forget`` drops it)

    def take(self, directory: str, rank: int, model, optimizer, buddy, timeout_s: float) -> dict:
        """Snapshot this rank's shards as ``directory``; returns the seconds training waited
        (the last snapshot's save, and the copy) and the bytes copied (0: skipped)."""
        # (torch: imported by the ranks that take snapshots; the save's too, here, not in its thread)
        from trainmesh.checkpoint import dcp_io, snapshot_io  # noqa: F401
        from trainmesh.checkpoint.host_copy import HostCopy

        t0 = time.perf_counter()
        if not self._saved(timeout_s):
            log.warning("in-memory snapshot %s skipped: the last one is still being saved", directory)
            return {"blocked_s": time.perf_counter() - t0, "bytes": 0}
        if self._host is None:
            self._host = HostCopy(next(model.parameters()).device)
        staged = self._host.copy(dcp_io.rank_state(model, optimizer))
        blocked = time.perf_counter() - t0
        self._saving = self._pool.submit(self._save, directory, rank, staged, buddy, timeout_s)
        return {"blocked_s": blocked, "bytes": self._host.nbytes}

    def settle(self, timeout_s: float | None = None) -> None:
        """Wait for the snapshot in flight: saved in this process's memory and its copy at the
        buddy (or the buddy found gone)."""
        self._saved(timeout_s)
        if self._replica is not None:
            ray.wait([self._replica], timeout=timeout_s)

    def forget(self, timeout_s: float) -> None:
        """Before this process takes another part (a re-formed mesh): the snapshot being saved
        finished (a recovery may restore it; its copy to a buddy, maybe on the lost node, is not
        waited for), the old part's host buffers dropped."""
        self._saved(timeout_s)
        self._replica = None
        if self._host is not None:
            self._host.close()
            self._host = None

    def _saved(self, timeout_s: float | None) -> bool:
        """Whether the last snapshot's save is over (a failed one logged): its buffers free."""
        f = self._saving
        if f is None:
            return True
        try:
            f.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            return False
        except Exception as err:  # noqa: BLE001 - best effort: this snapshot is simply not whole
            log.warning("in-memory snapshot failed: %s", err)
        self._saving = None
        return True

    def _save(self, directory: str, rank: int, staged: dict, buddy, timeout_s: float) -> None:
        from trainmesh.checkpoint import snapshot_io

        hidden = f".{directory}-{rank}"  # invisible (MemoryStore.held) until committed
        try:
            snapshot_io.snapshot(memory_fs.uri(hidden), rank, staged, self.store)
            files = self.store.commit(hidden, directory)
        finally:
            self.store.drop(hidden)  # whatever a failed save left there
        self.store.keep_newest(2)
        if buddy is None:
            snapshot_io.index_snapshot(self.store, directory)
            return
        if self._replica is not None:  # one copy travels at a time
            done, _ = ray.wait([self._replica], timeout=timeout_s)
            try:
                ray.get(done)
            except ray.exceptions.RayError as err:
                log.warning("in-memory snapshot: the last copy to the buddy failed (%s)", err)
        self._replica = buddy.keep_replica.remote(directory, files)
        snapshot_io.index_snapshot(self.store, directory)  # while the copy travels
