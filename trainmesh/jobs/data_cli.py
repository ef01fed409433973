"""``trainmesh data prepare``, ``trainmesh eval`` and ``trainmesh export``: data in, models
in and out."""

from __future__ import annotations

import argparse
import json
import os
import sys


def add_parsers(sub, add_spec_args) -> None:
    data = sub.add_parser("data", help="dataset tools").add_subparsers(dest="data_cmd", required=True)
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
    p = sub.add_parser("eval", help="held-out loss of a run's newest checkpoint (or of "
                                    "model.init_from when the run has none)")
    add_spec_args(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face Llama directory")
    p.add_argument("source", help="a run's output directory (its newest complete checkpoint) "
                                  "or a checkpoint's step-NNNNNN directory")
    p.add_argument("--hf", required=True, metavar="OUT", help="output directory")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="default: bfloat16 if the run trained in bfloat16, else float32")
    p.add_argument("--max-shard-size", type=int, default=2 << 30, metavar="BYTES")
    p.add_argument("--mlflow", action="store_true", help="also log OUT to the run's MLflow run")


def prepare(args: argparse.Namespace) -> int:
    from trainmesh.data.prepare import PrepareError
    from trainmesh.data.prepare import prepare as run

    if args.shard_tokens < 1:
        print(f"--shard-tokens {args.shard_tokens}: give a positive number", file=sys.stderr)
        return 2
    local = [p for p in args.inputs if "://" not in p]
    missing = [p for p in local if not os.path.isfile(p)]
    if missing:
        print(f"inputs: not a file: {', '.join(missing)}; pass existing files or URIs", file=sys.stderr)
        return 2
    try:
        meta = run(args.inputs, args.out, args.tokenizer, args.field, args.column, args.eos,
                   args.shard_tokens)
    except PrepareError as err:
        print(err, file=sys.stderr)
        return 2
    tok = meta["tokenizer"].get("source", meta["tokenizer"]["kind"])
    print(f"wrote {meta['tokens']:,} tokens of {meta['documents']:,} documents in "
          f"{len(meta['shards'])} shard(s) ({meta['dtype']}, vocabulary {meta['vocab_size']:,}, "
          f"tokenizer {tok}) to {args.out}")
    return 0


def evaluate(args: argparse.Namespace) -> int:
    from trainmesh.jobs.loading import Problem, SpecError, load_spec, unsupported_problems
    from trainmesh.jobs.runner import evaluate_job, loopback_environment

    spec = load_spec(args.spec, args.overrides)
    problems = unsupported_problems(spec)
    if not (spec.data.eval_path or spec.data.eval_fraction):
        problems.append(Problem("data.eval_path", "no held-out data", "set data.eval_path or "
                                "data.eval_fraction (e.g. --set data.eval_fraction=0.05)"))
    if problems:
        raise SpecError(problems)
    if spec.runtime.ray_address == "local":
        loopback_environment(os.environ)
    result = evaluate_job(spec, os.environ)
    if args.json:
        print(json.dumps(result))
    else:
        at = (f"checkpoint {result['checkpoint']} (step {result['step']})" if result["checkpoint"]
              else result["init_from"] or "the initial model (no checkpoint yet)")
        print(f"eval loss {result['eval_loss']:.4f} over {result['batches']} batch(es) for {at}")
    return 0


def export(args: argparse.Namespace) -> int:
    from trainmesh.interop.hf_export import ExportError
    from trainmesh.interop.hf_export import export as run

    try:
        done = run(args.source, args.hf, args.dtype, args.max_shard_size)
    except (ExportError, FileNotFoundError) as err:
        print(err, file=sys.stderr)
        return 2
    print(f"exported step {done['step']} ({done['tensors']} tensors, {done['bytes']:,} bytes "
          f"{done['dtype']}, {done['shards']} shard(s)) to {done['out']}")
    if args.mlflow:
        _log_to_mlflow(args.source, done)
    return 0


def _log_to_mlflow(source: str, done: dict) -> None:
    """Log the export under ``hf/`` in the run it came from (its summary.json names the tracking
    URI; else MLFLOW_TRACKING_URI)."""
    from pathlib import Path

    import mlflow

    summary = Path(source) / "summary.json"
    uri = json.loads(summary.read_text()).get("tracking_uri") if summary.is_file() else None
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not (uri and done["mlflow_run_id"]):
        print("--mlflow: the checkpoint names no MLflow run (or no tracking URI is known); "
              "not logged", file=sys.stderr)
        return
    mlflow.MlflowClient(uri).log_artifacts(done["mlflow_run_id"], done["out"], "hf")
    print(f"logged to MLflow run {done['mlflow_run_id']} at {uri} (artifacts hf/)")
