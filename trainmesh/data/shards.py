"""Pre-tokenized token shards on Parquet: one flat ``tokens`` int32 column per file.

Documents are concatenated, each followed by EOS. A dataset is a directory of
``shard-NNNNN.parquet`` files read in name order as one token stream.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from trainmesh.data import corpus, tokenizer

SHARD_GLOB = "shard-*.parquet"


def write_shards(docs: Iterable[str], out_dir: str | Path, shard_tokens: int = 1 << 20) -> list[Path]:
    """Tokenize ``docs`` and write them as shards of at most ``shard_tokens`` tokens."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    buf: list[int] = []

    def flush() -> None:
        path = out / f"shard-{len(paths):05d}.parquet"
        tmp = path.with_suffix(".tmp")
        table = pa.table({"tokens": pa.array(buf, type=pa.int32())},
                         metadata={"tokenizer": "byte", "vocab_size": str(tokenizer.VOCAB_SIZE)})
        pq.write_table(table, tmp)
        tmp.replace(path)
        paths.append(path)
        buf.clear()

    for doc in docs:
        buf.extend(tokenizer.encode(doc))
        while len(buf) >= shard_tokens:
            rest = buf[shard_tokens:]
            del buf[shard_tokens:]
            flush()
            buf.extend(rest)
    if buf or not paths:
        flush()
    return paths


def prepare_text_files(inputs: Iterable[str | Path], out_dir: str | Path,
                       shard_tokens: int = 1 << 20) -> list[Path]:
    """``trainmesh data prepare``: each input text file is one document."""
    docs = (Path(p).read_text(encoding="utf-8", errors="replace") for p in inputs)
    return write_shards(docs, out_dir, shard_tokens)


def ensure_tiny_corpus(out_dir: str | Path) -> Path:
    """Write the bundled synthetic corpus to ``out_dir`` once; return the directory."""
    out = Path(out_dir)
    if not any(out.glob(SHARD_GLOB)):
        write_shards(corpus.documents(), out, shard_tokens=1 << 16)
    return out


def read_tokens(data_dir: str | Path) -> np.ndarray:
    """The whole token stream of a shard directory, int64."""
    files = sorted(Path(data_dir).glob(SHARD_GLOB))
    if not files:
        raise FileNotFoundError(f"no {SHARD_GLOB} files in {data_dir}: run `trainmesh data prepare`")
    parts = [pq.read_table(f, columns=["tokens"]).column(0).to_numpy() for f in files]
    return np.concatenate(parts).astype(np.int64)
