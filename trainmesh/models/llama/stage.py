"""A pipeline stage: a view onto a contiguous run of a Llama's blocks (plus the embedding on
the first stage and the norm + head on the last). It shares the Llama's modules, so the Llama
that holds all of a rank's stages keeps the global parameter names for checkpoints."""

from __future__ import annotations

import torch
from torch import nn

from trainmesh.models.llama.model import Llama, decoder_forward
from trainmesh.models.llama.model_math import stage_blocks


def stage_layers(n_layers: int, num_stages: int, stage: int, split=None) -> range:
    """The global layer indices of ``stage`` (``model_math.stage_split``: ``split`` — the
    spec's ``parallelism.stage_layers`` — or an even split, the extra blocks of an uneven one
    on the stages between the first and the last)."""
    if n_layers < num_stages:
        raise ValueError(f"n_layers={n_layers} is fewer than pp × vpp = {num_stages} stages")
    return stage_blocks(n_layers, num_stages, stage, split)


class PipelineStage(nn.Module):
    def __init__(self, model: Llama, stage: int, num_stages: int, split=None):
        super().__init__()
        self.stage, self.num_stages = stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        ids = stage_layers(model.args.n_layers, num_stages, stage, split)
        self.tok_embeddings = model.tok_embeddings if self.is_first else None
        self.layers = nn.ModuleList([model.layers[str(i)] for i in ids])
        self.norm = model.norm if self.is_last else None
        self.output = model.output if self.is_last else None
        # Multi-token prediction with the head, and the embedding they read: the Llama's copy
        # where this rank holds the last stage without the first (``Llama``), or where it holds
        # both (a V schedule) a copy of its own (``Llama.mtp_lookup``): each stage's ZeRO-3
        # unit holds its own parameters
        self.mtp = model.mtp if self.is_last else None
        lookup = model.mtp_lookup if model.mtp_lookup is not None else model.tok_embeddings
        self.mtp_embeddings = lookup if self.mtp is not None and not self.is_first else None
        self.ops = model.ops
        # The RoPE tables stay the Llama's buffers (not a submodule: its other layers are not
        # this stage's): read through, so they follow the Llama's materialisation.
        object.__setattr__(self, "_owner", model)

    @property
    def rope_cos(self) -> torch.Tensor:
        return self._owner.rope_cos

    @property
    def rope_sin(self) -> torch.Tensor:
        return self._owner.rope_sin

    def forward(self, h: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Activations for the next stage; on the last stage, given ``targets``, the loss."""
        return decoder_forward(self, self.layers, h, targets)


def rank_model(model_args, pp_rank: int, pp: int, vpp: int,
               stages: list[int] | None = None, split=None) -> tuple[Llama, list[int]]:
    """The Llama holding exactly this rank's stages: ``stages``, by default round-robin (stage
    s on rank s % pp), of ``split``'s blocks (``stage_layers``)."""
    num_stages = pp * vpp
    stages = stages if stages is not None else [c * pp + pp_rank for c in range(vpp)]
    ids = [i for s in stages for i in stage_layers(model_args.n_layers, num_stages, s, split)]
    if model_args.tie_embeddings and pp > 1:
        raise ValueError("model.tie_embeddings needs the embedding on the last stage; set it "
                         "to false when parallelism.pp > 1")
    model = Llama(model_args, layer_ids=ids, has_embedding=0 in stages,
                  has_head=num_stages - 1 in stages)
    return model, stages
