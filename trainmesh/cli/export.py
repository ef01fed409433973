"""``trainmesh export``: a checkpoint written as a Hugging Face model directory (Llama, Mixtral or
Qwen3-MoE, whichever holds the model)."""

from __future__ import annotations

import argparse
import json
import os
import sys


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face model directory "
                                      "(Llama, Mixtral, Qwen3-MoE)")
    p.add_argument("source", help="a run's output directory (its newest complete checkpoint) "
                                  "or a checkpoint's step-NNNNNN directory")
    p.add_argument("--hf", required=True, metavar="OUT", help="output directory")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="default: bfloat16 if the run trained in bfloat16, else float32")
    p.add_argument("--max-shard-size", type=int, default=2 << 30, metavar="BYTES",
                   help="largest safetensors file written")
    p.add_argument("--mlflow", action="store_true", help="also log OUT to the run's MLflow run")
    return p


def run(args: argparse.Namespace) -> int:
    from trainmesh.interop.hf_export import ExportError
    from trainmesh.interop.hf_export import export as write_hf

    try:
        done = write_hf(args.source, args.hf, args.dtype, args.max_shard_size)
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
