"""One MoE block against a dense SwiGLU MLP with the same active parameters, and the exposed
all-to-all time at ep 1, 2 and 4, the exchanges whole, overlapped (``parallelism.ep_overlap``:
each microbatch in two halves, one half's exchange in flight while the other's experts
compute) or relayed (``parallelism.ep_dispatch: relay``: two hops, a token once to each
simulated node its experts sit on, ``--node-ranks`` ranks a node), with Mixtral's routing and
DeepSeek-V3's (sigmoid, group-limited, bias: its groups map onto the nodes); a whole
training step of ``--step-preset`` on real rank actors at dp 2 · ep 2, whole against
overlapped, and at pp 2 · dp 2 · ep 2 under DualPipeV, its pairs one after the other against
taking turns (``schedule.pair_overlap``); and one block's attention, grouped-query against
DeepSeek-V3's latent attention; in one run.

    .venv/bin/python bench/moe.py                      # defaults: dim 512, 8 experts, top-2
    .venv/bin/python bench/moe.py --tokens 256 --dim 64 --expert-ffn 64 --reps 2   # smoke

Each expert-parallel degree runs as that many processes over gloo (NCCL on GPUs: the same
code), every rank with ``--tokens`` tokens of its own (weak scaling: the tokens per rank stay,
the experts per rank shrink). Rows: median seconds of forward + backward per rank, the forward
alone, the time the rank waited on the all-to-alls in forward and backward (counts, tokens and
the way back, as ``parallel.expert.AllToAllDispatch`` times them: what is exposed; a whole
exchange is all exposed), and the ratio to the dense MLP. The step table reads each rank's
step breakdown (``a2a_s``) and compares the runs' losses. On one CPU the ranks share
cores, so the ep > 1 rows show the exchange's cost more than its speed-up, and an exchange
in flight competes with the experts for the same cores.
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
    moe = MoE(args.dim, MoEArgs(experts=args.experts,
                                top_k=args.ds_top_k if deepseek else args.top_k,
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


def _measure(args, ep: int, rank: int, deepseek: bool = False, mode: str = "whole") -> dict:
    import torch
    import torch.distributed as dist

    from trainmesh.parallel.expert import AllToAllDispatch, NodeRelayDispatch

    moe = _block(args, ep, rank, deepseek)
    group = dist.group.WORLD if ep > 1 else None
    nodes = tuple(r // args.node_ranks for r in range(ep))  # simulated nodes of the ranks
    if mode == "relayed":
        dispatch = NodeRelayDispatch(group, ep, args.experts, None, None, 0, None, nodes)
    else:
        dispatch = AllToAllDispatch(group, ep, args.experts, None,
                                    halves=2 if mode == "overlapped" else 1,
                                    member_nodes=nodes if ep > 1 else ())
    moe.dispatch = dispatch
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

    dispatch.log.start(None)
    total = _time(step, args.reps)
    exchange = dispatch.log.waited_s() / (args.reps + 1)
    between = dispatch.log.between_nodes / (args.reps + 1) / 2**20
    fwd = _time(forward, args.reps)
    return {"step": total, "forward": fwd, "exchange": exchange, "between": between}


def _rank(rank: int, ep: int, port: int, args, out, deepseek: bool = False,
          mode: str = "whole") -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ep)
    try:
        out[rank] = _measure(args, ep, rank, deepseek, mode)
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
    return {"step": step, "forward": fwd, "exchange": 0.0, "between": 0.0}


def _steps(args) -> None:
    """A whole training step of ``--step-preset`` at dp 2 · ep 2 on real rank actors (a local
    Ray instance, gloo), the exchanges whole, overlapped and relayed (a node a rank): the
    step, each rank's exposed all-to-all (its breakdown's ``a2a_s``) and bytes sent to the
    other node (``a2a_internode_mib``), the losses of the runs side by side."""
    import statistics
    import tempfile

    import ray

    from trainmesh.cli.loading import load_spec
    from trainmesh.controller.ray_group import RayWorkerGroup, placement_for
    from trainmesh.data.shards import ensure_tiny_corpus
    from trainmesh.parallel.dims import ParallelDims
    from trainmesh.planning.topology import Topology

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    rows, pairs = [], []
    common = [f"model.preset={args.step_preset}", f"training.seq_len={args.step_seq_len}",
              "training.microbatch_size=1", "optimizer.warmup_steps=1",
              f"training.steps={args.step_steps + 1}", "runtime.device=cpu",
              "tracking.enabled=false"]

    def run(dims, sets: list[str], tmp: str, data_dir: str) -> tuple:
        spec = load_spec(None, [*common, *sets, f"runtime.output_dir={tmp}/out"])
        group = RayWorkerGroup(spec, dims, placement_for(spec, dims, Topology.uniform(
            1, dims.world_size, "cpu")), {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
        try:
            group.build(spec.model_dump_json(), dims, data_dir)
            losses = [group.train_step()[0]["loss"]]  # (a warm-up: not timed)
            steps, a2a, between, handovers = [], [], [], []
            for _ in range(args.step_steps):
                stats = group.train_step()
                losses.append(stats[0]["loss"])
                steps.append(max(r["breakdown"]["step_s"] for r in stats))
                a2a.append(max(r["breakdown"]["a2a_s"] for r in stats))
                between.append(statistics.mean(r["breakdown"]["a2a_internode_mib"]
                                               for r in stats))
                handovers.append(min(r["breakdown"].get("pair_handovers_forward", 0)
                                     + r["breakdown"].get("pair_handovers_backward", 0)
                                     for r in stats))
        finally:
            group.shutdown()
        return (statistics.median(steps), statistics.median(a2a), statistics.median(between),
                losses, statistics.median(handovers))

    try:
        with tempfile.TemporaryDirectory() as tmp:
            data_dir = str(ensure_tiny_corpus(os.path.join(tmp, "data")))
            for mode in ("whole", "overlapped", "relayed"):
                rows.append((mode, *run(ParallelDims(dp=2, ep=2), [
                    "parallelism.dp=2", "parallelism.ep=2",
                    f"parallelism.ep_overlap={str(mode == 'overlapped').lower()}",
                    f"parallelism.ep_dispatch={'relay' if mode == 'relayed' else 'direct'}",
                    "parallelism.ep_node_ranks=1", "training.global_batch_size=4"], tmp,
                    data_dir)[:4]))
            # DualPipeV at pp 2 · dp 2 · ep 2 (2·pp microbatches a replica): its pairs one
            # after the other, then taking turns (schedule.pair_overlap)
            for turns in (False, True):
                pairs.append(("taking turns" if turns else "one after the other", *run(
                    ParallelDims(pp=2, dp=2, ep=2), [
                        "parallelism.pp=2", "parallelism.dp=2", "parallelism.ep=2",
                        "parallelism.vpp=2", "schedule.name=dualpipev",
                        "runtime.cpus_per_rank=0.5",  # (4 ranks on the 2 cores)
                        f"schedule.pair_overlap={str(turns).lower()}",
                        "training.global_batch_size=8"], tmp, data_dir)))
    finally:
        ray.shutdown()
    whole = rows[0]
    print(f"\nA whole step: {args.step_preset}, dp 2 · ep 2 (a node a rank), seq "
          f"{args.step_seq_len}, global batch 4 × microbatch 1 (median of {args.step_steps} "
          "steps; the slowest rank; MiB a rank sent to the other node, the mean)")
    print(f"{'':14} {'step s':>8} {'exposed all-to-all s':>21} {'share':>6} {'vs whole':>9} "
          f"{'between nodes MiB':>18} {'max |loss - whole|':>19}")
    for mode, step, a2a, between, losses in rows:
        diff = max(abs(a - b) for a, b in zip(losses, whole[4], strict=True))
        print(f"{mode:14} {step:8.4f} {a2a:21.4f} {a2a / step:6.1%} {step / whole[1]:8.2f}x "
              f"{between:18.2f} {diff:19.2e}")
    first = pairs[0]
    print(f"\nDualPipeV's pairs: {args.step_preset}, pp 2 · dp 2 · ep 2, seq {args.step_seq_len}, "
          f"global batch 8 × microbatch 1 (4 a replica; median of {args.step_steps} steps; the "
          "slowest rank; hand-overs: the fewest of a rank's in a step)")
    print(f"{'pairs':20} {'step s':>8} {'exposed all-to-all s':>21} {'share':>6} {'vs first':>9} "
          f"{'hand-overs':>11} {'max |loss - first|':>19}")
    for mode, step, a2a, _, losses, handovers in pairs:
        diff = max(abs(a - b) for a, b in zip(losses, first[4], strict=True))
        print(f"{mode:20} {step:8.4f} {a2a:21.4f} {a2a / step:6.1%} {step / first[1]:8.2f}x "
              f"{handovers:11.0f} {diff:19.2e}")


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
    p.add_argument("--ds-top-k", type=int, default=4,
                   help="DeepSeek-V3 rows: experts per token (V3: 8 of 256 from 4 of 8 groups)")
    p.add_argument("--node-ranks", type=int, default=1,
                   help="ranks a simulated node holds (bytes between nodes; the relay's hops)")
    p.add_argument("--heads", type=int, default=8, help="the attention table's heads")
    p.add_argument("--step-preset", default="tiny-moe", help="the whole-step table's model")
    p.add_argument("--step-steps", type=int, default=4, help="its timed steps (0: no table)")
    p.add_argument("--step-seq-len", type=int, default=256)
    args = p.parse_args()

    import torch.multiprocessing as mp

    rows = [("dense SwiGLU (same active params)", _dense(args))]
    for deepseek in (False, True):
        kind = (f"DeepSeek-V3 routing (top-{args.ds_top_k} from {args.topk_group} of "
                f"{args.groups} groups, sigmoid)" if deepseek else f"MoE top-{args.top_k}")
        for ep in (int(e) for e in args.eps.split(",")):
            if ep == 1:
                rows.append((f"{kind} ep=1", _measure(args, 1, 0, deepseek)))
                continue
            for mode in ("whole", "overlapped", "relayed"):
                with mp.Manager() as manager:
                    out = manager.dict()
                    mp.spawn(_rank, args=(ep, 29600 + ep, args, out, deepseek, mode), nprocs=ep)
                    worst = {k: max(out[r][k] for r in range(ep))
                             for k in ("step", "forward", "exchange")}
                    worst["between"] = sum(out[r]["between"] for r in range(ep)) / ep
                rows.append((f"{kind} ep={ep} {mode}", worst))
    dense = rows[0][1]["step"]
    print(f"\nMoE block: dim {args.dim}, {args.experts} experts × ffn {args.expert_ffn}, "
          f"{args.tokens} tokens per rank (median of {args.reps}; ep > 1: the slowest rank; "
          f"nodes of {args.node_ranks} rank(s): MiB a rank sent to other nodes per fwd+bwd, "
          "the mean; relayed: two hops, once to each node a token reaches)")
    print(f"{'':74} {'fwd+bwd s':>10} {'fwd s':>9} {'exposed all-to-all s':>21} {'share':>6} "
          f"{'vs dense':>9} {'between nodes MiB':>18}")
    for name, r in rows:
        share = r["exchange"] / r["step"] if r["step"] else 0.0
        print(f"{name:74} {r['step']:10.4f} {r['forward']:9.4f} {r['exchange']:21.4f} "
              f"{share:6.1%} {r['step'] / dense:8.2f}x {r['between']:18.2f}")
    if args.step_steps:
        _steps(args)
    attention = _attention(args)
    gqa = attention[0][1]["step"]
    print(f"\nOne block's attention: dim {args.dim}, {args.heads} heads, {args.tokens} tokens "
          f"(median of {args.reps})")
    print(f"{'':58} {'fwd+bwd s':>10} {'fwd s':>9} {'vs GQA':>7}")
    for name, r in attention:
        print(f"{name:58} {r['step']:10.4f} {r['forward']:9.4f} {r['step'] / gqa:6.2f}x")


if __name__ == "__main__":
    main()
