"""``trainmesh export``: a trainmesh checkpoint (any mesh) → a Hugging Face Llama directory
(config.json, generation_config.json, safetensors shards + index, tokenizer files), read from
the Distributed Checkpoint a few tensors at a time: no process ever holds the whole model."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from trainmesh.checkpoint.dcp_io import load_whole, storage_reader
from trainmesh.checkpoint.manifest import MANIFEST, CheckpointStore
from trainmesh.interop.hf_config import (
    HfConfigError,
    config_json,
    export_family,
    hf_expert_names,
    hf_name,
    hf_row,
    mtp_copies,
    rope_permuted,
)
from trainmesh.interop.hf_import import INDEX

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExportError(ValueError):
    """What cannot be exported, and what to give instead."""


def find_checkpoint(source: str) -> tuple[str, dict[str, Any]]:
    """(checkpoint directory, its manifest) for a run directory (its newest intact checkpoint,
    under ``checkpoints/`` or where summary.json's checkpoints are) or a checkpoint directory."""
    src = Path(source)
    if (src / MANIFEST).is_file():
        meta = CheckpointStore(src.parent.resolve()).read_manifest(str(src.resolve()), hashes=False)
        if meta is None:
            raise ExportError(f"{source}: its files do not match its {MANIFEST} (incomplete or "
                              "corrupt); pass an intact checkpoint")
        return str(src), meta
    roots = [src / "checkpoints"]
    if (src / "summary.json").is_file():
        published = json.loads((src / "summary.json").read_text()).get("checkpoints") or []
        roots += [Path(p).parent for p in published[-1:] if "://" not in p]
    for root in roots:
        if root.is_dir():
            found = CheckpointStore(root.resolve()).latest(hashes=False)
            if found:
                return found
    raise ExportError(f"{source}: no complete checkpoint (no {MANIFEST} there, nor under "
                      "checkpoints/); pass a run's output directory or a step-NNNNNN directory")


def export(source: str, out: str | Path, dtype: str | None = None,
           max_shard_bytes: int = 2 << 30) -> dict[str, Any]:
    """Write the Hugging Face Llama for ``source`` to ``out``; returns what was written."""
    ckpt, manifest = find_checkpoint(source)
    spec = manifest["spec"]
    model = spec["model"]
    dtype = dtype or ("bfloat16" if spec["training"]["dtype"] == "bfloat16" else "float32")
    reader = storage_reader(ckpt)
    try:
        family = export_family(model)  # before anything is written
    except HfConfigError as err:
        raise ExportError(str(err)) from None
    # Parameters, and DeepSeek-V3's balancing bias (a buffer; zero in a model the other
    # formats hold: export_family refuses one balanced by it).
    names = [k.removeprefix("model.") for k in reader.read_metadata().state_dict_metadata
             if k.startswith("model.") and (family == "deepseek_v3" or not k.endswith(".expert_bias"))]
    metadata = reader.read_metadata().state_dict_metadata
    experts = model["moe"]["experts"] if model.get("moe") else 0
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer_files(spec, out)  # first: a problem with it leaves no half-written export
    head_dim = model.get("head_dim") or model["dim"] // model["n_heads"]
    depth = (model.get("mtp") or {}).get("depth", 0)  # DeepSeek's copies under its MTP layers
    copies = mtp_copies(family, model["n_layers"], depth)
    weight_map: dict[str, str] = {}
    size = torch.empty((), dtype=DTYPES[dtype]).element_size()
    written = {n: int(torch.Size(metadata[f"model.{n}"].size).numel())  # (the routing bias in
               * (4 if n.endswith(".expert_bias") else size)            # float32; DeepSeek's
               * (1 + len(copies.get(n, []))) for n in names}           # MTP copies)
    shards = _plan_shards(names, written, max_shard_bytes)
    total = 0
    for i, group in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = _load(ckpt, group, {n: metadata[f"model.{n}"] for n in group})
        hf = {}
        for name in group:
            t = tensors.pop(name)
            if rope_permuted(name, family):
                t = _to_hf_rows(t, head_dim)
            per_expert = hf_expert_names(name, experts, family, model["n_layers"])
            parts = (zip(per_expert, t, strict=True) if per_expert else
                     [(hf_name(name, family, model["n_layers"]), t),
                      *((theirs, t.clone()) for theirs in copies.get(name, []))])
            for theirs, part in parts:  # a stacked expert weight: one tensor per expert
                keep = name.endswith(".expert_bias")  # float32, as DeepSeek's checkpoints
                hf[theirs] = part.to(torch.float32 if keep else DTYPES[dtype]).contiguous()
                total += hf[theirs].numel() * hf[theirs].element_size()
        _save(hf, out / fname)
        weight_map.update(dict.fromkeys(hf, fname))
        del hf
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                         "weight_map": dict(sorted(weight_map.items()))}, indent=1))
    eos, bos = tok.get("eos_id"), tok.get("bos_id")
    (out / "config.json").write_text(json.dumps(config_json(model, eos, bos, dtype=dtype), indent=1))
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": eos, "bos_token_id": bos}, indent=1))
    return {"checkpoint": ckpt, "step": manifest.get("step"), "out": str(out), "shards": len(shards),
            "tensors": len(weight_map), "bytes": total, "dtype": dtype,
            "tokenizer": tok.get("files", []), "mlflow_run_id": manifest.get("mlflow_run_id")}


def _plan_shards(names: list[str], written: dict[str, int], limit: int) -> list[list[str]]:
    """Tensors in order, cut into files of at most ``limit`` bytes (``written``: what each
    tensor becomes in the files, its copies included; a bigger one alone)."""
    groups: list[list[str]] = [[]]
    used = 0
    for n in names:
        nbytes = written[n]
        if groups[-1] and used + nbytes > limit:
            groups.append([])
            used = 0
        groups[-1].append(n)
        used += nbytes
    return groups


def _load(ckpt: str, names: list[str], meta: dict) -> dict[str, torch.Tensor]:
    """Just these tensors, whole, on CPU (DCP gathers them from every rank's shard file)."""
    state = {"model": {n: torch.empty(meta[n].size, dtype=meta[n].properties.dtype) for n in names}}
    load_whole(state, ckpt)
    return state["model"]


def _to_hf_rows(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    out = torch.empty_like(t)
    out[torch.tensor([hf_row(r, head_dim) for r in range(t.shape[0])])] = t
    return out


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(path)


def _tokenizer_files(spec: dict[str, Any], out: Path) -> dict[str, Any]:
    """Copy the run's tokenizer files (recorded in its dataset, a local path or a URI) beside
    the weights, checking that tokenizer.json is still the one the data was made with."""
    from fsspec.core import url_to_fs

    from trainmesh.data import tokenizer as byte_tokenizer
    from trainmesh.data.shards import read_meta

    path = spec.get("data", {}).get("path")
    if not path:
        return {"eos_id": byte_tokenizer.EOS, "bos_id": None, "files": []}
    meta = read_meta(path)
    tok = meta["tokenizer"]
    fs, root = url_to_fs(path)
    blobs = {name: fs.cat_file(f"{root}/{name}") for name in tok.get("files", [])}
    if "sha256" in tok and hashlib.sha256(blobs.get(tok["file"], b"")).hexdigest() != tok["sha256"]:
        raise ExportError(f"{path}/{tok['file']} is not the tokenizer the data was prepared with "
                          f"(sha256 {tok['sha256'][:12]}…); restore it, or export without it")
    for name, blob in blobs.items():
        (out / name).write_bytes(blob)
    return {"eos_id": meta["eos_id"], "bos_id": tok.get("bos_id"), "files": sorted(blobs)}
