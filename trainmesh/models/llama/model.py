"""Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention). Knows nothing of meshes.

Blocks live in ``layers``, an ``nn.ModuleDict`` keyed by the *global* layer index, so a
parameter is called ``layers.7.attention.wq.weight`` whichever pipeline stage holds it, and
a stage that holds no embedding or head simply has ``tok_embeddings``/``output`` set to None.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainmesh.kernels import KernelSet, kernel_set, resolve
from trainmesh.kernels.launch import waited
from trainmesh.models.hooks import ModelHooks
from trainmesh.models.llama import model_math
from trainmesh.models.llama.init import fill_normal_
from trainmesh.models.llama.mla import MLAArgs, MLAttention
from trainmesh.models.llama.rope import rope_frequencies, rope_tables  # noqa: F401 (re-exported)
from trainmesh.models.moe.moe import MoE, MoEArgs, moe_hooks


@dataclass(frozen=True)
class MTPArgs:
    depth: int
    loss_weight: float

    @classmethod
    def from_config(cls, cfg) -> MTPArgs | None:
        """From an ``MTPConfig`` (or a dict with its fields); None stays None."""
        if cfg is None or isinstance(cfg, MTPArgs):
            return cfg
        get = cfg.get if isinstance(cfg, dict) else lambda k: getattr(cfg, k)
        return cls(depth=get("depth"), loss_weight=get("loss_weight"))


@dataclass(frozen=True)
class LlamaArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    max_seq_len: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # Llama 3.1's "llama3" scaling (spec.job.RopeScaling)
    tie_embeddings: bool = False
    kernels: str = "torch"  # a resolved kernel set: torch | triton
    moe: MoEArgs | None = None  # Mixture-of-Experts blocks (after moe.dense_layers); None: dense
    head_dim: int | None = None  # per-head size; None: dim // n_heads
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3)
    dropout: float = 0.0  # attention-probability and residual dropout while training
    mla: MLAArgs | None = None  # Multi-head Latent Attention (DeepSeek-V2/V3); None: GQA
    mtp: MTPArgs | None = None  # multi-token prediction modules (DeepSeek-V3); None: none

    def __post_init__(self) -> None:
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)

    @property
    def rope_dim(self) -> int:
        """The rotated dimensions of a head: all of it, or MLA's decoupled part."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    @property
    def ops(self) -> KernelSet:
        return kernel_set(self.kernels)

    @classmethod
    def from_config(cls, cfg, device_type: str = "cpu") -> LlamaArgs:
        """From a ``trainmesh.spec.job.ModelConfig`` (or anything with the same fields), with
        ``model.kernels`` resolved for ``device_type``."""
        fields = {f: getattr(cfg, f, None) for f in cls.__dataclass_fields__ if f != "kernels"}
        if hasattr(fields["rope_scaling"], "model_dump"):
            fields["rope_scaling"] = fields["rope_scaling"].model_dump()
        fields["moe"] = MoEArgs.from_config(fields["moe"])
        fields["mla"] = MLAArgs.from_config(fields["mla"])
        fields["mtp"] = MTPArgs.from_config(fields["mtp"])
        return cls(**fields, kernels=resolve(getattr(cfg, "kernels", "auto"), device_type,
                                             bool(getattr(cfg, "compile", False))))

    def num_params(self, include_embedding: bool = True, active: bool = False) -> int:
        return model_math.num_params(self, include_embedding, active)

    def flops_per_token(self, seq_len: int) -> float:
        return model_math.flops_per_token(self, seq_len)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: KernelSet):
        super().__init__()
        self.eps, self.ops = eps, ops
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.ops, self.dropout = args.ops, args.dropout
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps, args.ops) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps, args.ops) if args.qk_norm else None
        # Context parallel / document masks (``parallel/context.py``): attention over the ring
        # of ranks holding the rest of the sequence; None: one causal sequence, here.
        self.context = None

    def forward(self, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: torch.Tensor | None = None) -> torch.Tensor:
        """``docs``: each token's document (attention stays inside one), or None."""
        B, T, _ = x_BTD.shape
        # -1 for the head count: under tensor parallel each rank holds a slice of the heads.
        q = self.wq(x_BTD).view(B, T, -1, self.head_dim)
        k = self.wk(x_BTD).view(B, T, -1, self.head_dim)
        v = self.wv(x_BTD).view(B, T, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # Slice the tables here, where T is the whole sequence even under sequence parallel.
        q, k = self.ops.rope(q, cos[:T], sin[:T]), self.ops.rope(k, cos[:T], sin[:T])
        if self.context is not None:
            return self.wo(self.context.attend(q, k, v, docs).reshape(B, T, -1))
        rep = q.shape[2] // k.shape[2]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        # (B, nh, T, hd)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True,
                                             dropout_p=self.dropout if self.training else 0.0)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, ffn_dim: int, ops: KernelSet):
        super().__init__()
        self.ops = ops
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.ops.swiglu(self.w1(x), self.w3(x)))


class TransformerBlock(nn.Module):
    def __init__(self, args: LlamaArgs, layer: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps, args.ops)
        self.attention = Attention(args) if args.mla is None else MLAttention(args, RMSNorm)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, args.ops)
        moe = args.moe
        if moe is not None and moe.is_moe_layer(layer):
            shared = (FeedForward(args.dim, moe.shared_experts * moe.expert_ffn_dim, args.ops)
                      if moe.shared_experts else None)
            self.feed_forward: nn.Module = MoE(args.dim, moe, args.ops, shared)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_dim, args.ops)
        self.recompute = False  # activation checkpointing: recompute this block in backward
        self.dropout = args.dropout
        # Residual dropout on activations that every tensor-parallel peer holds whole (no
        # sequence parallel) draws from this generator, the same on every peer, so the
        # replicas stay equal (``engine/rng.py``); None: torch's, distinct per rank.
        self.replica_rng: torch.Generator | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: torch.Tensor | None = None) -> torch.Tensor:
        # drawn before a recompute, which then replays the same masks (checked here, not in the
        # eager function: without dropout a compiled block keeps one graph)
        seeds = (self._replica_seeds() if self.replica_rng is not None and self.training
                 and self.dropout else None)
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._forward, x, cos, sin, docs, seeds, use_reentrant=False)
        return self._forward(x, cos, sin, docs, seeds)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 docs: torch.Tensor | None = None, seeds: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self._drop(self.attention(self.attention_norm(x), cos, sin, docs=docs), seeds, 0)
        return h + self._drop(self.feed_forward(self.ffn_norm(h)), seeds, 1)

    @torch.compiler.disable  # an explicit generator: eager between compiled graphs
    def _replica_seeds(self) -> torch.Tensor:
        return torch.randint(0, 1 << 62, (2,), generator=self.replica_rng, device=self.replica_rng.device)

    def _drop(self, y: torch.Tensor, seeds: torch.Tensor | None, i: int) -> torch.Tensor:
        if not self.training or not self.dropout:
            return y
        if seeds is None:
            return F.dropout(y, self.dropout, training=True)
        return _seeded_dropout(y, self.dropout, seeds[i])


class MTPModule(nn.Module):
    """DeepSeek-V3's multi-token prediction module: the previous hidden state (normalised,
    ``hnorm``) and the embedding of the token ahead (``enorm``) side by side, projected back to
    the model's width (``eh_proj``), through one block of the model's kind (numbered after the
    model's), then normalised (``norm``: DeepSeek's ``shared_head.norm``) for the shared head."""

    def __init__(self, args: LlamaArgs, layer: int):
        super().__init__()
        self.enorm = RMSNorm(args.dim, args.norm_eps, args.ops)
        self.hnorm = RMSNorm(args.dim, args.norm_eps, args.ops)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.block = TransformerBlock(args, layer)
        self.norm = RMSNorm(args.dim, args.norm_eps, args.ops)

    def forward(self, embedded: torch.Tensor, previous: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        h = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(previous)], dim=-1))
        return self.norm(self.block(h, cos, sin))


class Llama(nn.Module):
    """Tokens (B, T) → logits (B, T, vocab). Stage-aware: any of embedding/head may be None."""

    def __init__(self, args: LlamaArgs, layer_ids: range | None = None,
                 has_embedding: bool = True, has_head: bool = True):
        super().__init__()
        self.args = args
        ids = range(args.n_layers) if layer_ids is None else layer_ids
        # Multi-token prediction's modules go with the head; they embed the tokens ahead, so a
        # part with the head and not the embedding (the last pipeline stage) holds a copy of it
        # under the same name, its gradient summed with the first stage's (``Engine``).
        mtp = args.mtp is not None and has_head
        self.tok_embeddings = (nn.Embedding(args.vocab_size, args.dim)
                               if has_embedding or mtp else None)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in ids})
        self.norm = RMSNorm(args.dim, args.norm_eps, args.ops) if has_head else None
        self.output = None
        if has_head and not args.tie_embeddings:
            self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.ops = args.ops
        self.mtp = None
        if mtp:
            self.mtp = nn.ModuleDict({str(k): MTPModule(args, args.n_layers + k)
                                      for k in range(args.mtp.depth)})
        # (detached, × each microbatch's weight: the step's multi-token losses, per depth)
        self.register_buffer("mtp_losses", torch.zeros(args.mtp.depth if args.mtp else 0,
                                                        dtype=torch.float64), persistent=False)
        self._mtp_weight = 1.0
        # What the modules look the tokens ahead up in, where not ``tok_embeddings``: a copy of
        # it held by the last pipeline stage alone, where one rank holds the first stage too
        # (a V schedule; ``parallel/pipeline/shared.py: LocalCopy``). Not a submodule.
        object.__setattr__(self, "mtp_lookup", None)
        self.mtp_tp = None  # under tensor parallel (``parallelize.MTPTensorParallel``)
        self.mtp_cp = None  # under context parallel (``parallelize.MTPContextParallel``)
        # Context parallel (``parallelize.apply_context_parallel``): the rank's part of each
        # sequence, whose global positions index the RoPE tables, and the ring it attends over.
        self.rope_positions: torch.Tensor | None = None
        self.context = None
        cos, sin = rope_tables(args.rope_dim, args.max_seq_len, args.rope_theta, args.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init from ``seed`` and each parameter's global name alone, so any split
        of the model (pipeline stages, TP/FSDP shards as DTensors) gets exactly the values the
        whole model gets. A sharded parameter fills only its local shard (see ``init.py``)."""
        depth_std = 0.02 / math.sqrt(2 * self.args.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            std = depth_std if name.endswith(("wo.weight", "w2.weight", "experts.w2")) else 0.02
            fill_normal_(p, seed * 1_000_003 + _stable_hash(name), std)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """(Re)compute the RoPE tables on the buffers' device: after a meta-device build and
        ``to_empty`` they hold garbage."""
        a = self.args
        cos, sin = rope_tables(a.rope_dim, a.max_seq_len, a.rope_theta, a.rope_scaling)
        if self.rope_positions is not None:  # rows in the rank's token order
            cos, sin = cos[self.rope_positions], sin[self.rope_positions]
        device = self.rope_cos.device
        self.rope_cos = cos.to(device)
        self.rope_sin = sin.to(device)
        for m in self.modules():
            if isinstance(m, MoE):
                m.reset_buffers()
        self.mtp_losses.zero_()

    def forward(self, h: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits, or with ``targets`` the mean next-token loss (what training calls: the fused
        head then never materialises the logits)."""
        return decoder_forward(self, self.layers.values(), h, targets)

    def step_hooks(self, sum_over_ranks: Callable[[torch.Tensor], None] = lambda t: None,
                   replicas: int = 1) -> ModelHooks:
        """What training this model (or this rank's part of it) adds to the step
        (``models/hooks.py``): its MoE blocks' balancing. ``sum_over_ranks`` sums a tensor over
        the ranks that share the step's tokens, ``replicas`` of them hold a whole batch share."""
        hooks = moe_hooks(self, sum_over_ranks, replicas)
        if self.args.mtp is None:  # (a pipeline stage without the modules reports their
            return hooks  # losses too: the engine sums them over the stages first)
        moe_before = hooks.before_microbatch

        def before_microbatch(weight: float) -> None:
            self._mtp_weight = weight
            if moe_before is not None:
                moe_before(weight)

        return ModelHooks(before_microbatch, hooks.after_update, self._take_mtp_losses)

    def _take_mtp_losses(self) -> dict[str, float]:
        """The step's multi-token losses (this rank's microbatches, weighted as the loss is),
        their mean as ``mtp_loss`` and each depth's beyond one; then zeroed."""
        losses = self.mtp_losses.tolist()
        self.mtp_losses.zero_()
        out = {"mtp_loss": sum(losses) / len(losses)}
        if len(losses) > 1:
            out.update({f"mtp_loss/depth{k + 1}": v for k, v in enumerate(losses)})
        return out

    def predict_ahead(self, tokens: torch.Tensor) -> list[torch.Tensor]:
        """The multi-token modules' logits for ``tokens`` (B, T): the k-th module's (B, T − k,
        vocab), at position i the prediction of token i + k + 1 (as in training, from the
        tokens of the sequence, not drafted ones)."""
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        head = self.output if self.output is not None else self.tok_embeddings
        return [F.linear(h_k, head.weight) for h_k in _mtp_hidden(self, self.norm(h), tokens[:, 1:])]


def mtp_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of ``model``'s multi-token prediction modules (none without them, or on a
    pipeline rank without the last stage)."""
    mtp = getattr(model, "mtp", None)
    return [m.block for m in mtp.values()] if mtp is not None else []


@torch.compiler.disable
def _seeded_dropout(y: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    """Dropout whose mask comes from ``seed`` alone (the same on every rank that passes it)."""
    g = torch.Generator(y.device).manual_seed(int(seed))
    return y * torch.empty_like(y).bernoulli_(1 - p, generator=g) / (1 - p)


def decoder_forward(parts: nn.Module, layers, h: torch.Tensor,
                    targets: torch.Tensor | None = None) -> torch.Tensor:
    """Embedding (if ``parts`` has one), ``layers`` in order, then norm and head (if any) and,
    given ``targets``, the loss. ``parts`` is a Llama or a pipeline stage holding a subset of
    its modules (and ``ops``, its kernel set). With document masks, the documents come from the
    tokens, so only where the embedding is (no pipeline: the spec refuses documents beside it)."""
    docs = None
    if parts.tok_embeddings is not None:
        context = getattr(parts, "context", None)
        docs = context.document_ids(h) if context is not None else None
        h = waited(parts.tok_embeddings(h))  # (a compiled block needs a plain input)
    for layer in layers:
        h = layer(h, parts.rope_cos, parts.rope_sin, docs)
    if parts.norm is None:
        return h
    h = parts.norm(h)
    head = parts.output if parts.output is not None else parts.tok_embeddings
    loss = _head_loss(parts, head, h, targets)
    if targets is None or getattr(parts, "mtp", None) is None or not torch.is_grad_enabled():
        return loss  # (evaluation: the next-token loss alone)
    # (a pipeline stage's modules are its Llama's, which holds the losses and the embedding)
    owner = getattr(parts, "_owner", parts)
    term = _mtp_term(owner, head, h, targets)
    tp = getattr(owner, "mtp_tp", None)
    return loss + (tp.joined(term, loss) if tp else term)


def _head_loss(parts: nn.Module, head: nn.Module, h: torch.Tensor,
               targets: torch.Tensor | None) -> torch.Tensor:
    """The head's logits, or with ``targets`` the mean next-token loss."""
    if targets is not None and parts.ops.linear_cross_entropy is not None:
        return parts.ops.linear_cross_entropy(h, head.weight, targets)
    logits = parts.output(h) if parts.output is not None else F.linear(h, head.weight)
    return logits if targets is None else cross_entropy_loss(logits, targets)


def _lookup(model: nn.Module) -> nn.Module:
    """The embedding the multi-token modules look the tokens ahead up in."""
    copy = getattr(model, "mtp_lookup", None)
    return copy if copy is not None else model.tok_embeddings


def _mtp_hidden(model: nn.Module, h: torch.Tensor, ahead: torch.Tensor):
    """Each multi-token module's hidden states, in order: the k-th over positions 0 … T − k − 1
    (those with a token k + 1 ahead), from the previous one's (``h``: the model's normalised
    output) and the embedding of the tokens k ahead (``ahead``: the tokens 1 ahead, whose
    first T − k the k-th takes from position k − 1 on). Causal: cutting the positions after
    changes none before. Under tensor parallel (``mtp_tp``) both are gathered whole first."""
    tp = getattr(model, "mtp_tp", None)
    embedded = _lookup(model)(ahead)  # (one lookup for every module)
    if tp is not None:
        h, embedded = tp.model_output(h), tp.embedded(embedded)
    T = h.shape[1]
    for k, module in enumerate(model.mtp.values(), start=1):
        n = T - k
        h = module(embedded[:, k - 1:k - 1 + n], h[:, :n], model.rope_cos, model.rope_sin)
        yield h


def _mtp_hidden_in_context(model: nn.Module, cp, h: torch.Tensor, whole: torch.Tensor):
    """``_mtp_hidden`` under context parallel (``parallelize.MTPContextParallel``): each
    module over the rank's whole part of the sequence, from the embedding of the tokens k
    ahead of its positions (``whole``: the gathered targets); beside tensor parallel both
    whole on every tp rank first, as ``_mtp_hidden`` gathers them."""
    tp = getattr(model, "mtp_tp", None)
    depth = len(model.mtp)
    embedded = _lookup(model)(torch.cat([cp.ahead(whole, k) for k in range(1, depth + 1)], 1))
    if tp is not None:
        h, embedded = tp.model_output(h), tp.embedded(embedded)
    T = h.shape[1]
    for k, module in enumerate(model.mtp.values(), start=1):
        h = module(embedded[:, (k - 1) * T:k * T], h, model.rope_cos, model.rope_sin)
        yield h


def _mtp_term(model: nn.Module, head: nn.Module, h: torch.Tensor,
              targets: torch.Tensor) -> torch.Tensor:
    """What the multi-token modules add to the loss: their mean loss × ``loss_weight``, whose
    value is left out of what is returned (its gradient kept: ``t − t.detach()``), so the loss
    the step reports stays the next-token one; each depth's loss, × the microbatch's weight,
    is added to ``model.mtp_losses`` for the step's metrics."""
    tp = getattr(model, "mtp_tp", None)
    cp = getattr(model, "mtp_cp", None)
    if cp is not None:
        losses = []
        whole = cp.whole(targets)
        for k, h_k in enumerate(_mtp_hidden_in_context(model, cp, h, whole), start=1):
            rows, wanted, share = cp.scored(whole, k)
            scored = h_k.index_select(1, rows)
            losses.append(_head_loss(model, head, tp.head_input(scored) if tp else scored,
                                     wanted) * share)
    else:
        losses = [_head_loss(model, head, tp.head_input(h_k) if tp else h_k, targets[:, k:])
                  for k, h_k in enumerate(_mtp_hidden(model, h, targets), start=1)]
    stacked = torch.stack([tp.loss(x) for x in losses] if tp else losses)
    with torch.no_grad():
        model.mtp_losses += stacked.detach().double() * model._mtp_weight
    term = model.args.mtp.loss_weight * stacked.mean()
    return term - term.detach()


def cross_entropy_loss(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over every position, computed in float32."""
    return F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT.flatten(0, 1))


def _stable_hash(name: str) -> int:
    h = 0
    for ch in name.encode():
        h = (h * 131 + ch) % 1_000_000_007
    return h
