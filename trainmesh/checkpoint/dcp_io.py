"""Save and load model + optimizer state with torch Distributed Checkpoint.

Keys are the model's fully qualified parameter names (``layers.3.attention.wq.weight``), so a
checkpoint written under one mesh loads under any other: DCP reshards on load. A directory is
a local path or an fsspec URI (``s3://...``, ``file://...``); URIs go through DCP's fsspec
storage.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from trainmesh.checkpoint.manifest import is_uri

# Optimizer state flattened to one key per parameter and field ("state.layers.0...exp_avg",
# "param_groups.layers.0....lr"): no per-rank param_groups lists, so a rank holding other
# pipeline stages after a re-plan still finds every entry it needs.
_OPTS = StateDictOptions(flatten_optimizer_state_dict=True)


def _writer(directory: str | Path):
    d = str(directory)
    if is_uri(d):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(d)
    return FileSystemWriter(d)


def _reader(directory: str | Path):
    d = str(directory)
    if is_uri(d):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(d)
    return FileSystemReader(d)


def save(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Collective: every rank of the job calls it with its own shards."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTS)
    dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=_writer(directory))


def async_save(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
               group: dist.ProcessGroup) -> Future:
    """Collective: copy this rank's shards to host memory now, write them in a background
    thread (coordinating over ``group``, a gloo group of its own so the writer never shares a
    communicator with training). Returns the writer's future; training may go on at once."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTS)
    return dcp.async_save({"model": model_sd, "optim": optim_sd},
                          storage_writer=_writer(directory), process_group=group)


def load(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Collective: fill ``model`` (and ``optimizer``) in place from ``directory``."""
    if optimizer is None:
        model_sd = get_model_state_dict(model)
        dcp.load({"model": model_sd}, storage_reader=_reader(directory))
        set_state_dict(model, [], model_state_dict=model_sd, optim_state_dict={})
        return
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTS)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, storage_reader=_reader(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=_OPTS)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: every parameter of ``model`` unsharded, on CPU, on every rank."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
    return {k: v.detach().cpu().clone() for k, v in get_model_state_dict(model, options=opts).items()}
