"""DCP's storage writers, recording the files a rank writes with their sha256, taken as the bytes
go by (the manifest's digests: ``checkpoint/manifest.py``)."""

from __future__ import annotations

import collections
import contextlib
import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

from trainmesh.checkpoint.manifest import is_uri
from trainmesh.checkpoint.memory_fs import PROTOCOL
from trainmesh.checkpoint.zip_crc import without_zip_crc


class _Digest:
    """A file being written, digested as its bytes go by: each write is copied (DCP hands over
    views of buffers it reuses) to a thread that hashes it while the next is written — sha256
    releases the GIL, so hashing overlaps the writes and the fsync instead of re-reading the
    file afterwards. At most ``window`` bytes wait to be hashed."""

    def __init__(self, raw, window: int = 64 << 20):
        self.raw, self.size, self._window = raw, 0, window
        self._sha = hashlib.sha256()
        self._hasher = ThreadPoolExecutor(1)  # one thread: the updates keep their order
        self._pending: collections.deque = collections.deque()  # (future, bytes)
        self._waiting = 0

    def write(self, data) -> int:
        n = self.raw.write(data)
        chunk = bytes(memoryview(data).cast("B"))
        self.size += len(chunk)
        self._pending.append((self._hasher.submit(self._sha.update, chunk), len(chunk)))
        self._waiting += len(chunk)
        while self._waiting > self._window:
            fut, k = self._pending.popleft()
            fut.result()
            self._waiting -= k
        return n

    def digest(self) -> dict[str, Any]:
        """{"size", "sha256"} of every byte written (waits for the hashing still going on)."""
        self._hasher.shutdown(wait=True)
        for fut, _ in self._pending:
            fut.result()
        return {"size": self.size, "sha256": self._sha.hexdigest()}

    def abandon(self) -> None:
        self._hasher.shutdown(wait=False, cancel_futures=True)
        self._pending.clear()

    def __getattr__(self, name: str):  # tell, flush, fileno, close: the file's own
        return getattr(self.raw, name)


class _Recording:
    """A DCP writer that remembers the files this rank wrote (its shards; the coordinator's
    also the metadata file) with their digests, computed as they were written (``_Digest``),
    or (``digest=False``) only their names, for a digest taken after the save."""

    def __init__(self, *args, digest: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.written: list[str] = []
        self.digests: dict[str, dict[str, Any]] = {}  # file name: {"size", "sha256"}
        self.on_write = None  # called as the writing begins (a background save: in its thread)
        opened = self.fs.create_stream

        @contextlib.contextmanager
        def create_stream(path, mode: str):
            with opened(path, mode) as raw:
                if "w" not in mode:
                    yield raw
                    return
                if not digest:
                    with without_zip_crc():
                        yield raw
                    return
                stream = _Digest(raw)
                try:
                    with without_zip_crc():
                        yield stream
                except BaseException:  # a failed write: no digest, no thread left behind
                    stream.abandon()
                    raise
            # (DCP writes the metadata as NAME.tmp, then renames it)
            self.digests[str(path).rsplit("/", 1)[-1].removesuffix(".tmp")] = stream.digest()

        self.fs.create_stream = create_stream  # (this writer's own FileSystem instance)

    def files(self) -> dict[str, dict[str, Any]]:
        """{name: {"size", "sha256"}} of the files this rank wrote."""
        return {n: self.digests[n] for n in self.written}

    def write_data(self, plan, planner):
        if self.on_write is not None:
            self.on_write()
        fut = super().write_data(plan, planner)
        # a torch.futures.Future (``value()``), which DCP's writer has already completed
        fut.add_done_callback(lambda f: self.written.extend(
            {r.storage_data.relative_path for r in f.value()}))
        return fut

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        own = None if self.use_collectives else self.rank  # an uncoordinated save's own metadata
        self.written.append(Path(str(self._get_metadata_path(own))).name)


class _LocalWriter(_Recording, FileSystemWriter):
    pass


class _UriWriter(_Recording, FsspecWriter):
    pass



def storage_writer(directory: str | Path, digest: bool = True):
    """DCP's writer for ``directory``, recording what this rank writes (``_Recording``); a
    URI's files are always digested as they are written (reading them back would fetch them
    again)."""
    d = str(directory)
    if is_uri(d):
        # Memory has nothing to sync, and DCP, finding no file descriptor to fsync, would call
        # os.sync(): every dirty page of the machine flushed at every snapshot.
        return _UriWriter(d, sync_files=not d.startswith(f"{PROTOCOL}://"))
    return _LocalWriter(d, digest=digest)
