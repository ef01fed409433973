"""The in-memory checkpoint tier's storage: a Distributed Checkpoint whose files live in this
process's memory (an fsspec filesystem, protocol ``tmmem``), so DCP saves, loads and reshards
snapshots exactly as it does checkpoints on storage.

A snapshot directory is ``tmmem://GGGG-SSSSSSSS`` (the mesh generation and the step): every rank
saves its own file into its own memory, and hands a copy to a buddy rank on another node, which
keeps it under the same name. Restoring onto any mesh is a DCP load from that directory; a file
this process does not hold is fetched (``fetch``: from the peer that holds it) the first time DCP
opens it, and dropped after the load.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import fsspec
from fsspec.implementations.memory import MemoryFileSystem

PROTOCOL = "tmmem"


class RankMemoryFS(MemoryFileSystem):
    protocol = PROTOCOL
    store: dict = {}  # this process's files (not fsspec's shared memory:// store)
    pseudo_dirs = [""]
    # path → the file's bytes from a peer (None: not held anywhere); set during a restore
    fetch: Callable[[str], bytes | None] | None = None
    fetched: set[str] = set()

    def _open(self, path, mode="rb", **kwargs):
        if "r" in mode and path not in self.store and RankMemoryFS.fetch is not None:
            data = RankMemoryFS.fetch(path)
            if data is not None:
                self.pipe_file(path, data)
                RankMemoryFS.fetched.add(path)
        return super()._open(path, mode, **kwargs)


fsspec.register_implementation(PROTOCOL, RankMemoryFS, clobber=True)

# Moves and drops of whole directories (a snapshot's save thread, the Ray thread that keeps
# a buddy's copies, restores) one at a time; DCP's own writes and reads of single files need
# none (a dict item set or read at once).
_LOCK = threading.Lock()


def uri(directory: str, name: str = "") -> str:
    return f"{PROTOCOL}://{directory}" + (f"/{name}" if name else "")


def held() -> dict[str, list[str]]:
    """Directory → the file names this process holds there (its own and its replicas; not a
    snapshot still being written: its directory is hidden, ``.NAME``, until ``commit``)."""
    out: dict[str, list[str]] = {}
    for path in list(RankMemoryFS.store):
        if path in RankMemoryFS.fetched:
            continue
        directory, _, name = path.removeprefix(f"{PROTOCOL}://").rpartition("/")
        if not directory.startswith("."):
            out.setdefault(directory, []).append(name)
    return out


def read(directory: str, name: str) -> bytes | None:
    f = RankMemoryFS.store.get(uri(directory, name))
    return None if f is None else f.getvalue()


def _metadata_last(names) -> list[str]:
    """A rank's files in the order they become visible: its metadata (what says it is there,
    ``MemoryTier.newest_complete``) after its data."""
    return sorted(names, key=lambda n: (n.endswith(".metadata"), n))


def put(directory: str, files: dict[str, bytes]) -> None:
    fs = RankMemoryFS()
    with _LOCK:
        for name in _metadata_last(files):
            fs.pipe_file(uri(directory, name), files[name])


def commit(hidden: str, directory: str) -> dict[str, bytes]:
    """Make the files written under ``hidden`` part of ``directory`` (metadata last); returns
    them, name → bytes."""
    prefix = uri(hidden) + "/"
    files = {}
    with _LOCK:
        names = [p.removeprefix(prefix) for p in list(RankMemoryFS.store) if p.startswith(prefix)]
        for name in _metadata_last(names):
            f = RankMemoryFS.store.pop(prefix + name)
            RankMemoryFS.store[uri(directory, name)] = f
            files[name] = f.getvalue()
    return files


def drop(directory: str) -> None:
    """Forget ``directory`` and its files."""
    prefix = uri(directory) + "/"
    with _LOCK:
        for p in [p for p in list(RankMemoryFS.store) if p.startswith(prefix)]:
            RankMemoryFS.store.pop(p, None)
        RankMemoryFS.pseudo_dirs[:] = [d for d in RankMemoryFS.pseudo_dirs
                                       if not (d == prefix[:-1] or d.startswith(prefix))]


def nbytes(directory: str) -> int:
    prefix = uri(directory) + "/"
    return sum(f.size for p, f in list(RankMemoryFS.store.items()) if p.startswith(prefix))


def keep_newest(n: int) -> None:
    """Drop all but the ``n`` newest directories (names sort by generation, then step)."""
    for directory in sorted(held())[:-n] if n else sorted(held()):
        drop(directory)


def drop_fetched() -> None:
    """After a restore: forget the peers' files fetched for it."""
    with _LOCK:
        for p in RankMemoryFS.fetched:
            RankMemoryFS.store.pop(p, None)
        RankMemoryFS.fetched.clear()
        RankMemoryFS.fetch = None
