"""A pipeline stage's parameters from the model's shape alone (no torch): which rank holds the
head, and how many elements its part has, split by how tensor and expert parallel shard them.
The planner's memory and time estimates (``memory_model``, ``cost_model``) and the failure costs read them;
a plan's search asks ~10^5 times, so the counts are kept for its length (``memoized``).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

from trainmesh.models.llama.model_math import (
    attention_replicated,
    layer_params,
    mlp_params,
    stage_split,
)
from trainmesh.parallel.pipeline.ir import v_shaped


def holds_head(schedule: str, pp: int, pp_rank: int) -> bool:
    """Whether pipeline rank ``pp_rank`` holds the last stage (norm, head, loss): the last
    rank, or the first for a V (ZBV, DualPipeV)."""
    return pp_rank == (0 if v_shaped(schedule) and pp > 1 else pp - 1)


@dataclass(frozen=True)
class RankParams:
    """Parameters of one rank's model part, split by how TP and EP shard them."""

    tp_sharded: int  # matrices (attention, dense MLP, embedding, head): divided over tp
    replicated: int  # norm weights, MoE routers and shared experts: whole on every tp rank
    per_layer: int
    experts: int = 0  # routed experts: divided over ep (an MoE block is not split over tp)
    # One block's parts (the heaviest block: an MoE one if the model has any).
    layer_tp_sharded: int = 0
    layer_replicated: int = 0
    layer_experts: int = 0
    # What the part holds: its dense and MoE blocks, its multi-token prediction modules
    dense_blocks: int = 0
    moe_blocks: int = 0
    mtp_modules: int = 0

    def local(self, tp: int, dp: int) -> float:
        """Elements of this rank's ZeRO-3 shards (experts: over ep, then the rest of dp)."""
        return (self.tp_sharded / tp + self.replicated + self.experts) / dp

    def gathered(self, tp: int, ep: int = 1) -> float:
        return self.tp_sharded / tp + self.replicated + self.experts / ep

    def layer_gathered(self, tp: int, ep: int = 1) -> float:
        """One block as ZeRO-3 gathers it on a rank."""
        return self.layer_tp_sharded / tp + self.layer_replicated + self.layer_experts / ep


def _block_parts(model, layer: int | None) -> tuple[int, int, int]:
    """(tp-sharded, replicated, expert) elements of block ``layer`` (None: the heaviest): the
    norms, what the attention keeps whole on each tp rank (``attention_replicated``) and an MoE
    block's router and shared experts are replicated."""
    d = model.dim
    total = layer_params(model, layer)
    whole = 2 * d + attention_replicated(model)
    moe = getattr(model, "moe", None)
    if moe is None or (layer is not None and layer < moe.dense_layers):
        return total - whole, whole, 0
    experts = moe.experts * 3 * d * moe.expert_ffn_dim
    mlp = mlp_params(model, layer)
    return total - 2 * d - mlp - attention_replicated(model), whole + mlp - experts, experts


_memo = threading.local()  # rank_params' results while ``memoized`` (per thread)


@contextlib.contextmanager
def memoized():
    """Within it, ``rank_params`` (and what the cost model keeps through ``memo``) keeps what
    it computed for each model and stage: a plan's search asks the same ~10^5 times. The
    models asked about must not change meanwhile."""
    outer = getattr(_memo, "rank_params", None)
    if outer is None:
        _memo.rank_params = {}
    try:
        yield
    finally:
        if outer is None:
            _memo.rank_params = None


def memo(kind: str, model, key: tuple, compute):
    """``compute()``, kept under (``kind``, the model, ``key``) while ``memoized``: the cost
    model's parts that many candidates share (``key`` holds every other input they read)."""
    cache = getattr(_memo, "rank_params", None)
    if cache is None:
        return compute()
    full = (kind, id(model), *key)
    hit = cache.get(full)
    if hit is None or hit[0] is not model:  # (the model is kept: its id stays its own)
        hit = cache[full] = (model, compute())
    return hit[1]


def rank_params(model, pp: int, pp_rank: int, schedule: str = "1f1b", vpp: int = 1,
                split: tuple[int, ...] | None = None) -> RankParams:
    """The parameters of pipeline rank ``pp_rank``: its blocks (its vpp chunks' of the
    pp × vpp stages, ``model_math.stage_split``: ``split`` or the default), the embedding on
    the first, the head where the schedule puts it."""
    last = holds_head(schedule, pp, pp_rank)
    return memo("rank_params", model, (pp, pp_rank, last, vpp, split),
                lambda: _rank_params(model, pp, pp_rank, last, vpp, split))


def _rank_params(model, pp: int, pp_rank: int, last: bool, vpp: int = 1,
                 split: tuple[int, ...] | None = None) -> RankParams:
    d, V = model.dim, model.vocab_size
    counts = stage_split(model.n_layers, pp * vpp, split)  # (uneven where pp × vpp do not divide)
    starts = [sum(counts[:s]) for s in range(len(counts))]
    chunks = [c * pp + pp_rank for c in range(vpp)]  # round-robin (zbv's V: even splits only)
    layers = sum(counts[s] for s in chunks)
    # the model's dense blocks come first (its moe.dense_layers), then its MoE blocks; blocks
    # of a kind are alike (counted once: the planner asks this ~10^5 times)
    moe = getattr(model, "moe", None)
    dense_end = model.n_layers if moe is None else moe.dense_layers
    n_dense = sum(max(0, min(starts[s] + counts[s], dense_end) - starts[s]) for s in chunks)
    sharded = replicated = experts = 0
    for n, layer in ((n_dense, 0), (layers - n_dense, model.n_layers - 1)):  # (a block of each kind)
        if n:
            t, r, e = _block_parts(model, layer)
            sharded, replicated, experts = sharded + n * t, replicated + n * r, experts + n * e
    first = pp_rank == 0
    if first:
        sharded += V * d
    depth = getattr(getattr(model, "mtp", None), "depth", 0)
    if last:
        replicated += d
        if not (model.tie_embeddings and first):
            sharded += V * d
        if depth:  # multi-token prediction's modules, with the head: each a block of the
            # model's last kind (its experts over ep), its projection and three norms, and a
            # copy of the embedding (``parallel/pipeline/shared.py``: on a stage without the
            # embedding; beside it, a V schedule's rank 0, one in neither optimizer nor
            # checkpoint, counted here as a parameter all the same)
            t, r, e = _block_parts(model, model.n_layers)
            sharded += depth * (t + 2 * d * d) + (V * d if pp > 1 else 0)
            replicated += depth * (r + 3 * d)
            experts += depth * e
    lt, lr, le = _block_parts(model, None)
    return RankParams(sharded, replicated, layer_params(model), experts, lt, lr, le,
                      n_dense, layers - n_dense, depth if last else 0)


def block_tensors(model, moe_block: bool) -> int:
    """Parameter tensors of one block: its two norms, the attention's (GQA: q, k, v, o and any
    per-head q/k norms; Multi-head Latent Attention: the query's one or three, the key/value
    latent's three, the output), the MLP's three, or an MoE block's router, three stacked
    expert tensors and a shared expert's three."""
    mla = getattr(model, "mla", None)
    if mla is None:
        attention = 4 + 2 * bool(getattr(model, "qk_norm", False))
    else:
        attention = (1 if mla.q_lora_rank is None else 3) + 3 + 1
    moe = getattr(model, "moe", None)
    mlp = 3 if not moe_block or moe is None else 4 + 3 * (moe.shared_experts > 0)
    return 2 + attention + mlp


def mtp_block_is_moe(model) -> bool:
    """Whether the multi-token modules' blocks are MoE blocks: built after the model's last
    (layer n_layers and on), they are wherever the model has experts at all."""
    moe = getattr(model, "moe", None)
    return moe is not None and model.n_layers >= moe.dense_layers
