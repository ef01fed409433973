"""``trainmesh data prepare``: tokenize text, JSONL or Parquet inputs into a token dataset."""

from __future__ import annotations

import argparse
import os
import sys


def add_parser(sub) -> argparse.ArgumentParser:
    top = sub.add_parser("data", help="dataset tools")
    data = top.add_subparsers(dest="data_cmd", required=True)
    p = data.add_parser("prepare", help="tokenize text, JSONL or Parquet inputs into a token dataset")
    p.add_argument("inputs", nargs="+", help="files or fsspec URIs: *.jsonl[.gz] (one document per "
                   "line's --field), *.parquet (one per row's --column), anything else: one "
                   "document per file")
    p.add_argument("--out", required=True, help="dataset directory (local or fsspec URI)")
    p.add_argument("--tokenizer", default=None, help="a tokenizer.json, or a directory with one "
                   "(e.g. a Hugging Face model); default: bytes")
    p.add_argument("--field", default="text", help="JSONL: the field holding the text")
    p.add_argument("--column", default="text", help="Parquet: the column holding the text")
    p.add_argument("--eos", default=None, help="the end-of-document token (default: the "
                   "tokenizer's <|end_of_text|>, </s>, ... whichever it has)")
    p.add_argument("--shard-tokens", type=int, default=1 << 28, help="tokens per shard file")
    return top


def run(args: argparse.Namespace) -> int:
    from trainmesh.data.prepare import PrepareError, prepare

    if args.shard_tokens < 1:
        print(f"--shard-tokens {args.shard_tokens}: give a positive number", file=sys.stderr)
        return 2
    local = [p for p in args.inputs if "://" not in p]
    missing = [p for p in local if not os.path.isfile(p)]
    if missing:
        print(f"inputs: not a file: {', '.join(missing)}; pass existing files or URIs", file=sys.stderr)
        return 2
    try:
        meta = prepare(args.inputs, args.out, args.tokenizer, args.field, args.column, args.eos,
                   args.shard_tokens)
    except PrepareError as err:
        print(err, file=sys.stderr)
        return 2
    tok = meta["tokenizer"].get("source", meta["tokenizer"]["kind"])
    print(f"wrote {meta['tokens']:,} tokens of {meta['documents']:,} documents in "
          f"{len(meta['shards'])} shard(s) ({meta['dtype']}, vocabulary {meta['vocab_size']:,}, "
          f"tokenizer {tok}) to {args.out}")
    return 0
