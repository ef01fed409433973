"""Save and load model + optimizer state with torch Distributed Checkpoint.

Keys are the model's fully qualified parameter names (``layers.3.attention.wq.weight``), so a
checkpoint written under one mesh loads under any other: DCP reshards on load. A directory is
a local path or an fsspec URI (``s3://...``, ``file://...``); URIs go through DCP's fsspec
storage.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import logging
import os
import pickle
import sys
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from trainmesh.checkpoint.manifest import is_uri, read_digest
from trainmesh.checkpoint.memory_fs import PROTOCOL, MemoryStore, uri

# Optimizer state flattened to one key per parameter and field ("state.layers.0...exp_avg",
# "param_groups.layers.0....lr"): no per-rank param_groups lists, so a rank holding other
# pipeline stages after a re-plan still finds every entry it needs.
_OPTS = StateDictOptions(flatten_optimizer_state_dict=True)

log = logging.getLogger(__name__)

# A restore from memory reads tensors straight from a snapshot file's bytes (``_copy_saved``),
# which are immutable: torch warns, once, that a tensor over them could write to them. Such a
# tensor is only ever copied from.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


_crc = threading.Lock()
_crc_writers = [0, True]  # files being written under without_zip_crc; the option before the first


@contextlib.contextmanager
def without_zip_crc():
    """While a checkpoint file is written: ``torch.save`` (DCP's serialisation of each tensor)
    computes no zip CRC32 of its records. ``torch.load`` never checks them (measured, torch
    2.13: a flipped byte in a tensor's data loads silently), so they guarded nothing on the
    way back, and the pass cost more than the write itself (64 MiB to memory: 0.111 s with it,
    0.044 s without). A storage checkpoint's files are guarded by their sha256, kept in the
    manifest: taken as they are written (``_Digest``: a background save, a URI) or read back
    after a synchronous save (``save``; until then, and if a failure comes first, by size).
    (Python's ``zipfile`` and ``unzip -t`` reject records with CRC 0: DCP's shard files are not
    zips to them anyway.)

    The option is process-wide (torch has no per-call one): counted over the files being
    written from any thread, restored after the last unless someone else changed it
    meanwhile. Any other ``torch.save`` in the process while a checkpoint is written, a
    background save's whole write included, writes no CRCs either."""
    entered = False
    try:
        with _crc:
            if _crc_writers[0] == 0:
                _crc_writers[1] = torch.serialization.get_crc32_options()
                torch.serialization.set_crc32_options(False)
            _crc_writers[0] += 1
            entered = True
        yield
    finally:
        if entered:
            with _crc:
                _crc_writers[0] -= 1
                if _crc_writers[0] == 0 and torch.serialization.get_crc32_options() is False:
                    torch.serialization.set_crc32_options(_crc_writers[1])


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


def _reader(directory: str | Path):
    d = str(directory)
    if is_uri(d):
        return FsspecReader(d)
    return FileSystemReader(d)


class _MergedReader(FsspecReader):
    """Reads an uncoordinated save (``snapshot``) through the metadata a coordinated one would
    have written: every rank's ``__R.metadata`` merged (chunks and storage entries; a tensor
    replicated over ranks kept once). A file held in memory (``memory_fs``) is read in place:
    each tensor copied once, from the file's own bytes into its target."""

    def __init__(self, directory: str, metadata_files: list[str], **storage_options):
        super().__init__(directory, **storage_options)
        self.metadata_files = metadata_files
        self.store: MemoryStore | None = storage_options.get("store")

    def read_metadata(self, *args, **kwargs) -> Metadata:
        parts = []
        for name in self.metadata_files:
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as f:
                parts.append(pickle.load(f))
        merged = Metadata(state_dict_metadata={}, planner_data={}, storage_data={},
                          storage_meta=parts[0].storage_meta or StorageMeta(), version=parts[0].version)
        for md in parts:
            for key, item in md.state_dict_metadata.items():
                have = merged.state_dict_metadata.setdefault(key, item)
                if have is not item and isinstance(item, TensorStorageMetadata):
                    seen = {(tuple(c.offsets), tuple(c.sizes)) for c in have.chunks}
                    have.chunks += [c for c in item.chunks
                                    if (tuple(c.offsets), tuple(c.sizes)) not in seen]
            merged.planner_data.update(md.planner_data or {})
            for index, info in md.storage_data.items():  # a replica's copy: one is enough
                merged.storage_data.setdefault(index, info)
        merged.storage_meta.load_id = self.load_id
        return merged

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        """DCP's read (``FsspecReader``) opens each tensor's record with ``torch.load``: a fresh
        buffer filled from the file, then copied into the target (128 MiB from memory: 0.03 s,
        most of it the fresh buffer's first touch). From a file in memory, only the record's
        layout is loaded (``map_location="meta"``, as torch's own experimental checkpoint
        reader does; noted already if the file was indexed, ``index_snapshot``) and the target
        copies straight from the file's bytes (``_copy_saved``)."""
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        elsewhere = []
        for name, items in per_file.items():
            path = str(self.fs.concat_path(self.path, name))
            with self.fs.create_stream(path, "rb") as stream:
                if isinstance(stream, io.BytesIO) and not any(
                        self.storage_data[i.storage_index].transform_descriptors for i in items):
                    held = self.store is not None and self.store.files.get(path) is stream
                    self._read_in_place(stream, items, planner, self.store.layouts.get(path, {}) if held else {})
                else:
                    elsewhere += items
        if elsewhere:
            return super().read_data(LoadPlan(elsewhere, plan.storage_data, plan.planner_data), planner)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done

    def _read_in_place(self, stream: io.BytesIO, items: list, planner: LoadPlanner,
                       layouts: dict[int, _Layout]) -> None:
        # The file's bytes, neither copied nor exported: BytesIO shares them with getvalue()
        # (getbuffer() would copy them whenever they are shared, as a peer's copy's are).
        data = memoryview(stream.getvalue())
        for item in items:
            info = self.storage_data[item.storage_index]
            record = data[info.offset:info.offset + info.length]
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(record.tobytes()))
                continue
            target = planner.resolve_tensor(item).detach()
            _copy_saved(record, layouts.get(info.offset) or _record_layout(record), item, target)
            planner.commit_tensor(item, target)


class _Layout(NamedTuple):
    """Where a ``torch.save``d tensor's bytes are in its record, and how it views them."""
    dtype: torch.dtype
    size: tuple
    stride: tuple
    storage_offset: int
    start: int | None  # the bytes' offset in the record (None: unknown, load it)
    numel: int  # of its storage


class _BufferReader(io.RawIOBase):
    """A read-only file over bytes it does not copy (``torch.load`` reads a record through it;
    each reader has its own position, so threads may read one file at once)."""

    def __init__(self, data: memoryview):
        super().__init__()
        self._data, self._pos = data, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self._pos = (pos, self._pos + pos, len(self._data) + pos)[whence]
        return self._pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), len(self._data) - self._pos))
        b[:n] = self._data[self._pos:self._pos + n]
        self._pos += n
        return n


def _record_layout(record: memoryview) -> _Layout:
    """The layout of the tensor ``torch.save`` wrote in ``record``: the record loaded without
    its data (``map_location="meta"``: torch notes where the data starts). The bytes are used
    as they are: a snapshot's writer and reader are the same job's hosts (a big-endian reader
    loads instead: torch swaps what a little-endian writer wrote)."""
    meta = torch.load(_BufferReader(record), map_location="meta", weights_only=True)
    storage = meta.untyped_storage()
    start = getattr(storage, "_checkpoint_offset", None) if sys.byteorder == "little" else None
    numel = storage.nbytes() // meta.element_size()
    if start is not None and not (0 <= start and start + storage.nbytes() <= len(record)):
        start = None  # (not where this record's bytes can be: load it)
    return _Layout(meta.dtype, tuple(meta.size()), meta.stride(), meta.storage_offset(), start, numel)


def _copy_saved(record: memoryview, layout: _Layout, item, target: torch.Tensor) -> None:
    """Copy ``item``'s part (its offsets and lengths) of the tensor ``torch.save`` wrote in
    ``record`` into ``target``, from the record's bytes: as bytes where the part and the target
    are both contiguous (DCP writes records back to back, so a tensor's bytes sit at any
    alignment in the file), else through a view of its dtype (aligned first if they are not);
    loaded with ``torch.load`` when the layout does not say where the bytes are."""
    if layout.start is None:
        saved = torch.load(_BufferReader(record), map_location="cpu", weights_only=True)
        part = narrow_tensor_by_index(saved, item.storage_offsets, item.lengths)
    else:
        size = layout.dtype.itemsize
        shape = torch.empty(layout.numel, dtype=layout.dtype, device="meta").as_strided(
            layout.size, layout.stride, layout.storage_offset)
        part = narrow_tensor_by_index(shape, item.storage_offsets, item.lengths)
    if target.size() != part.size():
        raise AssertionError(f"{item.storage_index}: size {tuple(part.size())} in the snapshot, "
                             f"{tuple(target.size())} to fill")
    if layout.start is not None and part.numel():
        if part.is_contiguous() and target.is_contiguous() and target.dtype == layout.dtype:
            src = torch.frombuffer(record, dtype=torch.uint8, count=part.numel() * size,
                                   offset=layout.start + part.storage_offset() * size)
            target.reshape(-1).view(torch.uint8).copy_(src)
            return
        flat = torch.frombuffer(record, dtype=torch.uint8, offset=layout.start, count=layout.numel * size)
        if flat.data_ptr() % size:
            flat = flat.clone()
        part = flat.view(layout.dtype).as_strided(part.size(), part.stride(), part.storage_offset())
    if part.numel():
        target.copy_(part)


def index_snapshot(store: MemoryStore, directory: str) -> None:
    """Note the layout of every tensor record of ``directory``'s files held in ``store`` (after a
    snapshot is saved or a peer's copy arrives, off the training thread), so that a restore
    from them only copies bytes. Best effort: a restore reads what is not noted."""
    try:
        held = set(store.held().get(directory, []))
        for name in sorted(n for n in held if n.endswith(".metadata")):
            raw = store.read(directory, name)
            if raw is None:  # dropped meanwhile (a newer snapshot came)
                return
            metadata: Metadata = pickle.loads(raw)
            per_file: dict[str, list] = {}
            for index, info in metadata.storage_data.items():
                if isinstance(metadata.state_dict_metadata.get(index.fqn), TensorStorageMetadata):
                    per_file.setdefault(info.relative_path, []).append(info)
            for rel, infos in per_file.items():
                f = store.files.get(uri(directory, rel))
                if f is None:
                    continue
                data = memoryview(f.getvalue())  # (shared, not copied: see _read_in_place)
                store.note_layouts(uri(directory, rel), f, {
                    i.offset: _record_layout(data[i.offset:i.offset + i.length]) for i in infos})
    except Exception as err:  # noqa: BLE001 - an optimisation: never fail a snapshot or a copy
        log.warning("in-memory snapshot %s not indexed: %s", directory, err)



_digester = ThreadPoolExecutor(1, thread_name_prefix="trainmesh-digest")  # saves' digests, in turn


class Saved(NamedTuple):
    """What a synchronous ``save`` wrote on this rank: each file's size (``sizes``, as
    ``{"size", "sha256": None}`` while its digest is being taken), known when it returns, and
    the future of their digests."""
    sizes: dict[str, dict[str, Any]]
    digests: Future


def save(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> Saved:
    """Collective: every rank of the job calls it with its own shards; returns once they are
    written and synced. The sha256 of each file this rank wrote is taken afterwards, off the
    training's path: a thread reads the files back (from the page cache, just written) while
    the next steps run. (Hashing them as they are written, as a background save does, cost
    this process a copy of every byte and slowed the write: 128 MiB, 2 cores: 0.18 s against
    0.13 s for the write alone.) On a URI they are digested as written (``storage_writer``)."""
    return save_state(directory, rank_state(model, optimizer))


def save_state(directory: str | Path, state: dict, **dcp_kwargs) -> Saved:
    """``save``'s write of a state dict (``dcp_kwargs``: DCP's, e.g. ``no_dist``)."""
    writer = storage_writer(directory, digest=False)
    dcp.save(state, storage_writer=writer, **dcp_kwargs)
    if writer.digests:  # (a URI's: taken as written)
        files, done = writer.files(), Future()
        done.set_result(files)
        return Saved(files, done)
    # Opened here, read there: the controller publishes the directory under its final name
    # meanwhile (a rename), and an open file is the same file after it (on a local or block
    # filesystem; on NFS a file the controller removes meanwhile — the same step saved again
    # — reads as stale, and that save's digests are not taken: the warning says so).
    with contextlib.ExitStack() as opened:
        files = {n: opened.enter_context(open(Path(directory) / n, "rb")) for n in writer.written}
        sizes = {n: {"size": os.fstat(f.fileno()).st_size, "sha256": None} for n, f in files.items()}
        digests = _digester.submit(_digests, files)
        opened.pop_all()  # (now the thread's to close)
    return Saved(sizes, digests)


def _digests(files: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{name: {"size", "sha256"}} of open files, read to their end and closed."""
    try:
        return {name: read_digest(f) for name, f in files.items()}
    finally:
        for f in files.values():
            f.close()


def rank_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """This rank's shards as every save here writes them: ``{"model": ..., "optim": ...}``
    keyed by global names (DTensors where sharded)."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTS)
    return {"model": model_sd, "optim": optim_sd}


class _RankWriter(FsspecWriter):
    """An uncoordinated save's writer that names its files after ``rank`` (``__R_*``,
    ``__R.metadata``) though DCP runs without a process group (``no_dist``: it tells the
    writer rank 0)."""

    def __init__(self, path: str, rank: int, **kwargs):
        super().__init__(path, **kwargs)
        self._own_rank = rank

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **{**kwargs, "rank": self._own_rank,
                                                                "use_collectives": False})


def snapshot(directory: str, rank: int, state: dict, store: MemoryStore) -> None:
    """Rank ``rank`` alone (the in-memory tier, ``memory_fs``; any thread) saves ``state`` (its
    shards as ``host_copy.HostCopy`` copied them) to ``directory`` with metadata of its own
    (``__R.metadata``, DCP's uncoordinated save).
    ``load_snapshot`` merges every rank's metadata. No process group is touched: DCP's
    uncoordinated save still ends in a barrier over the default group (torch 2.13), which
    from a background thread would interleave with the training thread's collectives."""
    # memory: nothing to sync (_writer); the state is in host memory already, so DCP's loader
    # must not synchronise the training thread's GPU stream (as it does when copying ahead)
    writer = _RankWriter(directory, rank, sync_files=False, per_thread_copy_ahead=0, store=store)
    with without_zip_crc():
        dcp.save(state, storage_writer=writer, no_dist=True, use_collectives=False)


def snapshot_reader(directory: str, metadata_files: list[str], store: MemoryStore) -> _MergedReader:
    """DCP's storage reader of an uncoordinated save (``snapshot``) in ``store``: the ranks'
    metadata (``metadata_files``) merged, tensors read in place."""
    return _MergedReader(directory, metadata_files, store=store)


def load_snapshot(directory: str, metadata_files: list[str], model: nn.Module,
                  optimizer: torch.optim.Optimizer, store: MemoryStore) -> None:
    """Collective: fill ``model`` and ``optimizer`` from an uncoordinated save (``snapshot``)
    made under any mesh: the ranks' metadata (``metadata_files``) merged into one, as a
    coordinated save would have written it, so DCP plans and reshards the load as usual."""
    state = rank_state(model, optimizer)
    dcp.load(state, storage_reader=snapshot_reader(directory, metadata_files, store))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=_OPTS)


def async_save(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
               group: dist.ProcessGroup, on_write: Callable[[], None] | None = None) -> Future:
    """Collective: copy this rank's shards to host memory now, write them in a background
    thread (coordinating over ``group``, a gloo group of its own so the writer never shares a
    communicator with training), then digest what this rank wrote. Returns a future of the
    digests (as ``save``); training may go on at once."""
    writer = storage_writer(directory)
    writer.on_write = on_write
    written = dcp.async_save(rank_state(model, optimizer), storage_writer=writer, process_group=group)
    digests: Future = Future()

    def then(f: Future) -> None:
        try:
            f.result()
            digests.set_result(writer.files())
        except BaseException as err:  # noqa: BLE001 - handed to whoever waits on the save
            digests.set_exception(err)

    written.add_done_callback(then)
    return digests


def load(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Collective: fill ``model`` (and ``optimizer``) in place from ``directory``."""
    if optimizer is None:
        model_sd = get_model_state_dict(model)
        dcp.load({"model": model_sd}, storage_reader=_reader(directory))
        set_state_dict(model, [], model_state_dict=model_sd, optim_state_dict={})
        return
    state = rank_state(model, optimizer)
    dcp.load(state, storage_reader=_reader(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=_OPTS)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: every parameter of ``model`` unsharded, on CPU, on every rank."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
    return {k: v.detach().cpu().clone() for k, v in get_model_state_dict(model, options=opts).items()}
