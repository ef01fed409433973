"""The in-memory tier's files (``memory_fs``): a rank's uncoordinated save of its shards, and the
restore that merges every rank's metadata and copies each tensor straight from the file's bytes.
"""

from __future__ import annotations

import io
import logging
import pickle
import sys
import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.state_dict import set_state_dict

from trainmesh.checkpoint.dcp_io import STATE_OPTIONS, rank_state
from trainmesh.checkpoint.memory_fs import MemoryStore, uri
from trainmesh.checkpoint.zip_crc import without_zip_crc

log = logging.getLogger(__name__)

# A restore from memory reads tensors straight from a snapshot file's bytes (``_copy_saved``),
# which are immutable: torch warns, once, that a tensor over them could write to them. Such a
# tensor is only ever copied from.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


class _MergedReader(FsspecReader):
    """Reads an uncoordinated save (``snapshot``) through the metadata a coordinated one would
    have written: every rank's ``__R.metadata`` merged (chunks and storage entries; a tensor
    replicated over ranks kept once). A file held in memory (``memory_fs``) is read in place:
    each tensor copied once, from the file's own bytes into its target."""

    def __init__(self, directory: str, metadata_files: list[str], collective: bool = False,
                 **storage_options):
        super().__init__(directory, **storage_options)
        self.metadata_files = metadata_files
        self.collective = collective
        self.store: MemoryStore | None = storage_options.get("store")

    def read_metadata(self, *args, **kwargs) -> Metadata:
        """Every rank's metadata merged. ``collective`` (a ``dcp.load`` over the default
        process group, which calls this on every rank at the same point): rank 0 reads and
        merges the files and broadcasts the result, so the group fetches only the files rank 0
        lacks, not every file on every rank (ranks², each a call to the rank holding it)."""
        if kwargs.get("rank") is not None:  # (DCP's per-rank fallback: there is none here)
            raise FileNotFoundError("a snapshot has no per-rank global metadata")
        if not self.collective or dist.get_world_size() == 1:
            merged = self._merged()
        else:
            box: list = [None]
            failed: BaseException | None = None
            if dist.get_rank() == 0:
                try:
                    box = [(self._merged(), None)]
                except BaseException as e:  # (broadcast first: no rank waits on rank 0)
                    failed, box = e, [(None, f"{type(e).__name__}: {e}")]
            dist.broadcast_object_list(box, src=0)
            if failed is not None:
                raise failed
            merged, error = box[0]
            if error is not None:
                raise RuntimeError(f"rank 0 could not read the snapshot's metadata: {error}")
        merged.storage_meta.load_id = self.load_id
        return merged

    def _merged(self) -> Metadata:
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


def snapshot_reader(directory: str, metadata_files: list[str], store: MemoryStore,
                    collective: bool = False) -> _MergedReader:
    """DCP's storage reader of an uncoordinated save (``snapshot``) in ``store``: the ranks'
    metadata (``metadata_files``) merged, tensors read in place; ``collective``: for a
    ``dcp.load`` over the default process group (the metadata read once, by rank 0)."""
    return _MergedReader(directory, metadata_files, collective, store=store)


def load_snapshot(directory: str, metadata_files: list[str], model: nn.Module,
                  optimizer: torch.optim.Optimizer, store: MemoryStore) -> None:
    """Collective: fill ``model`` and ``optimizer`` from an uncoordinated save (``snapshot``)
    made under any mesh: the ranks' metadata (``metadata_files``) merged into one, as a
    coordinated save would have written it, so DCP plans and reshards the load as usual."""
    state = rank_state(model, optimizer)
    dcp.load(state, storage_reader=snapshot_reader(directory, metadata_files, store,
                                                   collective=dist.is_initialized()))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=STATE_OPTIONS)
