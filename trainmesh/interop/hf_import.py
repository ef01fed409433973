"""Fill a model part — plain, or TP/EP/FSDP-sharded DTensors, any pipeline stages — from a
Hugging Face Llama, Mixtral, Qwen3-MoE or DeepSeek-V3 directory: each rank reads only the rows and columns it holds
(safetensors slices; of stacked expert weights, only its experts' tensors), with ``wq``/``wk``
rows mapped from the half-split RoPE layout (``hf_config``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from trainmesh.interop.hf_config import (
    hf_expert_names,
    hf_name,
    hf_row,
    read_config,
    rope_permuted,
)
from trainmesh.models.llama.init import local_slice

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def weight_files(path: str | Path) -> dict[str, Path]:
    """Hugging Face tensor name → the safetensors file holding it."""
    root = Path(path)
    if "://" in str(path):
        raise ValueError(f"model.init_from {path}: give a local (or mounted shared) directory; "
                         "safetensors are read in slices from local files")
    if (root / INDEX).is_file():
        weight_map = json.loads((root / INDEX).read_text())["weight_map"]
        return {name: root / file for name, file in weight_map.items()}
    if (root / SINGLE).is_file():
        from safetensors import safe_open

        with safe_open(root / SINGLE, "pt") as f:
            return {name: root / SINGLE for name in f.keys()}  # noqa: SIM118 - not a dict
    raise FileNotFoundError(f"model.init_from {path}: neither {INDEX} nor {SINGLE} is there")


@torch.no_grad()
def load_into(model: nn.Module, path: str | Path) -> int:
    """Copy this process's part of every parameter of ``model`` (a trainmesh Llama, possibly a
    few pipeline stages of one, sharded or not) from ``path``. Returns the bytes read."""
    from safetensors import safe_open

    files = weight_files(path)
    family = read_config(str(path)).get("model_type", "llama")
    head_dim, n_layers = model.args.head_dim, model.args.n_layers
    experts = model.args.moe.experts if model.args.moe is not None else 0
    handles: dict[Path, object] = {}

    def absent_module(name: str) -> bool:
        """A multi-token prediction module the directory does not hold (none of its own
        tensors): it keeps its seeded initialisation (``engine.init_weights``)."""
        if not name.startswith("mtp."):
            return False
        return hf_name(".".join(name.split(".")[:2]) + ".eh_proj.weight", family, n_layers) not in files

    def tensor(theirs: str, name: str, shape: tuple[int, ...]):
        if theirs not in files:
            raise KeyError(f"model.init_from {path}: no tensor {theirs} (for {name})")
        file = files[theirs]
        if file not in handles:
            handles[file] = safe_open(file, "pt", device="cpu")
        sl = handles[file].get_slice(theirs)
        if tuple(sl.get_shape()) != shape:
            raise ValueError(f"model.init_from {path}: {theirs} is {tuple(sl.get_shape())}, "
                             f"the model's {name} needs {shape}")
        return sl

    read = 0
    try:
        for name, p in model.named_parameters():
            if absent_module(name):
                continue
            local, offset = local_slice(p)
            per_expert = hf_expert_names(name, experts, family, n_layers)
            if per_expert is None:
                sl = tensor(hf_name(name, family, n_layers), name, tuple(p.shape))
                if local.numel() == 0:
                    continue
                block = _read_block(sl, offset, tuple(local.shape),
                                    head_dim if rope_permuted(name, family) else 0)
            else:  # this rank's experts (rows of dim 0), each its own tensor in the file
                if local.numel() == 0:
                    continue
                block = torch.stack([
                    _read_block(tensor(per_expert[e], name, tuple(p.shape[1:])), offset[1:],
                                tuple(local.shape[1:]), 0)
                    for e in range(offset[0], offset[0] + local.shape[0])])
            local.copy_(block.to(local.dtype))
            read += block.numel() * block.element_size()
        for name, b in model.named_buffers():  # DeepSeek's routing bias: whole on every rank
            if name.endswith(".expert_bias") and family == "deepseek_v3" and not absent_module(name):
                b.copy_(tensor(hf_name(name, family, n_layers), name, tuple(b.shape))[:].to(b.dtype))
                read += b.numel() * b.element_size()
    finally:
        handles.clear()
    return read


def _read_block(sl, offset: tuple[int, ...], shape: tuple[int, ...], head_dim: int) -> torch.Tensor:
    """Rows ``offset[0]:+shape[0]`` (and the same for the columns) of a safetensors slice; with
    ``head_dim``, the rows of trainmesh's RoPE layout, gathered from Hugging Face's."""
    cols = tuple(slice(o, o + n) for o, n in zip(offset[1:], shape[1:], strict=True))
    r0, r1 = offset[0], offset[0] + shape[0]
    if not head_dim:
        return sl[(slice(r0, r1), *cols)]
    src = torch.tensor([hf_row(r, head_dim) for r in range(r0, r1)])
    lo, hi = int(src.min()), int(src.max()) + 1  # whole heads: a small superset of the rows
    return sl[(slice(lo, hi), *cols)][src - lo]
