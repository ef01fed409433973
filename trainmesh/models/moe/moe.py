"""A Mixture-of-Experts MLP: token-choice top-k router, experts as one grouped module, an
optional shared expert, and load balancing by an auxiliary loss or DeepSeek-V3's bias.

Knows nothing of meshes. Moving tokens to the experts is a seam, ``MoE.dispatch``: the
default keeps every expert here; expert parallel (``trainmesh/parallel/expert.py``) puts an
all-to-all dispatcher in its place, and the experts module then holds only this rank's
experts. Routing is computed in float32 and ties are broken by the lower expert index, so a
token's experts are the same on any mesh.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainmesh.kernels import KernelSet
from trainmesh.models.hooks import ModelHooks


@dataclass(frozen=True)
class MoEArgs:
    experts: int
    top_k: int
    expert_ffn_dim: int
    shared_experts: int = 0
    router: str = "softmax"  # softmax | sigmoid
    normalize_top_k: bool = True
    balance: str = "aux_loss"  # aux_loss | bias
    aux_loss_coef: float = 0.01
    bias_update_rate: float = 1e-3
    dense_layers: int = 0
    capacity_factor: float | None = None
    n_group: int = 1  # group-limited routing: a token's experts from its topk_group best groups
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    @classmethod
    def from_config(cls, cfg: Any) -> MoEArgs | None:
        """From a ``MoEConfig`` (or a dict with its fields); None stays None (a dense model)."""
        if cfg is None or isinstance(cfg, MoEArgs):
            return cfg
        get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
        return cls(**{f.name: get(f.name) for f in fields(cls) if get(f.name) is not None})

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.dense_layers

    def capacity(self, tokens: int) -> int | None:
        """The most token assignments one expert takes from ``tokens`` tokens (None: all)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.experts)


class Dispatch(Protocol):
    """Moves assignments (token copies sorted by expert) to the experts' ranks and back."""

    halves: int  # the parts a microbatch's assignments come in (2: overlapped; ``exchange``)
    combines: bool  # takes the tokens and weights their outputs itself (``combine``)

    def exchange(self, x_sorted: torch.Tensor, counts_HE: torch.Tensor,
                 experts: Callable[[torch.Tensor, list[int] | torch.Tensor], torch.Tensor],
                 beside: Callable[[], torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The experts' outputs for ``x_sorted``, in its order: ``halves`` parts end to end,
        each sorted by expert, ``counts_HE[h, e]`` rows of part h for expert e (all experts,
        on the device). ``experts(rows, counts)`` computes rows grouped by this rank's
        experts. With two parts, one part's exchange runs while the other's experts compute,
        and ``beside`` (the shared expert) while the last part comes back. Returns the outputs
        and ``beside()`` (None without it)."""

    def combine(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
                keep: torch.Tensor | None,
                experts: Callable[[torch.Tensor, list[int] | torch.Tensor], torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Where ``combines``: the tokens ``x`` (n, D) to the experts ``chosen`` (n, k), those
        ``keep`` (n, k; None: all) kept, and back as rows of Σ_j weights[:, j] · expert output
        and the token each is of (a token's output: the sum of its rows)."""

    def sum_over_tokens(self, counts: torch.Tensor) -> torch.Tensor:
        """``counts`` summed over the ranks that split one microbatch's tokens (in place)."""

    def keep_within_capacity(self, flat: torch.Tensor, weights: torch.Tensor, args: MoEArgs
                             ) -> torch.Tensor:
        """Which of this rank's assignments (``flat``: expert ids in (batch, token, choice)
        order; ``weights``: theirs) the experts keep, decided over the whole microbatch, of
        which ``args.capacity(tokens)`` is each expert's share (``keep_within_capacity``)."""


class LocalDispatch:
    """Every expert on this rank: nothing moves (and nothing waits for the host)."""

    halves = 1
    combines = False

    def exchange(self, x_sorted, counts_HE, experts, beside=None):
        return experts(x_sorted, counts_HE[0]), beside() if beside is not None else None

    def sum_over_tokens(self, counts):
        return counts

    def keep_within_capacity(self, flat, weights, args):
        return keep_whole_microbatch(flat, weights, args)


def keep_whole_microbatch(flat: torch.Tensor, weights: torch.Tensor, args: MoEArgs) -> torch.Tensor:
    """``keep_within_capacity`` where this rank holds the whole microbatch."""
    return keep_within_capacity(flat, weights, args.capacity(flat.numel() // args.top_k),
                                args.experts)


def keep_within_capacity(flat: torch.Tensor, weights: torch.Tensor, capacity: int,
                         experts: int) -> torch.Tensor:
    """A mask over assignments (expert ids ``flat`` of ``experts`` and ``weights``, in the
    microbatch's (batch, token, choice) order): each expert keeps at most ``capacity``, the
    highest weights first, ties to the earlier assignment. (No host sync.)"""
    return keep_by_keys(capacity_keys(flat, weights), capacity, experts)


def capacity_keys(flat: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """One int64 per assignment that sorts by expert, then by weight, highest first: the
    expert id above the 31 bits of the weight's float32 pattern (router weights are ≥ 0, whose
    patterns order as the numbers do), inverted."""
    bits = weights.float().contiguous().view(torch.int32).long()
    return flat.long() * 2**31 + (2**31 - 1 - bits)


def keep_by_keys(keys: torch.Tensor, capacity: int, experts: int) -> torch.Tensor:
    """``keep_within_capacity`` on ``capacity_keys`` in the microbatch's order: one stable
    sort (ties by that order)."""
    order = torch.argsort(keys, stable=True)
    expert = keys // 2**31
    counts = torch.zeros(experts, dtype=torch.int64, device=keys.device).index_add_(
        0, expert, torch.ones_like(expert))
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(order.numel(), device=keys.device) - starts[expert[order]]
    return torch.zeros_like(keys, dtype=torch.bool).scatter_(0, order, rank_in_expert < capacity)


class GroupedExperts(nn.Module):
    """``experts`` SwiGLU MLPs as three stacked weights (expert-major, so expert parallel
    splits dim 0). Computes rows grouped by expert."""

    def __init__(self, dim: int, ffn_dim: int, experts: int, ops: KernelSet):
        super().__init__()
        self.ops = ops
        self.w1 = nn.Parameter(torch.empty(experts, ffn_dim, dim))  # gate
        self.w3 = nn.Parameter(torch.empty(experts, ffn_dim, dim))  # up
        self.w2 = nn.Parameter(torch.empty(experts, dim, ffn_dim))  # down
        self.grouped_mm = None  # None: torch._grouped_mm on CUDA, the per-expert loop elsewhere
        self.float8: str | None = None  # torchao's float8 grouped GEMMs (FLOAT8_GROUPED)

    def forward(self, x: torch.Tensor, counts: list[int] | torch.Tensor,
                dispatch: Dispatch | None = None, beside: Callable[[], torch.Tensor] | None = None,
                route: tuple | None = None):
        """``x``: rows grouped by (local) expert, ``counts[e]`` of them for expert e. With
        ``dispatch``: ``x`` holds this rank's assignments (``Dispatch.exchange``'s parts,
        ``counts`` its ``counts_HE``), which travel to their experts' ranks and back inside
        this call: ZeRO-3's hooks (this module is a unit of its own) gather the weights once
        before the exchange and reduce their gradients once after it, however many parts.
        Returns the outputs, and with ``dispatch`` also ``beside()``. With ``route`` (a
        dispatch that ``combines``: (chosen, weights, keep), ``Dispatch.combine``'s), ``x``
        holds the tokens and the outputs are rows of their weighted sums and the token each is
        of (``Dispatch.combine``); ``counts`` is unread."""
        if dispatch is None:
            return self.compute(x, counts)
        if route is not None:
            return dispatch.combine(x, *route, self.compute), None
        return dispatch.exchange(x, counts, self.compute, beside)

    def compute(self, x: torch.Tensor, counts: list[int] | torch.Tensor) -> torch.Tensor:
        """This rank's experts over ``x``, rows grouped by (local) expert."""
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w
                      for w in (self.w1, self.w2, self.w3))
        if self.float8 is not None:
            return float8_expert_swiglu(x, counts, w1, w2, w3, self.ops.swiglu, self.float8)
        grouped = self.grouped_mm if self.grouped_mm is not None else x.is_cuda
        return expert_swiglu(x, counts, w1, w2, w3, self.ops.swiglu, grouped)


def expert_swiglu(x: torch.Tensor, counts: list[int] | torch.Tensor, w1: torch.Tensor,
                  w2: torch.Tensor, w3: torch.Tensor, swiglu, grouped: bool) -> torch.Tensor:
    """Each expert's SwiGLU over its rows: one grouped GEMM per weight (``torch._grouped_mm``,
    its group ends computed on the device) or a loop over experts (which needs the counts on
    the host). Every expert takes part even with no rows, so each weight always gets a
    gradient (ZeRO-3's reduce-scatter is then the same on every rank)."""
    if grouped:
        counts = torch.as_tensor(counts, device=x.device)
        offs = counts.cumsum(0).to(torch.int32)
        gate = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
        up = torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(swiglu(gate, up), w2.transpose(-2, -1), offs=offs)
    return _expert_loop(x, counts, w1, w2, w3, swiglu)


# torchao's float8 grouped GEMMs for the experts (``training.float8``), by device: rowwise
# scales on Hopper (H100, H200), MXFP8 (a scale per 32 values) on Blackwell (B200, B300),
# MXFP8 emulated (float8 rounding, bf16 grouped GEMMs) on CPU; each needs every expert's rows
# to start at a multiple of its alignment (Blackwell's kernels quantize in tiles of 128 rows).
FLOAT8_GROUPED = {"rowwise": 16, "mxfp8": 128, "mxfp8-emulated": 32}


def float8_grouped_kind(device_type: str, capability: tuple[int, int] | None) -> str | None:
    """The float8 grouped GEMM the experts run on this device (None: none runs there, the
    experts stay in the compute dtype): Hopper (9.x); Blackwell's data-centre parts (10.x)
    where torchao's SM100 kernels and their CuTe DSL runtime are installed; not on ROCm."""
    if device_type != "cuda":
        return "mxfp8-emulated"
    if capability is None or torch.version.hip is not None:
        return None
    if capability[0] == 10 and _sm100_kernels():
        return "mxfp8"
    if capability[0] == 9:
        return "rowwise"
    return None


def _sm100_kernels() -> bool:
    """torchao's MXFP8 grouped GEMM kernels for Blackwell, and the CuTe DSL they run on."""
    import importlib.util

    try:
        from torchao.prototype.moe_training.mxfp8_grouped_mm import _SM100_KERNELS_AVAILABLE
    except ImportError:
        return False
    return bool(_SM100_KERNELS_AVAILABLE) and importlib.util.find_spec("cutlass") is not None


def aligned_groups(counts: list[int] | torch.Tensor, rows: int, align: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Groups of rows (``counts[e]`` for expert e, end to end) laid out so that each starts
    at a multiple of ``align``: where each row goes, each group's end there (int32, the
    grouped GEMM's ``offs``), and the layout's length (``rows`` + experts × (align − 1),
    rounded up to whole blocks: known without the counts, so no host sync)."""
    counts = torch.as_tensor(counts, device=device, dtype=torch.int64)
    padded = (counts + align - 1) // align * align
    start = torch.cumsum(padded, 0) - padded  # each expert's first row, padded
    into = (torch.repeat_interleave(start - (torch.cumsum(counts, 0) - counts), counts,
                                    output_size=rows) + torch.arange(rows, device=device))
    bound = -(-(rows + counts.numel() * (align - 1)) // align) * align
    return into, torch.cumsum(padded, 0).to(torch.int32), bound


def float8_expert_swiglu(x: torch.Tensor, counts: list[int] | torch.Tensor, w1: torch.Tensor,
                         w2: torch.Tensor, w3: torch.Tensor, swiglu, kind: str) -> torch.Tensor:
    """``expert_swiglu`` on torchao's float8 grouped GEMMs (``kind``: FLOAT8_GROUPED). The
    padding they need is made once for the three: each expert's rows are placed from a
    multiple of the alignment (zeros between), the GEMMs run on that layout, and the rows are
    read back at the end; no host sync (the padded length is bounded by rows + experts ×
    (alignment − 1), rounded to whole blocks). It computes in bf16 (the float8 GEMMs'
    output dtype) and returns ``x``'s dtype."""
    from torchao.prototype.moe_training.config import KernelPreference
    from torchao.prototype.moe_training.fp8_grouped_mm import (
        _to_fp8_rowwise_then_scaled_grouped_mm,
    )
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _to_mxfp8_then_scaled_grouped_mm

    into, offs, bound = aligned_groups(counts, x.shape[0], FLOAT8_GROUPED[kind], x.device)
    dtype = torch.bfloat16  # (the float8 GEMMs' output dtype; float32 weights cast per GEMM)
    xp = x.new_zeros((bound, x.shape[1]), dtype=dtype).index_copy(0, into, x.to(dtype))

    def gemm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        w_t = w.to(dtype).transpose(-2, -1)  # (experts, in, out): column-major per expert
        if kind == "rowwise":
            return _to_fp8_rowwise_then_scaled_grouped_mm(
                a, w_t, offs, out_dtype=dtype, pad_token_groups_for_grouped_mm=False)
        return _to_mxfp8_then_scaled_grouped_mm(
            a, w_t, offs, out_dtype=dtype, kernel_preference=(
                KernelPreference.EMULATED if kind == "mxfp8-emulated" else KernelPreference.AUTO))

    out = gemm(swiglu(gemm(xp, w1), gemm(xp, w3)), w2)
    return out.index_select(0, into).to(x.dtype)


@torch.compiler.disable
def _expert_loop(x: torch.Tensor, counts: list[int] | torch.Tensor, w1: torch.Tensor,
                 w2: torch.Tensor, w3: torch.Tensor, swiglu) -> torch.Tensor:
    """The loop over experts, eager even inside a compiled block: its splits are sized by the
    routing's counts on the host, which a graph would specialise on (one recompile per
    routing until dynamo gives up)."""
    if isinstance(counts, torch.Tensor):
        counts = counts.tolist()
    outs = []
    for e, rows in enumerate(torch.split(x, counts)):
        outs.append(swiglu(rows @ w1[e].T, rows @ w3[e].T) @ w2[e].T)
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])


class _AddAuxLoss(torch.autograd.Function):
    """Returns ``x`` unchanged; in backward, gives ``aux`` the gradient ``scale`` (the
    microbatch's share of the step's loss), as if ``aux * scale`` had been added to the loss.
    So the balancing loss trains the router wherever the block sits, pipeline stages included,
    without travelling to the loss. ``scale`` is a tensor (the block's ``scale`` buffer): a
    Python float here was baked into a compiled block's backward, or made a symbol dynamo
    could not carry, once it changed between microbatches."""

    @staticmethod
    def forward(ctx, x, aux, scale):
        # (a copy: a pipeline sets the next microbatch's share before this one's backward)
        ctx.save_for_backward(scale.clone())
        return x

    @staticmethod
    def backward(ctx, grad):
        (scale,) = ctx.saved_tensors
        return grad, scale.to(torch.float32), None


def limit_to_groups(choose: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """DeepSeek-V3's group-limited routing: the experts (columns of ``choose``, the scores
    that choose them) in ``n_group`` equal groups, each scored by the sum of its two best; a
    token keeps its ``topk_group`` best groups (ties to the lower group) and the experts of the
    others are never chosen (their scores set to -inf)."""
    n, experts = choose.shape
    grouped = choose.view(n, n_group, experts // n_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)
    best = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[:, :topk_group]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(n, experts)


class MoE(nn.Module):
    """(B, T, D) → (B, T, D): each token's top-k experts, weighted by its router scores, plus
    the shared expert."""

    def __init__(self, dim: int, args: MoEArgs, ops: KernelSet, shared: nn.Module | None = None):
        super().__init__()
        self.args = args
        self.router = nn.Linear(dim, args.experts, bias=False)
        self.experts = GroupedExperts(dim, args.expert_ffn_dim, args.experts, ops)
        self.shared = shared  # a dense SwiGLU over every token, or None
        # DeepSeek-V3's balancing bias: chooses experts, never weights them; a checkpointed
        # buffer moved after each optimizer step (update_bias), not by the optimizer.
        self.register_buffer("expert_bias", torch.zeros(args.experts), persistent=True)
        # Since the last balance_experts (all of this rank's microbatches), kept on the device
        # so that no microbatch waits for the host: assignments routed to each expert (the
        # balancing signal and the load), the balancing loss × each microbatch's share of the
        # step, and the assignments dropped over capacity.
        self.register_buffer("routed", torch.zeros(args.experts, dtype=torch.int64),
                             persistent=False)
        self.register_buffer("aux_total", torch.zeros((), dtype=torch.float64), persistent=False)
        self.register_buffer("dropped", torch.zeros((), dtype=torch.int64), persistent=False)
        # The microbatch's share of the step's loss (0: a padding microbatch), as a tensor that
        # compiled blocks read as an input (``loss_scale`` sets it)
        self.register_buffer("scale", torch.ones(()), persistent=False)
        self._loss_scale = 1.0
        self.dispatch: Dispatch = LocalDispatch()
        self.aux_share = 1.0  # context parallel: cp (each rank's loss is cp× its part)
        # The rows of each sequence it routes (None: all): a multi-token module's block under
        # context parallel runs on the rank's whole part of the sequence, of which only the
        # positions with a token k + 1 ahead are the module's (``expert.apply_expert_parallel``)
        self.rows: torch.Tensor | None = None

    @property
    def loss_scale(self) -> float:
        return self._loss_scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self._loss_scale = float(value)
        self.scale.fill_(self._loss_scale)

    def reset_buffers(self) -> None:
        """Zero the bias and counters (after a meta-device build they hold garbage)."""
        self.expert_bias.zero_()
        self.scale.fill_(self._loss_scale)
        self.reset_counters()

    def reset_counters(self) -> None:
        self.routed.zero_()
        self.aux_total.zero_()
        self.dropped.zero_()

    def route(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Scores (N, E) in float32, the chosen experts (N, k) best first, their weights."""
        a = self.args
        logits = self.router(x_ND).float()
        scores = logits.softmax(-1) if a.router == "softmax" else logits.sigmoid()
        choose = (scores + self.expert_bias if a.balance == "bias" else scores).detach()
        if a.n_group > 1:
            choose = limit_to_groups(choose, a.n_group, a.topk_group)
        # A stable sort: equal scores go to the lower expert index, on every mesh.
        idx = torch.sort(choose, dim=-1, descending=True, stable=True).indices[:, :a.top_k]
        weights = scores.gather(1, idx)
        if a.normalize_top_k:
            weights = weights / weights.sum(-1, keepdim=True)
        if a.routed_scaling_factor != 1.0:
            weights = weights * a.routed_scaling_factor
        return scores, idx, weights

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        if self.rows is None:
            return self._routed(x_BTD)
        if self.rows.device != x_BTD.device:  # (once: not a copy per microbatch)
            self.rows = self.rows.to(x_BTD.device)
        # The other rows are left out of everything (routing, counts, capacity, balancing):
        # zeros, which nothing reads (no loss, and causal attention never looks ahead).
        y = self._routed(x_BTD.index_select(1, self.rows))
        return x_BTD.new_zeros(x_BTD.shape).index_copy(1, self.rows, y)

    def _routed(self, x_BTD: torch.Tensor) -> torch.Tensor:
        a = self.args
        shape = x_BTD.shape
        x = x_BTD.reshape(-1, shape[-1])
        n, k = x.shape[0], a.top_k
        scores, idx, weights = self.route(x)
        flat = idx.reshape(-1)  # assignment j = token j // k, its (j % k)-th choice
        counts = torch.bincount(flat, minlength=a.experts)
        # In parts (the dispatch's halves): the first half of the tokens, then the rest, each
        # sorted by expert (a stable sort: by token within an expert, as one part sorts).
        halves = self.dispatch.halves  # (the same on every rank: it sets the collectives)
        part = flat if halves == 1 else flat + a.experts * (
            torch.arange(n * k, device=flat.device) >= (n + 1) // 2 * k)
        order = torch.argsort(part, stable=True)
        kept = counts
        capped = a.capacity_factor is not None
        if capped:  # what each expert keeps, decided over the whole microbatch
            keep = self.dispatch.keep_within_capacity(flat, weights.detach().reshape(-1), a)
            order = order[keep[order]]
            kept = torch.zeros_like(counts).index_add_(0, flat, keep.to(counts.dtype))
        kept_HE = (kept.view(1, -1) if halves == 1 else torch.zeros(
            halves * a.experts, dtype=counts.dtype, device=counts.device).index_add_(
                0, part, keep.to(counts.dtype) if capped else torch.ones_like(part)
            ).view(halves, -1))
        # (the shared expert, in parts, runs while the last part's outputs come back)
        beside = (lambda: self.shared(x)) if self.shared is not None and halves > 1 else None
        if self.dispatch.combines:  # the tokens themselves, weighted where their experts are
            (rows, token), y_shared = self.experts(x, kept_HE, self.dispatch, route=(
                idx, weights, keep.view(n, k) if capped else None))
            # (summed here: a compiled block's y is then its own, not a graph input that
            # _AddAuxLoss would hand back unchanged, its balancing gradient skipped)
            # (in float32: a token's rows added in any order, atomically on a GPU)
            y = rows.new_zeros(n, shape[-1], dtype=torch.float32).index_add(
                0, token, rows.float()).to(x.dtype)
        else:
            y_sorted, y_shared = self.experts(x[order // k], kept_HE, self.dispatch, beside)
            per_assignment = x.new_zeros(n * k, shape[-1]).index_copy(0, order, y_sorted)
            y = (per_assignment.view(n, k, -1) * weights.unsqueeze(-1).to(x.dtype)).sum(1)
        if self.shared is not None:
            y = y + (y_shared if y_shared is not None else self.shared(x))
        if not torch.is_grad_enabled():  # evaluation: no balancing, nothing counted
            return y.view(shape)
        # Activation checkpointing runs the forward again inside backward: count once.
        # Compiled, the recomputation replays no buffer update; and asking breaks the graph,
        # leaving y an input of the next one, handed back unchanged by _AddAuxLoss: autograd
        # then skipped the injection, and the router got no balancing gradient.
        first_run = torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1
        if a.balance == "aux_loss" and a.aux_loss_coef > 0:
            aux = self._aux_loss(scores, counts) * self.aux_share
            y = _AddAuxLoss.apply(y, aux, self.scale)
            if first_run:
                self.aux_total += aux.detach().double() * self.scale.double()
        if first_run:  # a padding microbatch (weight 0) counts nothing
            with torch.no_grad():
                counted = (self.scale != 0).to(counts.dtype)
                self.routed += counts * counted
                if capped:
                    self.dropped += (counts - kept).sum() * counted
        return y.view(shape)

    def _aux_loss(self, scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The Switch Transformer balancing loss over this microbatch, × aux_loss_coef:
        E/k × Σ_e f_e · P_e, f_e the fraction of tokens routed to expert e, P_e its mean
        (normalised) score; 1 × coef when routing is uniform. When the microbatch's tokens are
        split over ranks (tensor parallel), f is counted over all of them and each rank adds
        its tokens' share of P, so the ranks' parts sum to the whole microbatch's loss."""
        a = self.args
        total = self.dispatch.sum_over_tokens(counts.detach().clone()).double()
        tokens = total.sum() / a.top_k
        f = (total / tokens).float()
        p = scores / scores.sum(-1, keepdim=True) if a.router == "sigmoid" else scores
        return a.aux_loss_coef * a.experts / a.top_k * (f * (p.sum(0) / tokens.float())).sum()

    @torch.no_grad()
    def update_bias(self, routed: torch.Tensor) -> None:
        """After an optimizer step: move each expert's bias towards balance by
        ``bias_update_rate`` (up when it took fewer than the mean of ``routed``, the step's
        assignments over every rank, down when more)."""
        if self.args.balance == "bias":
            load = routed.to(self.expert_bias.dtype)
            self.expert_bias += self.args.bias_update_rate * torch.sign(load.mean() - load)


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """Every MoE block of ``model`` (or of a pipeline rank's part), by name."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def balance_experts(model: nn.Module, sum_over_ranks: Callable[[torch.Tensor], None] = lambda t: None,
                    replicas: int = 1) -> dict[str, dict]:
    """After the optimizer step: each MoE block's assignments per expert this step (summed by
    ``sum_over_ranks`` over every rank that routed some of the step's tokens) move its
    balancing bias. Returns each block's load (max / mean), balancing loss (the sum of a
    microbatch's token shares, averaged over ``replicas``), dropped assignments and bias norm,
    and resets the counters."""
    blocks = moe_layers(model)
    if not blocks:
        return {}
    loads = torch.stack([moe.routed for _, moe in blocks])
    extra = torch.stack([torch.stack([moe.aux_total, moe.dropped.double()]) for _, moe in blocks])
    sum_over_ranks(loads)
    sum_over_ranks(extra)
    out = {}
    for (name, moe), load, (aux, dropped) in zip(blocks, loads, extra.tolist(), strict=True):
        moe.update_bias(load)
        moe.reset_counters()
        load = load.double()
        out[name] = {"load_max_over_mean": float(load.max() / load.mean().clamp(min=1e-9)),
                     "aux_loss": aux / replicas, "dropped": int(dropped),
                     "bias_norm": float(moe.expert_bias.norm())}
    return out


def set_loss_scale(model: nn.Module, scale: float) -> None:
    """The balancing loss's share of the step, as the main loss's: the microbatch's weight
    (1 / microbatches for one process; 0 for a padding microbatch)."""
    for _, m in moe_layers(model):
        m.loss_scale = scale


def moe_hooks(model: nn.Module, sum_over_ranks: Callable[[torch.Tensor], None] = lambda t: None,
              replicas: int = 1) -> ModelHooks:
    """An MoE model's step hooks: each microbatch's weight scales the balancing loss, and after
    the optimizer the routers' biases move (``balance_experts``, its loads summed by
    ``sum_over_ranks`` over the ranks that routed the step's tokens). None for a dense model."""
    if not moe_layers(model):
        return ModelHooks()
    return ModelHooks(lambda weight: set_loss_scale(model, weight),
                      lambda: balance_experts(model, sum_over_ranks, replicas=replicas))
