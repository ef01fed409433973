"""``trainmesh data prepare``: documents from text, JSONL or Parquet inputs (local paths or
fsspec URIs, compression inferred from the name), tokenized with the byte tokenizer or a
``tokenizers`` tokenizer, written as a token dataset (``shards.py``)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from trainmesh.data import tokenizer as byte_tokenizer
from trainmesh.data.shards import ShardWriter

EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
BATCH_DOCS = 1024


class PrepareError(ValueError):
    """A bad input to ``data prepare``, with what to do about it."""


def input_kind(path: str) -> str:
    name = path.lower()
    for suffix in (".gz", ".bz2", ".xz", ".zst", ".zstd"):
        name = name.removesuffix(suffix)
    if name.endswith((".jsonl", ".ndjson")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def documents(path: str, field: str = "text", column: str = "text") -> Iterator[str]:
    """The documents of one input: a text file is one document, a JSONL line's ``field`` one,
    a Parquet row's ``column`` one."""
    kind = input_kind(path)
    if kind == "parquet":
        import pyarrow.parquet as pq

        fs, p = url_to_fs(path)
        with fs.open(p, "rb") as f:
            pf = pq.ParquetFile(f)
            if column not in pf.schema_arrow.names:
                raise PrepareError(f"{path}: no column {column!r} (columns: "
                                   f"{', '.join(pf.schema_arrow.names)}); pass --column NAME")
            for batch in pf.iter_batches(columns=[column], batch_size=BATCH_DOCS):
                yield from (d for d in batch.column(0).to_pylist() if d)
        return
    with fsspec.open(path, "rt", encoding="utf-8", errors="replace", compression="infer") as f:
        if kind == "text":
            yield f.read()
            return
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise PrepareError(f"{path}:{n}: not JSON ({err.msg}); each line must be one "
                                   "JSON object") from None
            if not isinstance(row, dict) or field not in row:
                raise PrepareError(f"{path}:{n}: no field {field!r}; pass --field NAME")
            if row[field]:
                yield str(row[field])


def resolve_tokenizer_file(path: str) -> str:
    """``path`` itself, or the ``tokenizer.json`` in the directory ``path``."""
    fs, p = url_to_fs(path)
    if fs.isdir(p):
        p = f"{p.rstrip('/')}/tokenizer.json"
    if not fs.isfile(p):
        raise PrepareError(f"--tokenizer {path}: no tokenizer.json there; pass a tokenizer.json "
                           "or a directory holding one (a Hugging Face model directory)")
    return fs.unstrip_protocol(p) if "://" in path else p


class Encoder:
    """Documents → token ids, and what the dataset records about the tokenizer."""

    def __init__(self, tokenizer_path: str | None = None, eos: str | None = None):
        if tokenizer_path is None:
            self.vocab_size, self.eos_id = byte_tokenizer.VOCAB_SIZE, byte_tokenizer.EOS
            self.meta: dict[str, Any] = {"kind": "byte"}
            self.files: dict[str, bytes] = {}
            self._batch: Callable[[list[str]], list[list[int]]] = (
                lambda docs: [byte_tokenizer.encode(d, add_eos=False) for d in docs])
            return
        from tokenizers import Tokenizer

        file = resolve_tokenizer_file(tokenizer_path)
        with fsspec.open(file, "rb") as f:
            blob = f.read()
        tok = Tokenizer.from_str(blob.decode("utf-8"))
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        names = [eos] if eos else [c for c in EOS_CANDIDATES if tok.token_to_id(c) is not None][:1]
        if not names or tok.token_to_id(names[0]) is None:
            raise PrepareError(f"--tokenizer {tokenizer_path}: " + (
                f"has no token {eos!r}" if eos else "has none of the usual end-of-document "
                f"tokens ({', '.join(EOS_CANDIDATES)})") + "; pass --eos TOKEN, a token it has")
        self.eos_id = tok.token_to_id(names[0])
        # What the tokenizer's own post-processor adds around a document (Llama 3: BOS first):
        # kept, recorded; an EOS it appends itself is not appended twice.
        probe = tok.encode("", add_special_tokens=True).ids
        bos = probe[0] if probe and probe[0] != self.eos_id else None
        own_eos = bool(probe) and probe[-1] == self.eos_id
        self.files = {"tokenizer.json": blob, **_companions(file)}
        self.meta = {"kind": "tokenizers", "file": "tokenizer.json", "source": tokenizer_path,
                     "sha256": hashlib.sha256(blob).hexdigest(), "eos": names[0], "bos_id": bos,
                     "files": sorted(self.files)}
        self._batch = lambda docs: [e.ids[:-1] if own_eos else e.ids
                                    for e in tok.encode_batch(docs, add_special_tokens=True)]

    def encode_batch(self, docs: list[str]) -> list[list[int]]:
        return self._batch(docs)


def _companions(tokenizer_file: str) -> dict[str, bytes]:
    """The files beside a tokenizer.json that Hugging Face tools read with it."""
    fs, p = url_to_fs(tokenizer_file)
    out = {}
    for name in TOKENIZER_FILES[1:]:
        q = f"{p.rsplit('/', 1)[0]}/{name}" if "/" in p else name
        if fs.isfile(q):
            out[name] = fs.cat_file(q)
    return out


def prepare(inputs: Iterable[str | Path], out_dir: str | Path, tokenizer_path: str | None = None,
            field: str = "text", column: str = "text", eos: str | None = None,
            shard_tokens: int = 1 << 28) -> dict[str, Any]:
    """Tokenize every document of ``inputs`` into a dataset at ``out_dir``; its metadata."""
    enc = Encoder(tokenizer_path, eos)
    writer = ShardWriter(str(out_dir), enc.vocab_size, enc.eos_id, enc.meta, shard_tokens)
    for name, blob in enc.files.items():
        with writer.fs.open(f"{writer.root}/{name}", "wb") as f:
            f.write(blob)
    batch: list[str] = []
    for path in inputs:
        for doc in documents(str(path), field, column):
            batch.append(doc)
            if len(batch) == BATCH_DOCS:
                for ids in enc.encode_batch(batch):
                    writer.add(ids)
                batch.clear()
    for ids in enc.encode_batch(batch):
        writer.add(ids)
    return writer.close()
