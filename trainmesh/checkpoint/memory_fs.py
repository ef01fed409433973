"""The in-memory checkpoint tier's storage: a Distributed Checkpoint whose files live in a rank's
memory (:class:`MemoryStore`, owned by the rank worker), read and written through an fsspec
filesystem (protocol ``tmmem``) bound to that store, so DCP saves, loads and reshards snapshots
exactly as it does checkpoints on storage.

A snapshot directory is ``tmmem://GGGG-SSSSSSSS`` (the mesh generation and the step): every rank
saves its own file into its own store, and hands a copy to a buddy rank on another node, which
keeps it under the same name. Restoring onto any mesh is a DCP load from that directory; a file
the store does not hold is fetched from the peer that holds it the first time DCP opens it
(``MemoryStore.fetching``), and dropped after the load.

Every change to the store — a snapshot's save thread committing, a buddy's copy arriving on the
rank's memory thread, a restore's fetches, pruning — goes through the store's one lock.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import fsspec
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem

PROTOCOL = "tmmem"


def uri(directory: str, name: str = "") -> str:
    return f"{PROTOCOL}://{directory}" + (f"/{name}" if name else "")


def _metadata_last(names) -> list[str]:
    """A rank's files in the order they become visible: its metadata (what says it is there,
    ``MemoryTier.newest_complete``) after its data."""
    return sorted(names, key=lambda n: (n.endswith(".metadata"), n))


class MemoryStore:
    """One rank's snapshot files (its own and its buddies' copies), by path."""

    def __init__(self) -> None:
        self.files: dict[str, MemoryFile] = {}
        self.pseudo_dirs: list[str] = [""]
        self._lock = threading.RLock()
        self._fetch: Callable[[str], bytes | None] | None = None  # during a restore
        self._fetched: set[str] = set()
        # path -> {record offset: how the tensor there is laid out}, taken after a file
        # arrives (``snapshot_io.index_snapshot``) so that a restore only copies
        self.layouts: dict[str, dict[int, object]] = {}

    def fs(self) -> RankMemoryFS:
        """An fsspec filesystem over this store (what DCP's readers and writers are given)."""
        return RankMemoryFS(store=self)

    def held(self) -> dict[str, list[str]]:
        """Directory → the file names held there (its own and its replicas; not a snapshot
        still being written: its directory is hidden, ``.NAME``, until ``commit``; not the
        files a restore fetched)."""
        out: dict[str, list[str]] = {}
        with self._lock:
            paths = [p for p in self.files if p not in self._fetched]
        for path in paths:
            directory, _, name = path.removeprefix(f"{PROTOCOL}://").rpartition("/")
            if not directory.startswith("."):
                out.setdefault(directory, []).append(name)
        return out

    def read(self, directory: str, name: str) -> bytes | None:
        f = self.files.get(uri(directory, name))
        return None if f is None else f.getvalue()

    def put(self, directory: str, files: dict[str, bytes]) -> None:
        """Keep a peer's copy of its snapshot files (metadata last)."""
        fs = self.fs()
        with self._lock:
            for name in _metadata_last(files):
                self.layouts.pop(uri(directory, name), None)
                fs.pipe_file(uri(directory, name), files[name])

    def note_layouts(self, path: str, file: MemoryFile, layouts: dict[int, object]) -> None:
        """Keep what the records of ``file``, held at ``path``, hold (unless another file
        replaced it meanwhile)."""
        with self._lock:
            if self.files.get(path) is file:
                self.layouts[path] = layouts

    def commit(self, hidden: str, directory: str) -> dict[str, bytes]:
        """Make the files written under ``hidden`` part of ``directory`` (metadata last); returns
        them, name → bytes."""
        prefix = uri(hidden) + "/"
        out = {}
        with self._lock:
            names = [p.removeprefix(prefix) for p in self.files if p.startswith(prefix)]
            for name in _metadata_last(names):
                f = self.files.pop(prefix + name)
                self.files[uri(directory, name)] = f
                out[name] = f.getvalue()
        return out

    def drop(self, directory: str) -> None:
        """Forget ``directory`` and its files."""
        prefix = uri(directory) + "/"
        with self._lock:
            for p in [p for p in self.files if p.startswith(prefix)]:
                del self.files[p]
                self.layouts.pop(p, None)
            self.pseudo_dirs[:] = [d for d in self.pseudo_dirs
                                   if not (d == prefix[:-1] or d.startswith(prefix))]

    def nbytes(self, directory: str) -> int:
        prefix = uri(directory) + "/"
        with self._lock:
            return sum(f.size for p, f in self.files.items() if p.startswith(prefix))

    def keep_newest(self, n: int) -> None:
        """Drop all but the ``n`` newest directories (names sort by generation, then step)."""
        with self._lock:
            for directory in sorted(self.held())[:-n] if n else sorted(self.held()):
                self.drop(directory)

    @contextlib.contextmanager
    def fetching(self, fetch: Callable[[str], bytes | None]) -> Iterator[None]:
        """A restore: a file not held is read with ``fetch(path)`` (from the peer that holds it;
        None: nowhere) when first opened; every fetched file is dropped at the end."""
        with self._lock:
            self._fetch = fetch
        try:
            yield
        finally:
            with self._lock:
                for p in self._fetched:
                    self.files.pop(p, None)
                    self.layouts.pop(p, None)
                self._fetched.clear()
                self._fetch = None

    def _fetch_missing(self, fs: RankMemoryFS, path: str) -> None:
        with self._lock:
            fetch = self._fetch if path not in self.files else None
        if fetch is None:
            return
        data = fetch(path)  # a remote call: not under the lock
        if data is not None:
            with self._lock:
                fs.pipe_file(path, data)
                self._fetched.add(path)


class RankMemoryFS(MemoryFileSystem):
    """fsspec's memory filesystem over one :class:`MemoryStore` (not fsspec's process-wide
    store); a path it does not hold is fetched during a restore (``MemoryStore.fetching``)."""

    protocol = PROTOCOL
    cachable = False  # one per store: never handed out by fsspec's instance cache

    def __init__(self, store: MemoryStore, **kwargs):
        super().__init__(**kwargs)
        self.owner = store
        self.store, self.pseudo_dirs = store.files, store.pseudo_dirs

    def _open(self, path, mode="rb", **kwargs):
        if "r" in mode:
            self.owner._fetch_missing(self, self._strip_protocol(path))
        return super()._open(path, mode, **kwargs)


fsspec.register_implementation(PROTOCOL, RankMemoryFS, clobber=True)
