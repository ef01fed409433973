"""The MoE block on one process: routing, dispatch, dropping, balancing, against a token-by-token
computation; the spec's rules for ep; parameter and FLOP counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainmesh.cli.loading import load_spec
from trainmesh.engine.engine import build_model
from trainmesh.kernels import kernel_set
from trainmesh.models.llama.model import LlamaArgs
from trainmesh.models.moe.moe import (
    MoE,
    MoEArgs,
    aligned_groups,
    balance_experts,
    expert_swiglu,
    float8_expert_swiglu,
    float8_grouped_kind,
    moe_layers,
)
from trainmesh.parallel.expert import _source_major_to_expert_major
from trainmesh.planning.job_plan import replan_job
from trainmesh.planning.topology import Topology
from trainmesh.spec.problems import SpecError

OPS = kernel_set("torch")


def _moe(seed=0, dim=16, **kw) -> MoE:
    args = MoEArgs(**{"experts": 6, "top_k": 2, "expert_ffn_dim": 12, **kw})
    shared = None
    if args.shared_experts:
        from trainmesh.models.llama.model import FeedForward

        shared = FeedForward(dim, args.shared_experts * args.expert_ffn_dim, OPS)
    moe = MoE(dim, args, OPS, shared)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return moe


def _token_by_token(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token alone: its scores, its top-k experts, their SwiGLUs, weighted."""
    a, e = moe.args, moe.experts
    out = []
    for t in x.reshape(-1, x.shape[-1]):
        logits = moe.router.weight @ t
        s = logits.softmax(-1) if a.router == "softmax" else logits.sigmoid()
        chosen = sorted(range(a.experts), key=lambda i: (-float(s[i].detach() + moe.expert_bias[i]), i))
        chosen = chosen[:a.top_k]
        w = s[chosen] / s[chosen].sum() if a.normalize_top_k else s[chosen]
        y = sum(wi * (F.silu(e.w1[i] @ t) * (e.w3[i] @ t)) @ e.w2[i].T for wi, i in zip(w, chosen, strict=True))
        out.append(y + (moe.shared(t) if moe.shared is not None else 0))
    return torch.stack(out).view_as(x)


@pytest.mark.parametrize("kw", [{}, {"router": "sigmoid", "normalize_top_k": False},
                                {"shared_experts": 1, "top_k": 3}, {"balance": "bias"}])
def test_moe_equals_each_token_through_its_experts(kw):
    moe = _moe(**kw)
    if moe.args.balance == "bias":  # the bias chooses experts, it never weights them
        moe.expert_bias.copy_(torch.tensor([0.5, 0.0, -0.5, 0.2, 0.0, 0.1]))
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(moe(x), _token_by_token(moe, x), rtol=1e-5, atol=1e-6)


def test_grouped_gemm_equals_the_per_expert_loop_forward_and_backward():
    g = torch.Generator().manual_seed(0)
    w1, w3 = (torch.randn(4, 12, 8, generator=g, requires_grad=True) for _ in range(2))
    w2 = torch.randn(4, 8, 12, generator=g, requires_grad=True)
    counts = [3, 0, 5, 1]  # an expert with no rows
    x = torch.randn(sum(counts), 8, generator=g, requires_grad=True)
    results = []
    for grouped in (False, True):
        y = expert_swiglu(x, counts, w1, w2, w3, OPS.swiglu, grouped)
        grads = torch.autograd.grad((y * torch.arange(y.numel()).view_as(y)).sum(), (x, w1, w2, w3))
        results.append((y, grads))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert (results[0][1][1][1] == 0).all()  # the empty expert: a zero gradient, not None


def test_float8_experts_pad_each_experts_rows_once_and_stay_within_float8s_error():
    """training.float8's experts: torchao's MXFP8 grouped GEMMs, emulated on CPU, over groups
    of rows that do not come in its 32-row blocks (an expert with none among them). The layout
    made once for the three GEMMs starts every expert's rows at a multiple of 32 (what the
    GPU kernels need; the emulation would also run without); each expert's outputs and weight
    gradients are those of its rows alone, an expert without rows gets a zero gradient, and
    the outputs and gradients are within float8's error of float32's — but not equal."""
    torch.manual_seed(0)
    counts, dim, ffn = [5, 0, 17, 10], 64, 64
    x = torch.randn(sum(counts), dim, requires_grad=True)
    w1, w3 = ((torch.randn(4, ffn, dim) * 0.1).requires_grad_() for _ in range(2))
    w2 = (torch.randn(4, dim, ffn) * 0.1).requires_grad_()
    swiglu, weights = kernel_set("torch").swiglu, (w1, w2, w3)
    grad = torch.randn(sum(counts), dim)

    def run(fn, rows, counts):
        out = fn(rows, counts, *weights, swiglu)
        return out, torch.autograd.grad(out, [rows, *weights], grad[:out.shape[0]] if
                                        out.shape[0] == grad.shape[0] else grad[5:22])

    f8 = lambda *a: float8_expert_swiglu(*a, "mxfp8-emulated")  # noqa: E731
    y8, g8 = run(f8, x, counts)
    y, g = run(lambda *a: expert_swiglu(*a, False), x, counts)
    for got, want in ((y8, y), *zip(g8, g, strict=True)):
        err = ((got - want).norm() / want.norm()).item()
        assert 0 < err < 0.15, err
    assert (g8[1][1] == 0).all() and (g8[2][1] == 0).all()  # expert 1 took no rows
    alone = x[5:22].detach().requires_grad_()
    y_alone, g_alone = run(f8, alone, [0, 0, 17, 0])
    assert torch.equal(y_alone, y8[5:22].detach())
    for w8, w_alone in zip(g8[1:], g_alone[1:], strict=True):  # its weights' gradients
        assert torch.equal(w8[2], w_alone[2])
    # the layout the grouped GEMMs get: every expert's rows from a multiple of 32, in order
    into, offs, bound = aligned_groups(counts, sum(counts), 32, x.device)
    ends = offs.tolist()
    assert ends == [32, 32, 64, 96] and bound % 32 == 0 and bound >= ends[-1]
    assert into.tolist() == [*range(0, 5), *range(32, 49), *range(64, 74)]
    assert float8_grouped_kind("cpu", None) == "mxfp8-emulated"
    # Hopper's rowwise kernels; none before 9.0 or on consumer Blackwell (12.x); the data
    # centre Blackwell's (10.x) only where torchao's SM100 kernels are installed (not here)
    assert [float8_grouped_kind("cuda", c) for c in ((8, 9), (9, 0), (12, 0), (10, 0))] == [
        None, "rowwise", None, None]


def test_capacity_drops_the_lowest_weighted_assignments_and_counts_them():
    moe = _moe(capacity_factor=0.5)
    with torch.no_grad():
        moe.router.weight.zero_()  # equal scores: every token's top 2 are experts 0 and 1
    x = torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(2))
    y = moe(x)  # 16 assignments, capacity ceil(0.5 × 8 × 2 / 6) = 2 per expert
    assert moe.args.capacity(8) == 2
    kept = _token_by_token(moe, x)[0, :2]  # equal weights: the first two tokens are kept
    torch.testing.assert_close(y[0, :2], kept, rtol=1e-5, atol=1e-6)
    assert (y[0, 2:] == 0).all()
    stats = balance_experts(moe)
    assert stats[""]["dropped"] == 12 and stats[""]["load_max_over_mean"] == pytest.approx(3.0)


def test_ties_go_to_the_lowest_expert_index():
    moe = _moe(top_k=3)
    with torch.no_grad():
        moe.router.weight.zero_()
        _, idx, weights = moe.route(torch.randn(7, 16))
    assert idx.tolist() == [[0, 1, 2]] * 7
    torch.testing.assert_close(weights, torch.full((7, 3), 1 / 3))


def test_the_bias_moves_towards_balance_after_each_step_and_only_chooses():
    moe = _moe(balance="bias", bias_update_rate=0.1)
    x = torch.randn(1, 12, 16, generator=torch.Generator().manual_seed(3))
    moe(x).sum().backward()
    load = moe.routed.clone()
    balance_experts(moe)
    mean = load.double().mean()
    want = 0.1 * torch.sign(mean - load.double()).float()
    torch.testing.assert_close(moe.expert_bias, want)
    assert int(moe.routed.sum()) == 0  # counters reset for the next step


def test_a_compiled_block_trains_the_router_with_its_balancing_loss_at_each_microbatchs_share():
    """torch.compile of the block (graph breaks at the dispatch): the balancing loss's gradient
    reaches the router at each microbatch's share — 1, 0.25, then 0 for a padding microbatch,
    which counts nothing — as in eager. Compiled, the share once became a constant of the
    first graph, or a symbol dynamo could not carry, and a graph break before the injection
    left the block's output a graph input handed back unchanged: the router got no balancing
    gradient at all."""
    import copy

    eager = _moe(aux_loss_coef=0.5)
    compiled = copy.deepcopy(eager)
    compiled.compile(backend="aot_eager")
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(5))
    upstream = torch.linspace(-1, 1, x.numel()).view_as(x)
    by_share = {}
    for share in (1.0, 0.25, 0.0):
        grads = []
        for moe in (eager, compiled):
            moe.zero_grad()
            moe.reset_counters()
            moe.loss_scale = share
            (moe(x) * upstream).sum().backward()
            grads.append((moe.router.weight.grad.clone(), moe.routed.clone(), moe.aux_total.clone()))
        (want, want_routed, want_aux), (got, got_routed, got_aux) = grads
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        assert torch.equal(got_routed, want_routed) and torch.equal(got_aux, want_aux), share
        assert (int(want_routed.sum()) == 0) == (share == 0)
        by_share[share] = want
    # ... and the balancing loss's part was there to lose: without it the share does not matter
    assert not torch.allclose(by_share[1.0], by_share[0.0], rtol=1e-3)
    assert not torch.allclose(by_share[0.25], by_share[0.0], rtol=1e-3)


def test_a_compiled_block_is_not_recompiled_for_each_routing():
    """The per-expert loop (no grouped GEMM: its splits sized by the routing's counts on the
    host) runs eagerly inside a compiled block: after the first calls (dynamo marks the
    changing sizes dynamic once), new routings reuse the graphs; compiled, the loop recompiled
    for every routing until dynamo gave up on the block."""
    moe = _moe(aux_loss_coef=0.5)
    moe.compile(backend="aot_eager")
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(6)
    for _ in range(2):  # warm-up: the first graphs, then their dynamic-shape versions
        moe(torch.randn(2, 5, 16, generator=g)).sum().backward()
    with torch._dynamo.config.patch(error_on_recompile=True):
        counts = set()
        for _ in range(4):  # other routings of the same batch
            moe.reset_counters()
            moe(torch.randn(2, 5, 16, generator=g)).sum().backward()
            counts.add(tuple(moe.routed.tolist()))
    assert len(counts) > 1, counts  # (the routings did differ)


def test_the_balancing_loss_trains_the_router_as_if_added_to_the_loss():
    """Its gradient is injected in backward (so it works on any pipeline stage); it must equal
    adding coef × E/k × Σ f·P, times the microbatch's share, to the loss."""
    moe = _moe(aux_loss_coef=0.1)
    moe.loss_scale = 0.25
    x = torch.randn(1, 10, 16, generator=torch.Generator().manual_seed(4))
    moe(x).sum().backward()
    got = moe.router.weight.grad.clone()
    moe.zero_grad()
    moe.args = MoEArgs(**{**moe.args.__dict__, "aux_loss_coef": 0.0})
    y = moe(x)
    scores, idx, _ = moe.route(x.view(-1, 16))
    f = torch.bincount(idx.reshape(-1), minlength=6).float() / 10
    aux = 0.1 * 6 / 2 * (f * scores.mean(0)).sum()
    (y.sum() + 0.25 * aux).backward()
    torch.testing.assert_close(got, moe.router.weight.grad, rtol=1e-5, atol=1e-7)


def test_recomputed_blocks_count_their_tokens_once():
    spec = load_spec(None, ["model.preset=tiny-moe", "runtime.device=cpu"])
    x = torch.randint(0, 264, (2, 16), generator=torch.Generator().manual_seed(5))
    out = {}
    for mode in ("none", "full"):
        model = build_model(spec, torch.device("cpu"))
        for block in model.layers.values():
            block.recompute = mode == "full"
        model(x, x).backward()
        out[mode] = ({n: p.grad.clone() for n, p in model.named_parameters()},
                     {n: m.routed.clone() for n, m in moe_layers(model)},
                     {n: float(m.aux_total) for n, m in moe_layers(model)})
    for n, g in out["none"][0].items():
        torch.testing.assert_close(out["full"][0][n], g, rtol=1e-5, atol=1e-7)
    for n, r in out["none"][1].items():
        assert torch.equal(out["full"][1][n], r) and int(r.sum()) == 2 * 16 * 2
    assert out["full"][2] == pytest.approx(out["none"][2])


def test_regrouping_received_blocks_by_expert():
    counts = torch.tensor([[2, 0, 1], [1, 3, 0]])  # (source, expert): rows arrive source-major
    rows = [f"s{s}e{e}" for s in range(2) for e in range(3) for _ in range(int(counts[s, e]))]
    order = _source_major_to_expert_major(counts, int(counts.sum()))
    assert [rows[i] for i in order] == ["s0e0", "s0e0", "s1e0", "s1e1", "s1e1", "s1e1", "s0e2"]


@pytest.mark.parametrize("extra", [[], ["model.moe.shared_experts=2", "model.moe.dense_layers=1"]])
def test_parameter_count_is_exact_and_flops_count_the_active_experts(extra):
    spec = load_spec(None, ["model.preset=tiny-moe", "runtime.device=cpu", *extra])
    model = build_model(spec, torch.device("cpu"))
    args = LlamaArgs.from_config(spec.model)
    assert args.num_params() == sum(p.numel() for p in model.parameters())
    dense_equivalent = args.num_params(active=True)  # top-2 of 8 experts
    moe = spec.model.moe
    layers = spec.model.n_layers - moe.dense_layers
    assert args.num_params() - dense_equivalent == layers * (moe.experts - moe.top_k) * 3 * 64 * 64
    assert args.flops_per_token(32) == 6 * (dense_equivalent - 264 * 64) + 6 * 4 * 64 * 32


@pytest.mark.parametrize("args, field, fix", [
    (["model.preset=tiny", "parallelism.dp=2", "parallelism.ep=2"], "parallelism.ep", "model.moe"),
    (["model.preset=tiny-moe", "parallelism.dp=6", "parallelism.ep=3",
      "training.global_batch_size=12"], "parallelism.ep", "[1, 2]"),
    (["model.preset=tiny-moe", "model.moe.top_k=9"], "model.moe", "at most"),
])
def test_bad_expert_layouts_are_refused_naming_the_field_and_fix(args, field, fix):
    from trainmesh.controller.preflight import preflight_problems

    try:
        spec = load_spec(None, ["runtime.device=cpu", *args])
    except SpecError as err:
        text = str(err)
    else:
        text = "; ".join(str(p) for p in preflight_problems(spec))
    assert field in text and fix in text, text


def test_a_replan_keeps_the_largest_ep_that_still_divides():
    """The re-plan after a node's loss or a resize (``replan_job``, through the planner's own
    choice of ep): a pinned ep is an upper bound, kept where it divides the new dp."""
    spec = load_spec(None, ["model.preset=tiny-moe", "parallelism.dp=4", "parallelism.ep=4",
                            "model.tie_embeddings=false", "runtime.device=cpu",
                            "training.global_batch_size=24", "training.microbatch_size=1"])
    got = {}
    for world in (4, 3, 2, 6, 8):
        dims = replan_job(spec, Topology.uniform(1, world, "cpu")).dims
        got[dims.dp] = dims.ep
    assert got == {4: 4, 3: 1, 2: 2, 6: 2, 8: 4}


@pytest.mark.parametrize("cp, tp", [(2, 2), (1, 2), (2, 1), (4, 2)])
def test_capacity_over_ranks_that_split_a_microbatch_is_decided_as_one_process_decides(cp, tp):
    """Each rank of a tp × cp token group holds its chunks of every sequence (context parallel's,
    as the data is read), then its tp share of them; from the group's gathered assignments
    (here the other ranks' parts, in any order) each keeps exactly what one process keeps of
    the whole microbatch at those places — weights tied in tenths, so places break ties."""
    from trainmesh.models.moe.moe import capacity_keys, keep_within_capacity
    from trainmesh.parallel.context import shard_sequence
    from trainmesh.parallel.expert import assignment_places, keep_over_token_group, token_positions

    args = MoEArgs(experts=4, top_k=2, expert_ffn_dim=8, capacity_factor=0.5)
    batch, seq_len, k = 2, 16, args.top_k
    g = torch.Generator().manual_seed(0)
    flat = torch.randint(0, args.experts, (batch * seq_len * k,), generator=g)
    weights = torch.rand(batch * seq_len * k, generator=g).mul(10).round().div(10)
    capacity = args.capacity(batch * seq_len)
    whole = keep_within_capacity(flat, weights, capacity, args.experts)
    assert 0 < int((~whole).sum()) < whole.numel()
    for e in range(args.experts):  # the rule itself, by Python's sort
        mine = sorted((-weights[j].item(), j) for j in range(flat.numel()) if flat[j] == e)
        assert {j for _, j in mine[:capacity]} == {j for j in range(flat.numel()) if flat[j] == e and whole[j]}
    ranks = [(c, t) for c in range(cp) for t in range(tp)]
    places = {}
    for c, t in ranks:
        positions = token_positions(seq_len, c, cp, t, tp)
        held = shard_sequence(torch.arange(seq_len)[None], c, cp)[0] if cp > 1 else torch.arange(seq_len)
        assert torch.equal(positions, held.chunk(tp)[t])  # where the data path puts its tokens
        places[c, t] = assignment_places(positions, seq_len, batch * positions.numel(), k)
    assert sorted(torch.cat(list(places.values())).tolist()) == list(range(flat.numel()))
    gathered = list(reversed(ranks))  # the all-gather's order: any
    every_place = torch.cat([places[q] for q in gathered])
    every_key = torch.cat([capacity_keys(flat[places[q]], weights[places[q]]) for q in gathered])
    for r in ranks:
        kept = keep_over_token_group(flat[places[r]], weights[places[r]], places[r], every_place,
                                     args, lambda mine: every_key)
        assert torch.equal(kept, whole[places[r]]), r


def test_the_dispatch_relays_where_an_ep_group_spans_nodes_of_equal_counts():
    """ep_dispatch auto relays an EP group that spans nodes each holding as many of its ranks,
    for top_k > 1 and whole exchanges; direct otherwise; never on nodes of unequal counts."""
    from trainmesh.spec.mesh_rules import relays

    two_nodes = (0, 0, 1, 1)
    assert relays("auto", two_nodes, 2, False)
    assert not relays("auto", (0, 0, 0, 0), 2, False)  # one node: nothing to save
    assert not relays("auto", two_nodes, 1, False)  # a token reaches one expert anyway
    assert not relays("auto", two_nodes, 2, True)  # the halves' exchanges are direct
    assert not relays("auto", (0, 0, 1), 2, False)  # unequal: direct
    assert relays("relay", (0, 0, 0, 0), 1, False) and not relays("direct", two_nodes, 2, False)
    assert not relays("relay", (0, 0, 1), 2, False)  # (refused by validation: test_spec_...)


@pytest.mark.parametrize("pp, dp, cp, tp, ep", [(1, 4, 1, 1, 2), (2, 4, 1, 2, 4), (1, 2, 2, 2, 4),
                                                (2, 4, 2, 1, 2)])
def test_ep_groups_are_the_meshs_expert_parallel_groups(pp, dp, cp, tp, ep):
    """Every EP group (``mesh_rules.ep_groups``: what the relay's refusal checks) is ep ranks of
    one stage and one tp coordinate at consecutive (dp, cp) positions, in that order, the
    groups covering every rank once, as ``parallel/mesh.py`` folds ep over dp × cp."""
    from trainmesh.parallel.dims import Axis, ParallelDims
    from trainmesh.spec.mesh_rules import ep_groups

    dims = ParallelDims(pp=pp, dp=dp, cp=cp, tp=tp, ep=ep)
    groups = ep_groups(pp, dp, cp, tp, ep)
    assert sorted(g for group in groups for g in group) == list(range(dims.world_size))
    for group in groups:
        coords = [dims.coords(g) for g in group]
        assert len({(c[Axis.PP], c[Axis.TP]) for c in coords}) == 1
        positions = [c[Axis.DP] * cp + c[Axis.CP] for c in coords]
        assert positions == list(range(positions[0], positions[0] + ep)) and positions[0] % ep == 0
