"""Parameter and FLOP counts from a model's shape alone (no torch: the planner uses them).

``shape`` is anything with the Llama shape fields: a ``ModelConfig`` or a ``LlamaArgs``; its
``moe`` (a ``MoEConfig``, ``MoEArgs`` or None) makes blocks after ``moe.dense_layers``
Mixture-of-Experts blocks.
"""

from __future__ import annotations

import functools


def _moe(shape, layer: int | None):
    moe = getattr(shape, "moe", None)
    if moe is None or (layer is not None and layer < moe.dense_layers):
        return None
    return moe


def mlp_params(shape, layer: int | None = None, active: bool = False) -> int:
    """The MLP of block ``layer`` (None: an MoE block if the model has any): SwiGLU, or the
    router, the routed experts (``active``: only the top-k a token uses) and the shared one."""
    d, moe = shape.dim, _moe(shape, layer)
    if moe is None:
        return 3 * d * shape.ffn_dim
    routed = moe.top_k if active else moe.experts
    return 3 * d * moe.expert_ffn_dim * (routed + moe.shared_experts) + d * moe.experts


def head_dim(shape) -> int:
    return getattr(shape, "head_dim", None) or shape.dim // shape.n_heads


def attention_params(shape) -> int:
    """Grouped-query attention's (with per-head q/k norms if any), or Multi-head Latent
    Attention's: the query's low-rank pair and its norm (or one full projection), the key/value
    latent with the shared rotary key and its norm, the per-head expansion, the output."""
    d, h, mla = shape.dim, shape.n_heads, getattr(shape, "mla", None)
    if mla is None:
        hd = head_dim(shape)
        qk_norm = 2 * hd if getattr(shape, "qk_norm", False) else 0
        return 2 * d * h * hd + 2 * d * shape.n_kv_heads * hd + qk_norm
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    qr = mla.q_lora_rank
    q = d * h * qk if qr is None else d * qr + qr + qr * h * qk
    kv = d * (mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.kv_lora_rank + (
        mla.kv_lora_rank * h * (mla.qk_nope_head_dim + mla.v_head_dim))
    return q + kv + h * mla.v_head_dim * d


def linear_shapes(shape, layer: int | None = None) -> list[tuple[int, int, float, int]]:
    """The linear layers of block ``layer`` (None: an MoE block if the model has any) that
    ``training.float8`` runs in float8, as (in features, out features, copies of a token
    through it, matrices of that shape the block holds): the attention's projections, the
    SwiGLU's three, or the routed experts' (top_k copies of a token; one matrix per expert)
    and the shared experts'; not the router."""
    d, h, mla = shape.dim, shape.n_heads, getattr(shape, "mla", None)
    if mla is None:
        hd, kv = head_dim(shape), shape.n_kv_heads
        out = [(d, h * hd, 1.0, 1), (d, kv * hd, 1.0, 1), (d, kv * hd, 1.0, 1), (h * hd, d, 1.0, 1)]
    else:
        qk, qr, lat = mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.q_lora_rank, mla.kv_lora_rank
        out = ([(d, h * qk, 1.0, 1)] if qr is None else [(d, qr, 1.0, 1), (qr, h * qk, 1.0, 1)]) + [
            (d, lat + mla.qk_rope_head_dim, 1.0, 1),
            (lat, h * (mla.qk_nope_head_dim + mla.v_head_dim), 1.0, 1),
            (h * mla.v_head_dim, d, 1.0, 1)]
    moe = _moe(shape, layer)
    if moe is None:
        return out + [(d, shape.ffn_dim, 1.0, 1)] * 2 + [(shape.ffn_dim, d, 1.0, 1)]
    f, k, e = moe.expert_ffn_dim, float(moe.top_k), moe.experts
    wide = moe.shared_experts * f
    return out + [(d, f, k, e)] * 2 + [(f, d, k, e)] + (
        [(d, wide, 1.0, 1)] * 2 + [(wide, d, 1.0, 1)] if wide else [])


def attention_replicated(shape) -> int:
    """The attention's parameters that tensor parallel leaves whole on every tp rank: the
    per-head q/k norms, or Multi-head Latent Attention's latent projections with their norms
    (each tp rank computes the latents whole: ``parallelize._mla_plan``)."""
    mla = getattr(shape, "mla", None)
    if mla is None:
        return 2 * head_dim(shape) if getattr(shape, "qk_norm", False) else 0
    qr = mla.q_lora_rank
    q = 0 if qr is None else shape.dim * qr + qr
    return q + shape.dim * (mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.kv_lora_rank


def layer_params(shape, layer: int | None = None, active: bool = False) -> int:
    """Parameters of one transformer block: attention (``attention_params``), MLP
    (``mlp_params``), two norms."""
    return attention_params(shape) + mlp_params(shape, layer, active) + 2 * shape.dim


def attention_width(shape) -> float:
    """What one query token's attention costs per key, over the heads, in multiply-adds / 2:
    n_heads × (query/key head size + value head size) / 2 (GQA's n_heads × head_dim)."""
    mla = getattr(shape, "mla", None)
    if mla is None:
        return shape.n_heads * head_dim(shape)
    return shape.n_heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim) / 2


def num_params(shape, include_embedding: bool = True, active: bool = False) -> int:
    """Exact parameter count of ``trainmesh.models.llama.model.Llama`` (``active``: counting
    only the experts one token uses)."""
    d, n = shape.dim, shape.n_layers
    moe = getattr(shape, "moe", None)
    dense = n if moe is None else min(n, moe.dense_layers)  # the first blocks; the rest alike
    blocks = (dense * layer_params(shape, 0, active) if dense else 0) + (
        (n - dense) * layer_params(shape, n - 1, active) if n > dense else 0)
    emb = shape.vocab_size * d
    head = 0 if shape.tie_embeddings else emb
    total = blocks + d + head + emb + mtp_params(shape, active)
    return total if include_embedding else total - emb


def mtp_params(shape, active: bool = False) -> int:
    """The multi-token prediction modules' (``model.mtp``): each a projection of the two
    normalised inputs, three norms and one block of the model's last kind (embedding and head
    shared with the model)."""
    mtp = getattr(shape, "mtp", None)
    if mtp is None:
        return 0
    d = shape.dim
    return mtp.depth * (2 * d * d + 3 * d + layer_params(shape, shape.n_layers, active))


def stage_flops(shape, seq_len: int, num_stages: int, pinned=None) -> tuple[float, ...]:
    """Training FLOPs per token of each of ``num_stages`` pipeline stages (``stage_split``'s,
    ``pinned`` or the default, in model order; ``flops_per_token``'s terms): its blocks
    (dense or MoE, their attention), and on the last the head and the multi-token modules.
    They sum to ``flops_per_token``."""
    attention = 6.0 * attention_width(shape) * seq_len
    out, start = [], 0
    for n in _split(shape.n_layers, num_stages, tuple(pinned) if pinned else None):
        out.append(sum(6.0 * (layer_params(shape, i, active=True) - 2 * shape.dim) + attention
                       for i in range(start, start + n)))
        start += n
    out[-1] += flops_per_token(shape, seq_len) - sum(out)  # the head, the final norm, MTP
    return tuple(out)


def cost_split(shape, seq_len: int, num_stages: int) -> tuple[int, ...]:
    """A split of the blocks over ``num_stages`` stages by their cost (``stage_flops``):
    ``stage_split``'s even one, then stage boundaries moved a block at a time while that
    makes the costliest stage cheaper (the head and multi-token modules make the last stage
    the costliest at an even split; a model's dense first blocks cost other than its MoE
    ones). Every stage keeps a block."""
    attention = 6.0 * attention_width(shape) * seq_len
    block = [6.0 * (layer_params(shape, i, active=True) - 2 * shape.dim) + attention
             for i in range(shape.n_layers)]
    extra = flops_per_token(shape, seq_len) - sum(block)  # (the head, the final norm, MTP)
    counts = list(_split(shape.n_layers, num_stages, None))

    def cost(s: int) -> float:
        start = sum(counts[:s])
        return sum(block[start:start + counts[s]]) + (extra if s == num_stages - 1 else 0.0)

    for _ in range(shape.n_layers * num_stages):  # (each move lowers a stage below the top)
        costs = [cost(s) for s in range(num_stages)]
        top = max(costs)
        s = costs.index(top)
        moves = []
        for t in (s - 1, s + 1):
            if 0 <= t < num_stages and counts[s] > 1:
                counts[s] -= 1
                counts[t] += 1
                moves.append((max(cost(s), cost(t)), t))
                counts[s] += 1
                counts[t] -= 1
        better = [m for m in moves if m[0] < top * (1 - 1e-9)]
        if not better:
            break
        t = min(better)[1]
        counts[s] -= 1
        counts[t] += 1
    return tuple(counts)


def flops_per_token(shape, seq_len: int) -> float:
    """Training FLOPs per token: 6 × (matmul parameters a token uses — the active experts
    only — the output head included, and multi-token prediction's modules with their use of
    the head) for forward and backward, plus 6 × n_layers × (n_heads ×
    head_dim; MLA: ``attention_width``) × seq_len for attention scores and values under the
    causal mask (half of the
    unmasked 12 × …: what causal kernels, and context parallel's skipped blocks, compute; at
    131K tokens the unmasked count would double the step's FLOPs and report MFU above 80%)."""
    matmul_params = num_params(shape, include_embedding=False, active=True)
    if shape.tie_embeddings:
        matmul_params += shape.vocab_size * shape.dim  # the tied head is still a matmul
    mtp = getattr(shape, "mtp", None)
    depth = mtp.depth if mtp is not None else 0  # each module's block and its use of the head
    matmul_params += depth * shape.vocab_size * shape.dim
    return 6.0 * matmul_params + 6.0 * (shape.n_layers + depth) * attention_width(shape) * seq_len


def stage_split(n_layers: int, num_stages: int, pinned=None) -> list[int]:
    """The blocks of each of ``num_stages`` pipeline stages (pp × vpp model chunks, in model
    order): ``pinned`` (``parallelism.stage_layers``) when it has one count per stage, else an
    even split, and where the stages do not divide the blocks the extra ones go to the stages
    between the first (the embedding) and the last (the norm, the head and the loss), then to
    the first, then to the last."""
    return list(_split(n_layers, num_stages, tuple(pinned) if pinned else None))


@functools.lru_cache(maxsize=4096)  # (the planner asks for ~10^5 candidates)
def _split(n_layers: int, num_stages: int, pinned: tuple[int, ...] | None) -> tuple[int, ...]:
    if pinned and len(pinned) == num_stages:
        return pinned
    per, extra = divmod(n_layers, num_stages)
    counts = [per] * num_stages
    order = [*range(1, num_stages - 1), 0, num_stages - 1] if num_stages > 1 else [0]
    for s in order[:extra]:
        counts[s] += 1
    return tuple(counts)


def stage_blocks(n_layers: int, num_stages: int, stage: int, pinned=None) -> range:
    """The global block indices of ``stage`` (``stage_split``'s counts, contiguous)."""
    counts = stage_split(n_layers, num_stages, pinned)
    start = sum(counts[:stage])
    return range(start, start + counts[stage])


def rank_blocks(n_layers: int, pp: int, vpp: int = 1, pinned=None) -> int:
    """The most blocks a pipeline rank holds (``blocks_held``)."""
    return max(blocks_held(n_layers, pp, vpp, pinned))


def blocks_held(n_layers: int, pp: int, vpp: int = 1, pinned=None) -> tuple[int, ...]:
    """The blocks each pipeline rank holds: its vpp chunks, stage s on rank s mod pp."""
    return _held(n_layers, pp, vpp, tuple(pinned) if pinned else None)


@functools.lru_cache(maxsize=4096)
def _held(n_layers: int, pp: int, vpp: int, pinned: tuple[int, ...] | None) -> tuple[int, ...]:
    counts = _split(n_layers, pp * vpp, pinned)
    return tuple(sum(counts[c * pp + r] for c in range(vpp)) for r in range(pp))


@functools.lru_cache(maxsize=4096)
def chunk_kinds(n_layers: int, pp: int, vpp: int, pp_rank: int, dense_layers: int = 0,
                pinned: tuple[int, ...] | None = None) -> tuple[tuple[int, int], ...]:
    """(dense, MoE) blocks of each model chunk pipeline rank ``pp_rank`` holds (stage s on
    rank s mod pp; ``stage_split``'s, ``pinned`` or the default): a model's first
    ``dense_layers`` blocks are dense."""
    counts = _split(n_layers, pp * vpp, pinned)
    out = []
    for s in (c * pp + pp_rank for c in range(vpp)):
        start = sum(counts[:s])
        dense = max(0, min(start + counts[s], dense_layers) - start)
        out.append((dense, counts[s] - dense))
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def fullest_ranks(n_layers: int, pp: int, vpp: int = 1, dense_layers: int = 0,
                  pinned: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The first pipeline rank holding the most blocks and the first holding the most of the
    blocks after ``dense_layers`` (MoE ones), with ``stage_split``'s split: a pipeline's
    earlier ranks hold more microbatches' activations, so of ranks alike the first is the
    heaviest."""
    held = list(blocks_held(n_layers, pp, vpp, pinned))
    later = [sum(moe for _, moe in chunk_kinds(n_layers, pp, vpp, r, dense_layers, pinned))
             for r in range(pp)]
    return (held.index(max(held)), later.index(max(later)))
