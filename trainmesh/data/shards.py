"""Token datasets: flat binary shards of the smallest integer type that holds the vocabulary,
described by ``dataset.json`` (written last: a directory without it is not a dataset).

Layout of a dataset directory (a local path or any fsspec URI)::

    dataset.json        format, dtype, vocab_size, eos_id, tokenizer (kind, file, sha256),
                        shards [{file, tokens}], documents, tokens
    shard-00000.bin     little-endian tokens; documents concatenated, each followed by EOS
    tokenizer.json      a copy of the tokenizer it was made with (none for bytes)

Ranks never load a dataset whole: :class:`TokenStream` reads the tokens a sample needs with a
positioned read (local files; at most ``OPEN_FILES`` kept open) or one ranged GET (URIs: no
read-ahead cache, no handle kept), so a process's resident memory does not grow with the corpus
(a memory map would count every page it touched in the reader's RSS).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from trainmesh.data import corpus, tokenizer

FORMAT = "trainmesh-tokens/1"
OPEN_FILES = 64  # local shard files a reader keeps open (least recently used closed first)
META = "dataset.json"


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned integer type that holds every id below ``vocab_size``."""
    for dt in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dt).max + 1:
            return np.dtype(dt).newbyteorder("<")
    raise ValueError(f"a vocabulary of {vocab_size} tokens does not fit 32-bit ids")


class ShardWriter:
    """Writes token shards of at most ``shard_tokens`` tokens, then ``dataset.json``."""

    def __init__(self, out_dir: str, vocab_size: int, eos_id: int, tokenizer_meta: dict[str, Any],
                 shard_tokens: int = 1 << 28):
        self.fs, self.root = url_to_fs(str(out_dir))
        self.fs.makedirs(self.root, exist_ok=True)
        if self.fs.exists(f"{self.root}/{META}"):  # the old dataset stops being one first
            self.fs.rm(f"{self.root}/{META}")
        if shard_tokens < 1:
            raise ValueError(f"shard_tokens={shard_tokens}: give a positive number of tokens per shard")
        self.dtype, self.shard_tokens = token_dtype(vocab_size), shard_tokens
        self.meta: dict[str, Any] = {"format": FORMAT, "dtype": self.dtype.name, "vocab_size": vocab_size,
                                     "eos_id": eos_id, "tokenizer": tokenizer_meta, "shards": [],
                                     "documents": 0, "tokens": 0}
        self._buf: list[np.ndarray] = []
        self._buffered = 0

    def add(self, ids: Iterable[int] | np.ndarray) -> None:
        """One document's token ids (EOS is appended here)."""
        arr = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, dtype=np.int64)
        bad = arr[(arr < 0) | (arr >= self.meta["vocab_size"])]
        if len(bad):
            raise ValueError(f"token id {int(bad[0])} is outside the vocabulary of {self.meta['vocab_size']}")
        self._buf.append(np.append(arr, self.meta["eos_id"]).astype(self.dtype))
        self._buffered += len(arr) + 1
        self.meta["documents"] += 1
        while self._buffered >= self.shard_tokens:
            self._flush(self.shard_tokens)

    def _flush(self, n: int) -> None:
        flat = np.concatenate(self._buf) if self._buf else np.empty(0, self.dtype)
        head, rest = flat[:n], flat[n:]
        self._buf, self._buffered = ([rest] if len(rest) else []), len(rest)
        name = f"shard-{len(self.meta['shards']):05d}.bin"
        with self.fs.open(f"{self.root}/{name}", "wb") as f:
            f.write(head.tobytes())
        self.meta["shards"].append({"file": name, "tokens": int(len(head))})
        self.meta["tokens"] += int(len(head))

    def close(self) -> dict[str, Any]:
        if self._buffered or not self.meta["shards"]:
            self._flush(self._buffered)
        with self.fs.open(f"{self.root}/{META}.tmp", "w") as f:
            json.dump(self.meta, f, indent=1)
        self.fs.mv(f"{self.root}/{META}.tmp", f"{self.root}/{META}")
        return self.meta


def write_shards(docs: Iterable[str], out_dir: str | Path, shard_tokens: int = 1 << 28) -> dict[str, Any]:
    """Byte-tokenize ``docs`` into a dataset at ``out_dir``; returns its metadata."""
    w = ShardWriter(str(out_dir), tokenizer.VOCAB_SIZE, tokenizer.EOS, {"kind": "byte"}, shard_tokens)
    for doc in docs:
        w.add(tokenizer.encode(doc, add_eos=False))
    return w.close()


def ensure_tiny_corpus(out_dir: str | Path) -> Path:
    """Write the bundled synthetic corpus to ``out_dir`` once; return the directory."""
    out = Path(out_dir)
    if not (out / META).exists():
        write_shards(corpus.documents(), out, shard_tokens=1 << 16)
    return out


def resolve_data_dir(path: str | None, out_dir: str | Path) -> str:
    """The dataset a job reads: ``path`` (a URI as it is, a local path made absolute), or with
    none the bundled tiny corpus, prepared once under ``out_dir/data/tiny-corpus``."""
    if path:
        return path if "://" in path else str(Path(path).resolve())
    return str(ensure_tiny_corpus(Path(out_dir) / "data" / "tiny-corpus"))


def read_meta(path: str | Path) -> dict[str, Any]:
    """``dataset.json`` of the dataset at ``path``, with a clear error when there is none."""
    fs, root = url_to_fs(str(path))
    where = f"{root}/{META}"
    if not fs.exists(where):
        old = fs.glob(f"{root}/shard-*.parquet") if fs.isdir(root) else []
        hint = (" (it holds Parquet shards of an earlier trainmesh)" if old else "")
        raise FileNotFoundError(f"data.path {path}: no {META}{hint}; prepare it with "
                                "`trainmesh data prepare INPUTS --out DIR`")
    with fs.open(where, "r") as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(f"data.path {path}: format {meta.get('format')!r}, expected {FORMAT!r}; "
                         "prepare it again with this trainmesh")
    return meta


class TokenStream:
    """A dataset's tokens as one sequence, read on demand (never loaded whole)."""

    def __init__(self, path: str | Path):
        self.meta = read_meta(path)
        self.fs, self.root = url_to_fs(str(path))
        self.local = isinstance(self.fs, LocalFileSystem)
        self.dtype = np.dtype(self.meta["dtype"]).newbyteorder("<")
        self.files = [f"{self.root}/{s['file']}" for s in self.meta["shards"]]
        self.ends = np.cumsum([s["tokens"] for s in self.meta["shards"]])
        self._handles: dict[int, Any] = {}
        self._lock = threading.Lock()  # the open files, shared by a prefetch thread and the caller

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens ``[start, start + count)`` as int64 (they may span shards)."""
        return self.read_many([(start, count)])[0]

    def read_many(self, windows: list[tuple[int, int]]) -> list[np.ndarray]:
        """Each window ``(start, count)``'s tokens as int64. On a remote filesystem every piece
        is one ranged read and all of them go out at once (``cat_ranges``: concurrent GETs on
        an object store), not one after another."""
        pieces = []  # (window, shard, offset, tokens)
        for k, (start, count) in enumerate(windows):
            if start < 0 or start + count > len(self):
                raise IndexError(f"tokens {start}:{start + count} outside a stream of {len(self)}")
            pos, end = start, start + count
            while pos < end:
                i = int(np.searchsorted(self.ends, pos, side="right"))
                first = int(self.ends[i - 1]) if i else 0
                n = min(end, int(self.ends[i])) - pos
                pieces.append((k, i, pos - first, n))
                pos += n
        if self.local:
            raws = [self._read_shard(i, off, n) for _, i, off, n in pieces]
        else:
            size = self.dtype.itemsize
            got = self.fs.cat_ranges([self.files[i] for _, i, _, _ in pieces],
                                     [off * size for _, _, off, _ in pieces],
                                     [(off + n) * size for _, _, off, n in pieces])
            raws = [self._checked(i, raw, n) for (_, i, _, n), raw in zip(pieces, got, strict=True)]
        parts: list[list[np.ndarray]] = [[] for _ in windows]
        for (k, _, _, _), raw in zip(pieces, raws, strict=True):
            parts[k].append(raw)
        return [np.concatenate(p).astype(np.int64) if p else np.empty(0, np.int64) for p in parts]

    def _checked(self, i: int, raw, n: int) -> np.ndarray:
        if isinstance(raw, BaseException):
            raise raw
        if len(raw) != n * self.dtype.itemsize:
            raise OSError(f"{self.files[i]}: short read ({len(raw)} of {n * self.dtype.itemsize} "
                          "bytes); the dataset is truncated, prepare it again")
        return np.frombuffer(raw, dtype=self.dtype)

    def _read_shard(self, i: int, offset: int, n: int) -> np.ndarray:
        size = self.dtype.itemsize
        if self.local:
            with self._lock:  # (a file is not closed while another thread reads it)
                fd = self._handles.pop(i, None)
                if fd is None:
                    fd = os.open(self.files[i], os.O_RDONLY)
                    if len(self._handles) >= OPEN_FILES:
                        os.close(self._handles.pop(next(iter(self._handles))))
                self._handles[i] = fd  # most recently used last
                raw = os.pread(fd, n * size, offset * size)
        else:
            raw = self.fs.cat_file(self.files[i], start=offset * size, end=(offset + n) * size)
        return self._checked(i, raw, n)

    def close(self) -> None:
        with self._lock:
            for fd in self._handles.values():
                os.close(fd)
            self._handles.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown
            pass


def read_tokens(path: str | Path) -> np.ndarray:
    """The whole token stream, int64 — for tests and small tools only; training streams."""
    stream = TokenStream(path)
    return stream.read(0, len(stream))
