"""Expert parallel: each group of ``ep`` data-parallel replicas splits a MoE block's experts
among its ranks, and tokens travel to their experts' ranks and back by all-to-all.

Folded over dp: the mesh's "ep" dimension is a view of the data-parallel replicas, so adding
EP needs no extra ranks. Expert weights become DTensors sharded on dim 0 (the expert) over
"ep", and ZeRO-3 shards them further over "edp", the replicas of each expert; every other
parameter is ZeRO-3-sharded over the whole "dp" as before. Checkpoints keep the full
(all-experts) shapes under the same names, so DCP reshards experts, their AdamW state and
the balancing bias onto any other ep.

Under tensor parallel the MoE block takes its tensor-parallel rank's share of the sequence
(an MoE block is not split over tp: ``tp`` is folded into its token domain, as in Megatron
Core's "MoE parallel folding" with expert TP 1). Its parameters then see a part of the
tokens on each tp rank, and their gradients are summed over tp once per step
(``models/llama/parallelize.py: sum_partial_grads_over_tp``). Under context parallel a rank
holds its chunks of each sequence; the tp × cp ranks together hold a microbatch's tokens (the
token group). With ``capacity_factor`` what each expert keeps is decided over the whole
microbatch, as one process decides it: the token group all-gathers its assignments first.

Communication follows NCCL's rules: every rank of an EP group makes the same collectives in
the same order (per MoE block and microbatch: under capacity the token group's all-gather of
the assignments, then one all-to-all of the per-expert counts, then one of the tokens per part
and one back per part — one part, or two halves with ``parallelism.ep_overlap``; the counts'
arrival is the block's host sync, since the token all-to-alls need their split sizes on the
host — under capacity, selecting the kept assignments is another); a rank that routes
nothing to a peer sends it zero rows, never skips the call. Relayed
(``parallelism.ep_dispatch``, ``NodeRelayDispatch``): the first hop's counts, then its tokens,
their weights and their experts' ids, then the second hop as above inside each node, then
the sums back; every rank of the group makes each of them, with zero rows where it has none.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from trainmesh.models.moe.moe import (
    MoE,
    MoEArgs,
    capacity_keys,
    keep_by_keys,
    keep_whole_microbatch,
    moe_layers,
)
from trainmesh.parallel.clock import DeviceClock, WaitLog
from trainmesh.parallel.context import local_positions
from trainmesh.parallel.dims import Axis
from trainmesh.parallel.mesh import Mesh
from trainmesh.parallel.pipeline.overlap import hand_over
from trainmesh.spec.mesh_rules import relays


@dataclass(kw_only=True)
class ExchangeLog(WaitLog):
    """A rank's MoE exchanges this step: where it waited on them (``WaitLog``) and the bytes
    it sent to other ranks, to ranks of its own node and of others (forward and backward,
    recomputation included)."""

    within_nodes: int = 0
    between_nodes: int = 0

    def start(self, clock: DeviceClock | None) -> None:
        super().start(clock)
        self.within_nodes = self.between_nodes = 0

    def count(self, dispatch: AllToAllDispatch, rows: list[int], row_bytes: int) -> None:
        """``rows[c]`` rows of ``row_bytes`` sent to the rank of ep coordinate c (every
        all-to-all: a sum over the list, and a loop over the node's few other ranks only)."""
        within = sum(rows[c] for c in dispatch.node_peers)
        self.within_nodes += within * row_bytes
        self.between_nodes += (sum(rows) - rows[dispatch.coord] - within) * row_bytes


class AllToAllDispatch:
    """Dispatch over an EP group (the seam ``MoE.dispatch``); ``token_group``: the ranks
    that split a microbatch's tokens (tensor and context parallel), or None; ``positions``:
    where this rank's tokens sit in a sequence of ``seq_len`` (its share, in its order);
    ``halves``: 2 to overlap the exchange with the experts (``exchange``); ``log``: where the
    rank waited on the all-to-alls and what it sent (one per rank, shared by its blocks: the
    step's breakdown); ``member_nodes[c]``: the node of the EP group's rank c (empty: one
    node), which only the bytes' count reads here."""

    combines = False  # (``NodeRelayDispatch``: weights and sums the experts' outputs itself)

    def __init__(self, ep_group: dist.ProcessGroup | None, ep: int, experts: int,
                 token_group: dist.ProcessGroup | None, positions: torch.Tensor | None = None,
                 seq_len: int = 0, halves: int = 1, log: ExchangeLog | None = None,
                 member_nodes: Sequence[int] = ()):
        if token_group is not None and (positions is None or seq_len <= 0):
            raise ValueError("a dispatch whose tokens a group splits needs their positions and "
                             "the sequence length")
        if halves not in (1, 2):
            raise ValueError(f"a dispatch splits a microbatch in 1 or 2 parts, not {halves}")
        self.ep_group, self.ep, self.experts, self.token_group = ep_group, ep, experts, token_group
        self.positions, self.seq_len = positions, seq_len
        # The positions of the input a multi-token module's MoE block takes whole on every tp
        # rank (``parallelize._split_positions_over_tp``): its T − k, or beside context
        # parallel the rank's whole part of the sequence
        self.whole_len = seq_len
        self.halves = halves if ep > 1 else 1  # (nothing to hide at ep 1)
        self.log = log if log is not None else ExchangeLog()
        self.coord = dist.get_rank(ep_group) if ep > 1 else 0
        self.member_nodes = tuple(member_nodes) or (0,) * ep
        if len(self.member_nodes) != ep:
            raise ValueError(f"an EP group of {ep} ranks was given the nodes of "
                             f"{len(self.member_nodes)}")
        mine = self.member_nodes[self.coord]  # (the other ranks of this rank's node)
        self.node_peers = [c for c, n in enumerate(self.member_nodes) if n == mine and c != self.coord]
        self.in_flight = 0  # all-to-alls started and not yet waited for
        self._placed: tuple | None = None  # ((tokens, top_k, device), place, every rank's places)

    def exchange(self, x_sorted: torch.Tensor, counts_HE: torch.Tensor, experts: Callable,
                 beside: Callable[[], torch.Tensor] | None = None):
        if self.ep == 1:
            return experts(x_sorted, counts_HE[0]), beside() if beside is not None else None
        return self._over_ep(x_sorted, counts_HE, experts, beside)

    @torch.compiler.disable  # eager in a compiled block: sized by the routing, on the host
    def _over_ep(self, x_sorted, counts_HE, experts, beside):
        H, ep, local = counts_HE.shape[0], self.ep, self.experts // self.ep
        # Counts first, every part's in one exchange: rank j receives, from every source, how
        # many rows of each part each of its experts gets. Then the block's one host sync:
        # the token all-to-alls need their split sizes.
        sent = counts_HE.view(H, ep, local).transpose(0, 1).contiguous()  # (dest, part, expert)
        received = torch.empty_like(sent)  # (source, part, local expert)
        self._counts(received, sent)
        host = torch.cat([sent.sum(2).T.reshape(-1), received.reshape(-1)]).tolist()
        got = [[host[H * ep + (s * H + h) * local:H * ep + (s * H + h + 1) * local]
                for s in range(ep)] for h in range(H)]  # [part][source][local expert]
        send = [host[h * ep:(h + 1) * ep] for h in range(H)]
        recv = [[sum(r) for r in got[h]] for h in range(H)]
        parts = x_sorted.split([sum(s) for s in send])
        out = [_Ticket(self, send[h], recv[h]) for h in range(H)]
        arriving = [_Post.apply(parts[h], out[h]) for h in range(H)]  # every part in flight
        back, leaving = [], []
        for h in range(H):
            rows = _Finish.apply(arriving[h], out[h])
            # Arrived grouped by source, then expert: regroup by expert for the grouped GEMM.
            order = _source_major_to_expert_major(received[:, h], sum(recv[h]))
            # (each expert's rows: on a GPU from the device's counts, which the grouped GEMM
            # reads there — a host list would be copied in, a stream sync per part)
            y = experts(rows[order], received[:, h].sum(0) if rows.is_cuda
                        else [sum(col) for col in zip(*got[h], strict=True)])
            back.append(_Ticket(self, recv[h], send[h]))
            leaving.append(_Post.apply(y.new_empty(y.shape).index_copy(0, order, y), back[h]))
            if H == 1:  # nothing to hide it behind
                leaving[h] = _Finish.apply(leaving[h], back[h])
        extra = beside() if beside is not None else None  # (beside the last part's way back)
        if H > 1:
            leaving = [_Finish.apply(t, b) for t, b in zip(leaving, back, strict=True)]
        return torch.cat(leaving) if H > 1 else leaving[0], extra

    def _counts(self, received: torch.Tensor, sent: torch.Tensor) -> None:
        """The counts' all-to-all (``sent`` → ``received``), waited for after ``hand_over``:
        inside a DualPipeV pair the other half computes meanwhile."""
        work = dist.all_to_all_single(received, sent, group=self.ep_group, async_op=True)
        hand_over()
        self.log.timed(work.wait)

    def sum_over_tokens(self, counts: torch.Tensor) -> torch.Tensor:
        if self.token_group is not None:
            dist.all_reduce(counts, group=self.token_group)
        return counts

    def keep_within_capacity(self, flat: torch.Tensor, weights: torch.Tensor, args: MoEArgs
                             ) -> torch.Tensor:
        """Decided over the whole microbatch, as one process decides it: the ranks of the token
        group all-gather its assignments (``keep_over_token_group``: 8 bytes an assignment, once
        per MoE block and microbatch and again where a block is recomputed; their places in
        the microbatch once per shape)."""
        if self.token_group is None:
            return keep_whole_microbatch(flat, weights, args)
        place, every_place = self._places(flat.numel() // args.top_k, args.top_k, flat.device)
        return keep_over_token_group(flat, weights, place, every_place, args, self._gather)

    def _gather(self, mine: torch.Tensor) -> torch.Tensor:
        """Every token-group rank's ``mine``, in group-rank order, end to end."""
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.token_group))]
        dist.all_gather(parts, mine, group=self.token_group)
        return torch.cat(parts)

    def _places(self, tokens: int, top_k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's assignments' places in the microbatch, and every rank's in the gather's
        order: gathered once per shape (every rank of the group meets the same shapes in the
        same order: they split the same microbatches)."""
        if self._placed is None or self._placed[0] != (tokens, top_k, device):
            if self.positions.device != device:  # once: not a copy (a host sync) per block
                self.positions = self.positions.to(device)
            place = assignment_places(self.positions, self.seq_len, tokens, top_k)
            self._placed = ((tokens, top_k, device), place, self._gather(place))
        return self._placed[1], self._placed[2]


class NodeRelayDispatch(AllToAllDispatch):
    """Dispatch in two hops, as DeepSeek-V3's (``parallelism.ep_dispatch: relay``): the EP
    group's ranks sit on nodes of equal counts, and the rank at local index l of its node is
    the relay, on every other node, of the ranks at index l. A token crosses once to each
    node holding any of its experts, to its relay there, with the weights of that node's
    experts; the relay hands it on inside the node (``AllToAllDispatch``'s exchange: it sends
    only to its own node), weights and sums those experts' outputs, and sends the one row
    back. Between nodes a token moves once per node reached instead of once per chosen
    expert: at most ``topk_group`` times where the router's groups map onto nodes.

    Both hops run over the EP group itself, a rank sending zero rows to the ranks outside its
    hop (under NCCL a zero-sized peer moves nothing); each hop's counts are exchanged first.
    The block waits for the host three times (the first hop's counts, the choices that
    arrived, the second hop's counts), against the direct exchange's one. Each all-to-all is
    an autograd node, so backward runs the hops in reverse. With a token travel its choices'
    weights (float32, their gradients coming back) and experts' ids (int32, no gradient):
    8 bytes a choice out, 4 back."""

    combines = True

    def __init__(self, ep_group: dist.ProcessGroup, ep: int, experts: int,
                 token_group: dist.ProcessGroup | None, positions: torch.Tensor | None,
                 seq_len: int, log: ExchangeLog | None, member_nodes: Sequence[int]):
        super().__init__(ep_group, ep, experts, token_group, positions, seq_len, 1, log,
                         member_nodes)
        nodes = sorted(set(self.member_nodes))
        members = {m: [c for c, n in enumerate(self.member_nodes) if n == m] for m in nodes}
        mine = members[self.member_nodes[self.coord]].index(self.coord)
        # Node i (in order of their relays for this rank's index) holds experts whose rank is
        # on it; ``relay[i]`` is the ep coordinate of this rank's relay there.
        self.relays = sorted(members[m][mine] for m in nodes)
        self.relay_coords = torch.tensor(self.relays)
        index = {self.member_nodes[c]: i for i, c in enumerate(self.relays)}
        local = experts // ep
        self.expert_node = torch.tensor([index[self.member_nodes[e // local]]
                                         for e in range(experts)])

    @torch.compiler.disable  # eager in a compiled block: sized by the routing, on the host
    def combine(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
                keep: torch.Tensor | None, experts: Callable) -> tuple[torch.Tensor, torch.Tensor]:
        """For the tokens ``x`` (n, D), their kept choices (``keep``, (n, k); None: all),
        ``chosen`` and ``weights`` (n, k): rows and the token each is of, a row a node
        reached, Σ_j weights[t, j] · expert_{chosen[t, j]}(x[t]) over that node's choices
        (the caller sums a token's rows: outside this eager call, so that a compiled block's
        output is its own and not this call's)."""
        n, dim = x.shape
        k, nodes, dev = chosen.shape[1], len(self.relays), x.device
        if self.expert_node.device != dev:  # (once: not a copy per block)
            self.expert_node, self.relay_coords = (self.expert_node.to(dev),
                                                   self.relay_coords.to(dev))
        node = self.expert_node[chosen]  # (n, k)
        kept = keep if keep is not None else torch.ones_like(node, dtype=torch.bool)
        # Each node's kept choices of each token; a row per (node, token) with any, in node
        # (= relay) order: counted on the device, their number known after the counts' exchange
        held = torch.zeros(nodes, n, dtype=torch.int32, device=dev).index_put_(
            (node, torch.arange(n, device=dev)[:, None].expand(n, k)), kept.int(), accumulate=True)
        sent = torch.zeros(self.ep, dtype=torch.int64, device=dev).index_copy_(
            0, self.relay_coords, (held > 0).sum(1))
        got = torch.empty_like(sent)
        self._counts(got, sent)
        host = torch.cat([sent, got]).tolist()  # (host sync 1 of 3)
        send, recv = host[:self.ep], host[self.ep:]
        to_node, token = torch.nonzero_static(held > 0, size=sum(send)).unbind(1)
        here = (node[token] == to_node[:, None]) & kept[token]  # (rows, k): the node's choices
        rows = self._across(x[token], send, recv)
        w = self._across(torch.where(here, weights[token].float(), 0.0), send, recv)
        ids = _Ticket(self, send, recv)  # (no gradient: which expert each choice is)
        ids.start(torch.where(here, chosen[token], -1).int(), send, recv)
        ids = ids.wait()
        # At the relay: each row's choices on this node, to their ranks here and back
        row, slot = torch.nonzero(ids >= 0, as_tuple=True)  # (host sync 2)
        expert = ids[row, slot].long()
        order = torch.argsort(expert, stable=True)
        row, slot, expert = row[order], slot[order], expert[order]
        counts = torch.zeros(self.experts, dtype=torch.int64, device=dev).index_add_(
            0, expert, torch.ones_like(expert)).view(1, -1)
        out, _ = self._over_ep(rows[row], counts, experts, None)  # (host sync 3: its counts)
        summed = rows.new_zeros(rows.shape, dtype=torch.float32).index_add(  # (in float32)
            0, row, (out * w[row, slot].unsqueeze(-1).to(out.dtype)).float()).to(rows.dtype)
        return self._across(summed, recv, send), token

    def _across(self, t: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """One all-to-all of ``t``'s rows, ``send[c]`` to rank c, ``recv[c]`` from it; its
        gradient's way back in backward."""
        ticket = _Ticket(self, send, recv)
        return _Finish.apply(_Post.apply(t, ticket), ticket)


def assignment_places(positions: torch.Tensor, seq_len: int, tokens: int, top_k: int) -> torch.Tensor:
    """Where a rank's assignments (its ``tokens`` in (batch, token) order, ``top_k`` each) sit
    in the microbatch's (batch, token, choice) order, its tokens being at ``positions`` of each
    sequence of ``seq_len``."""
    if tokens % positions.numel():
        raise ValueError(f"an MoE block under capacity got {tokens} tokens, not whole "
                         f"sequences of its {positions.numel()} positions")
    batch = torch.arange(tokens // positions.numel(), device=positions.device)
    token = (batch[:, None] * seq_len + positions[None, :]).reshape(-1)
    return (token[:, None] * top_k + torch.arange(top_k, device=positions.device)).reshape(-1)


def keep_over_token_group(flat: torch.Tensor, weights: torch.Tensor, place: torch.Tensor,
                          every_place: torch.Tensor, args: MoEArgs,
                          gather: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """This rank's share of the whole microbatch's capacity decision: ``gather`` (an all-gather
    over the ranks that split the microbatch's tokens) gives every rank all of its assignments
    as ``capacity_keys`` (expert and weight in one int64), which ``every_place`` (their places,
    in the gather's order) puts back in the microbatch's order for one process's rule; each
    rank keeps its own (``flat``, ``weights`` at ``place``)."""
    every = gather(capacity_keys(flat, weights))
    total = every.numel()
    if total != every_place.numel() or total % args.top_k:
        raise ValueError(f"the ranks splitting a microbatch hold {total} assignments, not "
                         f"the {every_place.numel()} placed of whole tokens of {args.top_k}")
    keys = torch.empty_like(every).index_copy_(0, every_place, every)  # the microbatch's order
    return keep_by_keys(keys, args.capacity(total // args.top_k), args.experts)[place]


def _source_major_to_expert_major(counts_SE: torch.Tensor, total: int) -> torch.Tensor:
    """Row indices that reorder blocks laid out (source, expert) into (expert, source);
    ``total``: the rows (known on the host already: no sync here)."""
    flat = counts_SE.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view_as(counts_SE).T.reshape(-1)
    lengths = counts_SE.T.reshape(-1)
    block_start = torch.repeat_interleave(starts, lengths, output_size=total)
    offset_in_block = torch.arange(total, device=counts_SE.device) - torch.repeat_interleave(
        torch.cumsum(lengths, 0) - lengths, lengths, output_size=total)
    return block_start + offset_in_block


class _Ticket:
    """One all-to-all in flight, each way: forward sends ``send[r]`` rows to rank r and takes
    ``recv[r]`` from it; backward the reverse, started where the forward waited (``_Finish``)
    and waited for where the forward started (``_Post``). So autograd, running a part's nodes
    in reverse, leaves the other part's exchange in flight while it computes."""

    __slots__ = ("owner", "send", "recv", "work", "keep")

    def __init__(self, owner: AllToAllDispatch, send: list[int], recv: list[int]):
        self.owner, self.send, self.recv = owner, send, recv
        self.work = self.keep = None

    def start(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        x = x.contiguous()
        out = x.new_empty((sum(recv), *x.shape[1:]))
        self.work = dist.all_to_all_single(out, x, recv, send, group=self.owner.ep_group,
                                           async_op=True)
        self.owner.log.count(self.owner, send, x[0].nbytes if len(x) else 0)
        self.keep = (x, out)  # (alive until it lands)
        self.owner.in_flight += 1
        return out

    def wait(self) -> torch.Tensor:
        hand_over()  # (inside a DualPipeV pair: the other half computes while this lands)
        self.owner.log.timed(self.work.wait)
        out = self.keep[1]
        self.work = self.keep = None
        self.owner.in_flight -= 1
        return out


class _Post(torch.autograd.Function):
    """Starts ``ticket``'s all-to-all of ``x`` and returns the tensor it lands in (read it only
    through ``_Finish``); backward waits for the gradient's way back and returns it."""

    @staticmethod
    def forward(ctx, x, ticket):
        ctx.ticket = ticket
        return ticket.start(x, ticket.send, ticket.recv)

    @staticmethod
    def backward(ctx, grad):
        return ctx.ticket.wait(), None


class _Finish(torch.autograd.Function):
    """Waits for ``ticket``'s all-to-all; backward starts the gradient's way back."""

    @staticmethod
    def forward(ctx, arriving, ticket):
        ctx.ticket = ticket
        return ticket.wait()

    @staticmethod
    def backward(ctx, grad):  # (passed on unchanged to ``_Post``'s, which returns what lands)
        t = ctx.ticket
        t.start(grad, t.recv, t.send)
        return grad, None


def apply_expert_parallel(model: nn.Module, mesh: Mesh, seq_len: int, overlap: bool = False,
                          log: ExchangeLog | None = None, dispatch: str = "direct",
                          nodes: Sequence[int] = ()) -> nn.Module:
    """Split every MoE block's experts over "ep" (on the meta device, before ZeRO-3) and give
    each block the all-to-all dispatcher; under tp and cp, the tp × cp ranks split its tokens
    (sequences of ``seq_len``). ``overlap``: each microbatch in two halves whose exchanges
    hide behind each other's experts (``parallelism.ep_overlap``); ``log``: where the blocks'
    waits on the exchanges go; ``dispatch``: direct, relay or auto (``relays``); ``nodes[g]``:
    the node of global rank g (empty: one node)."""
    log = log if log is not None else ExchangeLog()
    ep, tp, cp = mesh.dims.ep, mesh.dims.tp, mesh.dims.cp
    member_nodes: tuple[int, ...] = ()
    if ep > 1 and nodes:
        member_nodes = tuple(nodes[g] for g in dist.get_process_group_ranks(mesh["ep"].get_group()))
    if ep > 1 and dispatch == "relay" and len(set(Counter(member_nodes).values())) > 1:
        raise ValueError(f"parallelism.ep_dispatch=relay needs each node to hold as many ranks "
                         f"of an EP group; this rank's group is on nodes {member_nodes}: use "
                         "ep_dispatch=auto (direct there)")
    relay = ep > 1 and any(relays(dispatch, member_nodes, moe.args.top_k, overlap)
                           for _, moe in moe_layers(model))
    # The ranks that split a microbatch's tokens: its tensor- and context-parallel ranks.
    token_group = positions = None
    if cp > 1 or tp > 1:
        token_group = mesh["cp_tp" if cp > 1 and tp > 1 else "cp" if cp > 1 else "tp"].get_group()
        positions = token_positions(seq_len, mesh.coord(Axis.CP), cp, mesh.coord(Axis.TP), tp)
    for block_name, moe in moe_layers(model):
        # Each context-parallel rank's loss is the mean over its share of a sequence, cp× its
        # part of the whole: its part of the balancing loss weighs the same (ZeRO-3 averages
        # the gradients over dp × cp).
        moe.aux_share = float(cp)
        length, where = seq_len, positions
        if block_name.startswith("mtp.") and token_group is not None:  # multi-token module k
            # (from 0): over the first seq_len - k - 1 positions
            length = seq_len - int(block_name.split(".")[1]) - 1
            if cp > 1:  # on the rank's whole part (beside tp its tp rank's share of it),
                # routing those
                rows = torch.nonzero(positions < length).flatten()
                where = positions[rows]
                moe.rows = rows if rows.numel() < positions.numel() else None  # (None: all)
            else:  # a tp rank's share of them
                where = token_positions(length, 0, 1, mesh.coord(Axis.TP), tp)
        if ep > 1:
            coord = mesh["ep"].get_local_rank()
            for name in ("w1", "w2", "w3"):
                full = getattr(moe.experts, name)
                local = full.detach().chunk(ep, dim=0)[coord]
                setattr(moe.experts, name, nn.Parameter(DTensor.from_local(
                    local, mesh["ep"], [Shard(0)], run_check=False)))
        if relay:
            moe.dispatch = NodeRelayDispatch(mesh["ep"].get_group(), ep, moe.args.experts,
                                             token_group, where, length, log, member_nodes)
        else:
            moe.dispatch = AllToAllDispatch(mesh["ep"].get_group() if ep > 1 else None, ep,
                                            moe.args.experts, token_group, where, length,
                                            halves=2 if overlap else 1, log=log,
                                            member_nodes=member_nodes)
        if block_name.startswith("mtp.") and cp > 1:
            moe.dispatch.whole_len = seq_len // cp
    return model


def token_positions(seq_len: int, cp_rank: int, cp: int, tp_rank: int, tp: int) -> torch.Tensor:
    """Where the tokens an MoE block takes on this rank sit in their sequence: context
    parallel's chunks of it (``parallel/context.py``), then tensor parallel's contiguous
    share of those (the block's input is sharded on the sequence over tp)."""
    held = local_positions(seq_len, cp_rank, cp) if cp > 1 else torch.arange(seq_len)
    return held.chunk(tp)[tp_rank].clone()


def expert_divide_factor(mesh: Mesh) -> float:
    """What ZeRO-3 over the experts' replicas ("edp", or ("dp_replicate", "edp_shard") under
    hybrid sharding) divides expert gradients by: every data-parallel replica's
    (and context-parallel rank's) tokens reached them through the all-to-all, so the mean is
    over dp × cp, not edp."""
    return float(mesh.replicas)


def sum_over_token_ranks(mesh: Mesh) -> Callable[[torch.Tensor], None]:
    """Sums a tensor over the ranks of a stage that share the step's tokens (dp × tp; cp
    folded into dp's replicas): what an MoE block's per-step loads are summed over before its
    bias moves (a collective after every optimizer step, on every rank of the stage). The
    group is looked up at the first call: a mesh built without experts has none."""
    if mesh.replicas * mesh.dims.tp == 1:
        return lambda t: None

    def sum_over_ranks(t: torch.Tensor) -> None:
        dist.all_reduce(t, group=mesh["dp_tp"].get_group())
    return sum_over_ranks


def is_moe(model: nn.Module) -> bool:
    return any(isinstance(m, MoE) for m in model.modules())
