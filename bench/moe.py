"""One MoE block against a dense SwiGLU MLP with the same active parameters, and the share of the
block's forward spent dispatching and combining tokens at ep 1, 2 and 4, with Mixtral's routing
and DeepSeek-V3's (sigmoid, group-limited, bias); and one block's attention, grouped-query
against DeepSeek-V3's latent attention; in one run.

    .venv/bin/python bench/moe.py                      # defaults: dim 512, 8 experts, top-2
    .venv/bin/python bench/moe.py --tokens 256 --dim 64 --expert-ffn 64 --reps 2   # smoke

Each expert-parallel degree runs as that many processes over gloo (NCCL on GPUs: the same
code), every rank with ``--tokens`` tokens of its own (weak scaling: the tokens per rank stay,
the experts per rank shrink). Rows: median seconds of forward + backward per rank, the forward
alone, the forward's all-to-all time (counts, tokens and the way back, as
``parallel.expert.AllToAllDispatch`` makes them; the backward makes the same exchanges again),
and the ratio to the dense MLP. On one CPU the ranks share cores, so the ep > 1 rows show the
exchange's cost more than its speed-up.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _block(args, ep: int, rank: int, deepseek: bool = False):
    import torch

    from trainmesh.kernels import kernel_set
    from trainmesh.models.moe.moe import MoE, MoEArgs

    torch.manual_seed(0)
    routing = (dict(router="sigmoid", balance="bias", n_group=args.groups,
                    topk_group=args.topk_group, routed_scaling_factor=2.5) if deepseek else {})
    moe = MoE(args.dim, MoEArgs(experts=args.experts, top_k=args.top_k,
                                expert_ffn_dim=args.expert_ffn, aux_loss_coef=0.0, **routing),
              kernel_set("torch"))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.02)
    if ep > 1:  # this rank's experts only, as expert parallel leaves them
        for name in ("w1", "w2", "w3"):
            full = getattr(moe.experts, name)
            setattr(moe.experts, name, torch.nn.Parameter(full.detach().chunk(ep)[rank].clone()))
    return moe


def _time(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class _Timed:
    """Wraps a dispatcher, adding up the seconds its forward exchanges take."""

    def __init__(self, inner):
        self.inner, self.seconds = inner, 0.0

    def _timed(self, fn, *a):
        t0 = time.perf_counter()
        out = fn(*a)
        self.seconds += time.perf_counter() - t0
        return out

    def dispatch(self, x, counts):
        return self._timed(self.inner.dispatch, x, counts)

    def combine(self, y, state):
        return self._timed(self.inner.combine, y, state)

    def sum_over_tokens(self, counts):
        return counts

    def keep_within_capacity(self, flat, weights, args):
        return self.inner.keep_within_capacity(flat, weights, args)


def _measure(args, ep: int, rank: int, deepseek: bool = False) -> dict:
    import torch
    import torch.distributed as dist

    from trainmesh.parallel.expert import AllToAllDispatch

    moe = _block(args, ep, rank, deepseek)
    group = dist.group.WORLD if ep > 1 else None
    timed = _Timed(AllToAllDispatch(group, ep, args.experts, None))
    moe.dispatch = timed
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(1, args.tokens, args.dim, generator=g, requires_grad=True)

    def step():
        if group is not None:
            dist.barrier(group)
        moe(x).sum().backward()
        moe.routed.zero_()

    def forward():
        if group is not None:
            dist.barrier(group)
        with torch.no_grad():
            moe(x)

    total = _time(step, args.reps)
    timed.seconds = 0.0
    fwd = _time(forward, args.reps)
    exchange = timed.seconds / (args.reps + 1)
    return {"step": total, "forward": fwd, "exchange": exchange}


def _rank(rank: int, ep: int, port: int, args, out, deepseek: bool = False) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ep)
    try:
        out[rank] = _measure(args, ep, rank, deepseek)
    finally:
        dist.destroy_process_group()


def _dense(args) -> dict:
    import torch

    from trainmesh.kernels import kernel_set
    from trainmesh.models.llama.model import FeedForward

    torch.manual_seed(0)
    ffn = FeedForward(args.dim, args.top_k * args.expert_ffn, kernel_set("torch"))
    x = torch.randn(1, args.tokens, args.dim, requires_grad=True)
    step = _time(lambda: ffn(x).sum().backward(), args.reps)
    with torch.no_grad():
        fwd = _time(lambda: ffn(x), args.reps)
    return {"step": step, "forward": fwd, "exchange": 0.0}


def _attention(args) -> list[tuple[str, dict]]:
    """One block's attention, forward + backward, one process: grouped-query attention against
    DeepSeek-V3's latent attention at the same width and heads (its sizes in DeepSeek-V3's
    proportions to the width: q latent 3/14, kv latent 1/14, head 128 + 64 rotary of 7168 / 128
    heads, value 128), on the torch kernels."""
    import torch

    from trainmesh.models.llama.mla import MLAArgs
    from trainmesh.models.llama.model import LlamaArgs, TransformerBlock
    from trainmesh.models.llama.rope import rope_tables

    heads = args.heads
    hd = args.dim // heads
    mla = MLAArgs(kv_lora_rank=max(16, args.dim // 14), qk_nope_head_dim=hd, v_head_dim=hd,
                  qk_rope_head_dim=max(2, hd // 2), q_lora_rank=max(16, 3 * args.dim // 14))
    rows = []
    for name, extra in (("GQA attention (kv heads = heads / 4)", {}),
                        ("MLA attention (DeepSeek-V3's proportions)", {"mla": mla})):
        a = LlamaArgs(dim=args.dim, n_layers=1, n_heads=heads, n_kv_heads=max(1, heads // 4),
                      ffn_dim=args.dim, vocab_size=256, max_seq_len=args.tokens, **extra)
        torch.manual_seed(0)
        att = TransformerBlock(a).attention
        with torch.no_grad():
            for p in att.parameters():
                p.normal_(0, 0.02)
        cos, sin = rope_tables(a.rope_dim, args.tokens, 10000.0)
        x = torch.randn(1, args.tokens, args.dim, requires_grad=True)
        run = functools.partial(att, x, cos, sin)
        step = _time(lambda run=run: run().sum().backward(), args.reps)
        with torch.no_grad():
            fwd = _time(run, args.reps)
        params = sum(p.numel() for p in att.parameters())
        rows.append((f"{name}, {params / 1e6:.2f}M params", {"step": step, "forward": fwd}))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--expert-ffn", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048, help="per rank")
    p.add_argument("--eps", default="1,2,4")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--groups", type=int, default=4, help="DeepSeek-V3 rows: expert groups")
    p.add_argument("--topk-group", type=int, default=2, help="DeepSeek-V3 rows: groups per token")
    p.add_argument("--heads", type=int, default=8, help="the attention table's heads")
    args = p.parse_args()

    import torch.multiprocessing as mp

    rows = [("dense SwiGLU (same active params)", _dense(args))]
    for deepseek in (False, True):
        kind = (f"DeepSeek-V3 routing ({args.topk_group} of {args.groups} groups, sigmoid)"
                if deepseek else "MoE")
        for ep in (int(e) for e in args.eps.split(",")):
            if ep == 1:
                rows.append((f"{kind} ep=1", _measure(args, 1, 0, deepseek)))
                continue
            with mp.Manager() as manager:
                out = manager.dict()
                mp.spawn(_rank, args=(ep, 29600 + ep, args, out, deepseek), nprocs=ep)
                worst = {k: max(out[r][k] for r in range(ep)) for k in ("step", "forward", "exchange")}
            rows.append((f"{kind} ep={ep}", worst))
    dense = rows[0][1]["step"]
    print(f"\nMoE block: dim {args.dim}, {args.experts} experts × ffn {args.expert_ffn}, "
          f"top-{args.top_k}, {args.tokens} tokens per rank (median of {args.reps}; ep > 1: the "
          "slowest rank)")
    print(f"{'':58} {'fwd+bwd s':>10} {'fwd s':>9} {'fwd all-to-all s':>17} {'share':>6} "
          f"{'vs dense':>9}")
    for name, r in rows:
        share = r["exchange"] / r["forward"] if r["forward"] else 0.0
        print(f"{name:58} {r['step']:10.4f} {r['forward']:9.4f} {r['exchange']:17.4f} "
              f"{share:6.1%} {r['step'] / dense:8.2f}x")
    attention = _attention(args)
    gqa = attention[0][1]["step"]
    print(f"\nOne block's attention: dim {args.dim}, {args.heads} heads, {args.tokens} tokens "
          f"(median of {args.reps})")
    print(f"{'':58} {'fwd+bwd s':>10} {'fwd s':>9} {'vs GQA':>7}")
    for name, r in attention:
        print(f"{name:58} {r['step']:10.4f} {r['forward']:9.4f} {r['step'] / gqa:6.2f}x")


if __name__ == "__main__":
    main()
