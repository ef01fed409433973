"""The planner: brute force agreement, properties, sanity against published layouts."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from types import SimpleNamespace

import pytest
from tiers import full

from trainmesh.cli.loading import load_spec
from trainmesh.cli.main import main
from trainmesh.planning import candidate, cost_model, memory_model, stage_params
from trainmesh.planning.devices import device_spec
from trainmesh.planning.explain import explain
from trainmesh.planning.job_plan import PlanError, effective_spec, plan_job, request_for
from trainmesh.planning.planner import MEMORY_HEADROOM, PlanRequest, plan
from trainmesh.planning.topology import Node, Topology, topology_from_nodes


def _model(preset, **kw):
    return load_spec(None, [f"model.preset={preset}", *(f"model.{k}={v}" for k, v in kw.items())]).model


def _brute_force_best(req: PlanRequest, topo: Topology) -> float:
    """Every tuple of degrees and options, filtered only by the documented rules: tp divides
    a node's accelerators and the vocabulary, tp × pp × dp whole TP groups fit the nodes (the
    rest idle), a tied head neither tensor- nor pipeline-parallel, DDP (every shard group one
    replica) only for a dense model without tp or pp."""
    m, world = req.model, topo.world_size
    limit = topo.device.memory_gib * MEMORY_HEADROOM * 1024**3
    best = (0, 0.0)  # (ranks used, tokens/s): every usable accelerator first, then speed
    for tp, pp, dp, vpp, mbs, sched, rc, keep, ddp in itertools.product(
            range(1, world + 1), range(1, world + 1), range(1, world + 1), (1, 2, 4), (1, 2, 4, 8),
            candidate.AUTO_SCHEDULES, candidate.RECOMPUTE, (True, False), (False, True)):
        groups = sum(n.accelerators // tp for n in topo.nodes)
        rules = [m.n_heads % tp == 0, m.n_kv_heads % tp == 0, topo.largest_node % tp == 0,
                 m.vocab_size % tp == 0,
                 pp * dp <= groups, m.n_layers % (pp * vpp) == 0,
                 req.global_batch_size % mbs == 0, dp <= req.global_batch_size // mbs,
                 (vpp > 1) == (sched == "interleaved-1f1b"), pp > 1 or sched == "1f1b",
                 pp > 1 or vpp == 1, not m.tie_embeddings or tp == pp == 1,
                 not ddp or (tp == pp == 1 < dp and getattr(m, "moe", None) is None)]
        if not all(rules):
            continue
        # Any dp: every replica runs the largest share of the microbatches, the rest padding.
        micro = req.global_batch_size // mbs
        share = -(-micro // dp)
        if pp > 1 and share < pp:
            continue
        n = share
        if -(-micro // n) < dp:  # fewer replicas would run as many each: these only pad
            continue
        c = candidate.Candidate(tp, pp, dp, vpp, sched, mbs, n, rc, tp > 1, keep, padding=n * dp - micro,
                                 dp_replicate=dp if ddp else 1)
        fused = memory_model.uses_fused_kernels(req.kernels, topo.device.name)
        if memory_model.memory_bytes(m, c, req.seq_len, req.compute_bytes,
                                   topo.device.framework_gib * 1024**3, fused) > limit:
            continue
        first_node = min(topo.largest_node // tp * tp, tp * pp * dp)
        est = cost_model.estimate(m, c, req.seq_len, topo.device, first_node, req.compute_bytes,
                                  fused)
        best = max(best, (tp * pp * dp, est.tokens_per_s))
    return best[1]


@pytest.mark.parametrize(("preset", "nodes", "per_node", "device", "batch", "seq"), [
    ("tiny", 1, 4, "cpu", 16, 64), ("small", 2, 4, "l40s", 32, 512),
    ("1b", 2, 4, "a100-40gb", 64, 2048), ("8b", 2, 8, "h100", 64, 4096),
    ("8b", 1, 8, "a100-40gb", 32, 4096), ("small", 3, 4, "l40s", 24, 512),
    ("small", 0, 0, "l40s", 20, 512)])
def test_planner_matches_brute_force(preset, nodes, per_node, device, batch, seq):
    """(nodes = 0: a heterogeneous cluster of 3, 4 and 6 accelerators.)"""
    req = PlanRequest(_model(preset), batch, seq)
    topo = Topology.uniform(nodes, per_node, device) if nodes else Topology(
        tuple(Node(f"n{i}", k) for i, k in enumerate((3, 4, 6))), device_spec(device))
    result = plan(req, topo)
    assert result.plans
    assert result.best.estimate.tokens_per_s == pytest.approx(_brute_force_best(req, topo))


@pytest.mark.parametrize(("preset", "nodes", "per_node", "device"), [
    ("8b", 2, 8, "a100-40gb"), ("70b", 4, 8, "h100"), ("1b", 3, 4, "l40s")])
def test_plan_properties(preset, nodes, per_node, device):
    topo = Topology.uniform(nodes, per_node, device)
    model = _model(preset)
    result = plan(PlanRequest(model, 96, 4096), topo)
    limit = topo.device.memory_gib * MEMORY_HEADROOM
    for p in result.plans:
        c = p.candidate
        assert c.world_size + p.idle == topo.world_size and sum(p.node_ranks) == c.world_size
        assert all(n % c.tp == 0 for n in p.node_ranks) and per_node % c.tp == 0
        assert p.estimate.memory_per_rank_gib <= limit
        # the whole batch, each replica's share padded to the same count, and no replica
        # that only pads: fewer would not run fewer microbatches each
        micro = 96 // c.microbatch_size
        assert c.dp * c.num_microbatches - c.padding == micro
        assert 0 <= c.padding < c.dp
        assert -(-micro // c.num_microbatches) == c.dp
        assert not model.tie_embeddings or c.tp == c.pp == 1  # 1b: tied
    assert result.rejected
    for r in result.rejected:
        assert r.reason.split(":")[0] in {"memory", "divisibility", "topology", "tied embeddings"}, r.reason
    order = [(p.idle, -p.estimate.tokens_per_s) for p in result.plans]
    assert order == sorted(order)


def _ratio_of(result, tp, pp, dp):
    best = result.best.estimate.tokens_per_s
    mine = [p.estimate.tokens_per_s for p in result.plans
            if (p.candidate.tp, p.candidate.pp, p.candidate.dp) == (tp, pp, dp)]
    assert mine, f"tp={tp} pp={pp} dp={dp} was not even feasible"
    return max(mine) / best


def test_llama70b_on_1024_h100_ranks_8_8_16_near_the_top():
    req = PlanRequest(_model("70b"), 1024, 8192)
    result = plan(req, Topology.uniform(128, 8, "h100"))
    assert _ratio_of(result, 8, 8, 16) >= 0.9


def test_gpt3_175b_on_1024_a100_ranks_8_16_8_near_the_top():
    gpt3 = SimpleNamespace(dim=12288, n_layers=96, n_heads=96, n_kv_heads=96, ffn_dim=49152,
                           vocab_size=50304, tie_embeddings=False)  # 50257 padded, as Megatron does
    result = plan(PlanRequest(gpt3, 1536, 2048), Topology.uniform(128, 8, "a100-80gb"))
    assert _ratio_of(result, 8, 16, 8) >= 0.9


def test_interleaving_divides_the_bubble():
    one = candidate.bubble_fraction("1f1b", 4, 1, 8)
    assert one == pytest.approx(3 / 11)
    inter = candidate.bubble_fraction("interleaved-1f1b", 4, 2, 8)
    assert inter == pytest.approx(1.5 / 9.5)
    assert candidate.bubble_fraction("1f1b", 1, 1, 8) == 0


def test_the_first_plans_are_priced_stage_by_stage_and_ordered_as_if_all_were():
    """A search prices every candidate at the least its pipeline stages allow (each stage at
    its own cost: its blocks, the head on the last; no simulator play), then the first ones
    with the simulator playing the schedule: the first (PRICED_FIRST), and a table's rows on
    asking (``first``), in the order pricing every candidate so would give. The play is
    never faster than the bound."""
    from trainmesh.planning.planner import PRICED_FIRST, _order

    for spec, nodes in ((load_spec(None, ["model.preset=8b", "model.n_layers=30", "parallelism=auto",
                                          "training.seq_len=4096", "training.global_batch_size=256"]), 4),
                        (load_spec("jobs/llama-70b.yaml", ["parallelism=auto"]), 4)):
        result = plan(request_for(spec), Topology.uniform(nodes, 8, "h100"))
        assert all(p.estimate.by_stage for p in result.plans[:PRICED_FIRST])
        first = result.first(10)
        assert all(p.estimate.by_stage for p in first)
        assert any(p.candidate.pp > 1 for p in first)
        everything = sorted((result.priced(p) for p in result.plans), key=_order)
        assert [p.candidate for p in everything[:10]] == [p.candidate for p in first]
        assert everything[0].candidate == result.best.candidate
        assert [p.candidate for p in result.first(25)] == [p.candidate for p in everything[:25]]
        # (stages alike are no bound: DeepSeek-V3 split by cost over 4 interleaved stages
        # plays shorter than the closed form; the bound used is below both)
        from trainmesh.models.llama.model_math import cost_split, stage_flops

        dsv3 = _model("deepseek-v3-671b")
        costs = stage_flops(dsv3, 4096, 4, cost_split(dsv3, 4096, 4))
        played = candidate.bubble_fraction("interleaved-1f1b", 2, 2, 4, costs)
        assert played < candidate.bubble_fraction("interleaved-1f1b", 2, 2, 4)
        assert candidate.bubble_fraction("interleaved-1f1b", 2, 2, 4, costs, bound=True) <= played
        for p in result.plans[:60]:
            bound = cost_model.estimate(spec.model, p.candidate, spec.training.seq_len,
                                        device_spec("h100"), p.node_ranks[0],
                                        memory=p.estimate.memory_per_rank_gib * 1024**3, by_stage=False)
            assert result.priced(p).estimate.step_time_s >= bound.step_time_s * (1 - 1e-12)


def test_pinned_stage_layers_are_planned_priced_and_explained_as_pinned():
    """``parallelism.stage_layers`` with ``parallelism: auto``: only layouts of that many
    stages are planned, and each is priced with the pinned blocks: the stage holding more
    holds more memory, its rank paces the pipeline (slower than the even split), and the
    explanation names the split as pinned."""
    split = [6, 10, 8, 8]
    spec = load_spec(None, ["model.preset=8b", "parallelism=auto", "training.seq_len=4096",
                            "training.global_batch_size=64", f"parallelism.stage_layers={split}"])
    result = plan(request_for(spec), Topology.uniform(4, 8, "h100"))
    assert result.plans and all(p.candidate.pp * p.candidate.vpp == 4 for p in result.plans)
    best = result.best
    c = best.candidate
    assert c.stage_layers == tuple(split) and c.pp > 1
    even = dataclasses.replace(c, stage_layers=None)
    h100 = device_spec("h100")
    pinned = cost_model.estimate(spec.model, c, 4096, h100, best.node_ranks[0])
    alike = cost_model.estimate(spec.model, even, 4096, h100, best.node_ranks[0])
    assert pinned.step_time_s > alike.step_time_s
    heavier = 1 % c.pp  # (10 blocks: the second stage, on rank 1 mod pp)
    assert (memory_model.rank_memory(spec.model, c, 4096, heavier).params
            > memory_model.rank_memory(spec.model, even, 4096, heavier).params)
    assert "as pinned (parallelism.stage_layers)" in explain(result)
    assert any("stage_layers" in r.reason for r in result.rejected)  # (other stage counts)


def test_a_chosen_pipeline_is_split_by_its_stages_cost():
    """Where the planner chooses the pipeline, the blocks are split by their cost: the head
    (and multi-token modules) make the last stage the costliest at an even split, so it gives
    a block away (70B at 16 stages: 5 blocks a stage, the last 4); DeepSeek-V3's 61 blocks
    over 16 stages end on a last stage of 2 with its MTP module. The slowest stage is then
    cheaper, the plan writes the split into the spec the ranks build from and explains it;
    a pipeline the user pinned keeps the even split, and a split already even stays None."""
    from trainmesh.models.llama.model_math import cost_split, stage_flops, stage_split
    from trainmesh.planning.job_plan import effective_spec

    for preset, k in (("70b", 16), ("deepseek-v3-671b", 16), ("8b", 4), ("70b", 32)):
        m = _model(preset)
        split = cost_split(m, 4096, k)
        assert sum(split) == m.n_layers and min(split) >= 1 and len(split) == k
        even = stage_split(m.n_layers, k)
        assert split != tuple(even), preset
        assert max(stage_flops(m, 4096, k, split)) < max(stage_flops(m, 4096, k)), preset
    assert cost_split(_model("70b"), 4096, 16)[-1] == 4
    assert cost_split(_model("deepseek-v3-671b"), 4096, 16)[-1] == 2

    spec = load_spec("jobs/llama-70b.yaml", ["parallelism=auto"])
    result = plan(request_for(spec), Topology.uniform(128, 8, "h100"))
    c = result.best.candidate
    assert c.pp > 1 and c.stage_layers == cost_split(spec.model, spec.training.seq_len, c.pp * c.vpp)
    assert effective_spec(spec, c).parallelism.stage_layers == list(c.stage_layers)
    assert "split by their cost" in explain(result)
    pinned = load_spec("jobs/llama-70b.yaml", [])  # (its pipeline pinned)
    kept = plan(request_for(pinned), Topology.uniform(128, 8, "h100")).best.candidate
    assert kept.pp > 1 and kept.stage_layers is None


def test_a_candidate_over_memory_is_rejected_at_its_first_rank_over_and_reported_exactly():
    """The search stops pricing a candidate's ranks at the first over the device
    (``memory_over``): its rejection holds that rank's bytes as a bound and makes its text —
    the heaviest rank's bytes, as pricing every rank gives — when read; the summary's closest
    candidate for memory is the one whose heaviest rank holds least, as if all were priced."""
    from trainmesh.planning.memory_model import memory_bytes, memory_over, uses_fused_kernels
    from trainmesh.planning.planner import _closest_for_memory, gib_apart, summarize_rejections

    spec = load_spec(None, ["model.preset=70b", "parallelism=auto", "training.seq_len=8192",
                            "training.global_batch_size=512"])
    req, topo = request_for(spec), Topology.uniform(8, 8, "h100")
    result = plan(req, topo)
    limit = topo.device.memory_gib * MEMORY_HEADROOM * 1024**3
    framework = topo.device.framework_gib * 1024**3
    fused = uses_fused_kernels(req.kernels, "h100", req.compiled)
    over = [r for r in result.rejected if r.at_least > 0]
    assert len(over) > 100
    exact = {}
    for r in over:
        full = memory_bytes(req.model, r.candidate, req.seq_len, req.compute_bytes, framework,
                            fused)
        assert full >= r.at_least > limit
        assert memory_over(req.model, r.candidate, req.seq_len, req.compute_bytes, framework,
                           fused, limit) == (r.at_least, True)
        assert r.reason.startswith(f"memory: {gib_apart(full, limit)[0]} GiB per rank exceeds"), r.reason
        exact[id(r)] = full
    memory = [r for r in result.rejected if r.reason.startswith("memory")]
    closest = _closest_for_memory(memory)
    assert exact.get(id(closest), float(closest.reason.split()[1]) * 1024**3) <= min(
        exact.values()) + 0.01 * 1024**3
    assert closest.reason in summarize_rejections(result.rejected)
    for p in result.plans[:20]:  # a plan's memory: every rank priced
        mem, exceeded = memory_over(req.model, p.candidate, req.seq_len, req.compute_bytes,
                                    framework, fused, limit)
        assert not exceeded
        assert mem == pytest.approx(p.estimate.memory_per_rank_gib * 1024**3)


def test_explicit_infeasible_degrees_say_why():
    spec = load_spec(None, ["model.preset=70b", "parallelism.dp=8", "training.seq_len=4096",
                            "training.global_batch_size=64", "training.microbatch_size=8"])
    with pytest.raises(PlanError, match="memory"):
        plan_job(spec, Topology.uniform(1, 8, "h100"))
    with pytest.raises(PlanError, match="16 accelerators"):
        plan_job(load_spec(None, ["parallelism.dp=32", "training.global_batch_size=64"]),
                 Topology.uniform(2, 8, "cpu"))


def test_explain_names_the_winner_and_rejections():
    result = plan(PlanRequest(_model("8b"), 64, 4096), Topology.uniform(2, 8, "h100"))
    text = explain(result)
    c = result.best.candidate
    assert f"tp={c.tp} × pp={c.pp} × dp={c.dp}" in text and "Rejected:" in text


def test_topology_from_ray_node_records():
    nodes = [{"NodeID": "h", "Alive": True, "Resources": {"CPU": 2}},
             {"NodeID": "a", "Alive": True,
              "Resources": {"CPU": 16, "GPU": 8, "accelerator_type:H100": 1}},
             {"NodeID": "b", "Alive": False, "Resources": {"CPU": 16, "GPU": 8}},
             {"NodeID": "c", "Alive": True, "Resources": {"CPU": 16, "GPU": 4}}]
    topo = topology_from_nodes(nodes, None)
    assert [(n.node_id, n.accelerators) for n in topo.nodes] == [("a", 8), ("c", 4)]
    assert topo.device.name == "h100" and topo.per_node == 4
    cpu = topology_from_nodes(nodes, "cpu", cpus_per_rank=2)
    assert [n.accelerators for n in cpu.nodes] == [1, 8, 8]


def test_plan_cli_json_and_table(capsys):
    assert main(["plan", "jobs/llama-70b.yaml", "--set", "parallelism=auto", "--nodes", "16",
                 "--gpus-per-node", "8", "--device", "h100", "--top", "3", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    keys = {"tp", "pp", "dp", "vpp", "schedule", "microbatch_size", "num_microbatches",
            "recompute", "memory_per_rank_gib", "step_time_s", "tokens_per_s",
            "tflops_per_gpu", "mfu", "bubble_fraction"}
    assert len(rows) == 3 and all(keys <= set(r) for r in rows)
    assert [r["tokens_per_s"] for r in rows] == sorted((r["tokens_per_s"] for r in rows),
                                                       reverse=True)
    assert all(r["tp"] * r["pp"] * r["dp"] == 128 for r in rows)
    assert main(["plan", "jobs/llama-70b.yaml", "--set", "parallelism=auto", "--nodes", "16",
                 "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "MFU" in out and "is predicted fastest" in out
    header = next(line for line in out.splitlines() if "recompute" in line)
    assert "zero3" in header  # the ZeRO-3 policy of each plan, keep or regather
    assert any(" keep " in line or " regather " in line for line in out.splitlines())


def test_spec_topology_overrides_change_the_plan(capsys):
    args = ["plan", "jobs/llama-70b.yaml", "--set", "parallelism=auto", "--nodes", "16",
            "--json", "--top", "1"]
    assert main(args) == 0
    base = json.loads(capsys.readouterr().out)[0]
    assert main([*args, "--set", "topology.peak_tflops=1978"]) == 0
    faster = json.loads(capsys.readouterr().out)[0]
    assert faster["tokens_per_s"] > 1.5 * base["tokens_per_s"]
    assert main([*args, "--set", "topology.memory_gib=4"]) == 2  # nothing fits in 4 GiB
    assert "memory" in capsys.readouterr().err


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"])
def test_in_flight_chunks_are_what_the_schedule_simulator_holds(schedule):
    """The cost model's closed form for activations held per pipeline rank = the peak the
    simulator finds running the very action lists the executor runs."""
    from trainmesh.parallel.pipeline.schedules import build_schedule
    from trainmesh.parallel.pipeline.simulate import simulate

    for pp, vpp, m in itertools.product((2, 3, 4), (1, 2, 3), (4, 5, 6, 7, 8, 9, 12)):
        v = vpp if schedule == "interleaved-1f1b" else 1
        if (schedule == "interleaved-1f1b") != (vpp > 1) or m < pp:  # any m ≥ pp interleaves
            continue
        peaks = simulate(build_schedule(schedule, pp, v, m), pp * v, m).peak_in_flight
        assert peaks == [candidate.in_flight_chunks(schedule, pp, v, m, r) for r in range(pp)]


def test_the_plan_reaches_the_runtime_through_the_effective_spec():
    """What the planner decided about memory and time is what the ranks build: sharding
    policy, reduce dtype and recomputation; what the user pinned is kept."""
    from trainmesh.planning.job_plan import effective_spec

    topo = Topology.uniform(1, 4, "cpu")
    spec = load_spec(None, ["parallelism.dp=4", "parallelism.keep_gathered=false",
                            "parallelism.reduce_dtype=bfloat16", "activation_checkpoint.mode=full"])
    _, result = plan_job(spec, topo)
    c = result.best.candidate
    assert (c.keep_gathered, c.reduce_dtype, c.recompute) == (False, "bfloat16", "full")
    eff = effective_spec(spec, c)
    assert eff.parallelism.keep_gathered is False and eff.parallelism.reduce_dtype == "bfloat16"
    assert eff.activation_checkpoint.mode == "full"
    auto = load_spec(None, ["parallelism=auto", "activation_checkpoint.mode=full"])
    _, result = plan_job(auto, topo)
    eff = effective_spec(auto, result.best.candidate)
    assert eff.parallelism.keep_gathered == result.best.candidate.keep_gathered
    assert eff.activation_checkpoint.mode == result.best.candidate.recompute


def test_keeping_parameters_gathered_costs_the_stage_unsharded():
    """keep_gathered holds the rank's whole part gathered plus its unsharded gradients;
    resharding holds two blocks (plus the root) — the memory the runtime's choice implies."""
    m = _model("8b")
    keep = candidate.Candidate(1, 1, 8, 1, "1f1b", 1, 4, "none", False, True)
    reshard = candidate.Candidate(1, 1, 8, 1, "1f1b", 1, 4, "none", False, False)
    a = memory_model.rank_memory(m, keep, 4096)
    b = memory_model.rank_memory(m, reshard, 4096)
    n = stage_params.rank_params(m, 1, 0).gathered(1)
    layer = stage_params.layer_params(m)
    assert a.gathered == pytest.approx(2 * n) and a.grads == pytest.approx(4 * n + 2 * layer)
    assert b.gathered < 0.2 * a.gathered and b.grads < 0.2 * a.grads
    assert a.params == b.params == pytest.approx(4 * n / 8)


def _replan(spec_args, nodes, per_node=8, device="h100"):
    from trainmesh.planning.job_plan import replan_job

    spec = load_spec("jobs/llama-70b.yaml", spec_args)
    return replan_job(spec, Topology.uniform(nodes, per_node, device))


@pytest.mark.parametrize("nodes", [127, 120])
def test_70b_on_a_shrunk_cluster_uses_every_replica_it_holds(nodes, capsys):
    """1 or 8 of 128 nodes lost: dp need not divide the global batch of 1024 microbatches, so
    the pinned tp 8 × pp 8 keeps the 15 replicas the nodes hold (960 GPUs, not 512): 69 or 68
    microbatches each (interleaved 1F1B in groups of 8 or 9), all run as 69, the 11 missing
    padding, which the explanation counts."""
    args = ["plan", "jobs/llama-70b.yaml", "--set", "parallelism=auto", "--nodes", str(nodes),
            "--gpus-per-node", "8", "--json", "--top", "50"]
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(r["world_size"] + r["idle"] == nodes * 8 for r in rows)
    assert rows[0]["world_size"] >= 960
    # The job's pinned layout after the loss: tp and pp kept, only dp changed.
    new = _replan([], nodes)
    c = new.result.best.candidate
    assert (c.tp, c.pp, c.vpp, c.schedule) == (8, 8, 2, "interleaved-1f1b") and new.changed is None
    assert c.dp == 15 and new.result.best.idle == nodes * 8 - 960
    assert (c.num_microbatches, c.padding) == (69, 69 * 15 - 1024)
    assert new.spec.parallelism.dp == 15 and new.spec.training.global_batch_size == 1024
    text = explain(new.result)
    assert f"{69 * 15 - 1024} of them padding of weight 0" in text
    if nodes == 127:
        assert "leaves 56 accelerator(s) idle" in text
    # What the padding costs is in the estimate: tokens/s counts the batch's tokens only.
    e = new.result.best.estimate
    assert e.tokens_per_s == pytest.approx(1024 * 8192 / e.step_time_s)


def test_replan_changes_pinned_degrees_only_when_they_no_longer_fit():
    new = _replan(["model.preset=8b", "parallelism.pp=2", "parallelism.vpp=1",
                   "schedule.name=1f1b", "parallelism.dp=4", "training.seq_len=2048",
                   "elastic.min_world_size=1"], nodes=1, per_node=4)
    c = new.result.best.candidate
    assert c.tp != 8 and new.changed is not None
    assert "tp=8, pp=2" in new.changed and f"re-planned to tp={c.tp}" in new.changed
    with pytest.raises(PlanError, match="elastic.min_world_size"):
        _replan(["model.preset=8b", "training.seq_len=2048"], nodes=40)  # 320 < 512


def test_tp_always_divides_the_node():
    """The Megatron 145.6B shape on 192 nodes of 8 A100: no ranked plan has tp = 3 or 6
    (a TP group would straddle two nodes)."""
    m = SimpleNamespace(dim=12288, n_layers=80, n_heads=96, n_kv_heads=96, ffn_dim=49152,
                        vocab_size=51200, tie_embeddings=False)
    result = plan(PlanRequest(m, 1536, 2048), Topology.uniform(192, 8, "a100-80gb"))
    assert result.plans and {p.candidate.tp for p in result.plans} <= {1, 2, 4, 8}
    pinned = plan(PlanRequest(m, 1536, 2048, fixed={"tp": 6}), Topology.uniform(192, 8, "a100-80gb"))
    assert not pinned.plans and "does not divide the 8 accelerators" in pinned.rejected[0].reason


def test_heterogeneous_nodes_are_planned_around_not_capping_every_node():
    """A head with 1 CPU and two nodes with 4: tp=2 runs on the two big nodes; the head is a
    spare rather than the limit for every node."""
    topo = Topology((Node("head", 1), Node("a", 4), Node("b", 4)), device_spec("cpu"))
    spec = load_spec(None, ["parallelism.tp=2", "parallelism.dp=4"])
    dims, result = plan_job(spec, topo)
    assert (dims.tp, dims.dp) == (2, 4) and result.best.node_ranks == (4, 4)
    assert result.best.idle == 1
    from trainmesh.controller.ray_group import placement_for

    placement = placement_for(spec, dims, topo)
    assert [b["CPU"] for b in placement.bundles] == [4.0, 4.0]
    odd = Topology((Node("a", 2), Node("b", 1), Node("c", 1)), device_spec("cpu"))
    with pytest.raises(PlanError, match="dp=2 needs more than the 1 replicas"):  # 4 of 4, but
        plan_job(load_spec(None, ["parallelism.tp=2", "parallelism.dp=2"]), odd)  # 1+1 split


def test_moe_memory_counts_experts_over_ep_and_their_shards_over_dp():
    """ZeRO-3 shards every MoE parameter over dp (experts over ep, then the replicas of each);
    a rank gathers all of a block's router and shared expert but only its ep's experts, and
    tensor parallel does not split an MoE block."""
    from trainmesh.models.llama.model_math import num_params

    m = _model("tiny-moe", **{"moe.shared_experts": 1})
    rp = stage_params.rank_params(m, 1, 0)
    assert rp.local(1, 1) == num_params(m)
    experts = m.n_layers * m.moe.experts * 3 * m.dim * m.moe.expert_ffn_dim
    assert rp.experts == experts
    assert rp.gathered(2, 4) == pytest.approx(rp.tp_sharded / 2 + rp.replicated + experts / 4)
    assert rp.local(2, 4) == pytest.approx((rp.tp_sharded / 2 + rp.replicated + experts) / 4)


def test_moe_plans_choose_ep_and_price_the_all_to_all():
    spec = load_spec(None, ["model.preset=mixtral-8x7b", "parallelism=auto",
                            "training.global_batch_size=256", "training.seq_len=4096",
                            "training.dtype=bfloat16"])
    topo = Topology.uniform(8, 8, "h100")
    dims, result = plan_job(spec, topo)
    assert {p.candidate.ep for p in result.plans} >= {1, 2, 4, 8}
    assert dims.dp % dims.ep == 0 and 8 % dims.ep == 0
    by_ep = {ep: cost_model.estimate(spec.model, candidate.Candidate(
        2, 4, 8, 1, "1f1b", 1, 32, "full", True, True, "float32", ep, ep_overlap=False), 4096,
        device_spec("h100"), 8, 2) for ep in (1, 2, 4, 8)}
    assert by_ep[1].ep_comm_s == 0 < by_ep[2].ep_comm_s
    # ep 8 with tp 2 spans two nodes: its all-to-all crosses the slower links. (Less each
    # message's latency: 6 exchanges per block and microbatch under full recompute, 8 blocks
    # a stage, 32 microbatches.)
    latency = cost_model.PP_LATENCY_S * 6 * 8 * 32
    per_rank = {ep: (by_ep[ep].ep_comm_s - latency) / ((ep - 1) / ep) for ep in (2, 4, 8)}
    assert per_rank[8] > 2 * per_rank[4] and per_rank[4] == pytest.approx(per_rank[2])
    # fewer experts per rank: less gathered memory
    assert by_ep[8].memory_per_rank_gib < by_ep[2].memory_per_rank_gib


def test_the_all_to_alls_in_halves_are_priced_and_explained_but_left_as_the_spec_says():
    """parallelism.ep_overlap: the planner prices what the halves hide (behind the experts and
    the shared expert) and what they add (the first way out and the last ways back exposed, a
    message's latency per half, the experts' part of each block issued twice); `trainmesh
    plan` says what they would gain or cost, and only a spec that sets it gets it."""
    def priced(tp: int, seq_len: int, overlap: bool, ep: int = 8):
        spec = load_spec(None, ["model.preset=mixtral-8x7b", f"training.seq_len={seq_len}"])
        return cost_model.estimate(spec.model, candidate.Candidate(
            tp, 4, 8, 1, "1f1b", 1, 32, "none", False, True, "float32", ep, ep_overlap=overlap,
            ep_dispatch="direct"), seq_len, device_spec("h100"), 8, 2)

    # ep 8 × tp 2 spans two nodes: long messages over the slower links hide behind the experts
    # (whole, the copies sent directly: the relay's own test is below)
    whole, halves = priced(2, 4096, False), priced(2, 4096, True)
    assert halves.ep_comm_s < whole.ep_comm_s
    # ... not all: the first way out and backward's two last exchanges stay (3 of 8 halves)
    assert halves.ep_comm_s >= 3 / 8 * whole.ep_comm_s
    assert halves.compute_s > whole.compute_s  # (the experts' part issued twice)
    assert halves.ep_overlap and not whole.ep_overlap
    assert whole.ep_overlap_gain_s == halves.ep_overlap_gain_s > 0
    assert halves.step_time_s == pytest.approx(whole.step_time_s - whole.ep_overlap_gain_s)
    # short messages, a host-bound step: the halves cost more than they hide
    short = priced(2, 16, True), priced(2, 16, False)
    assert short[0].step_time_s > short[1].step_time_s and short[1].ep_overlap_gain_s < 0
    one = priced(2, 4096, True, ep=1)
    assert one.ep_comm_s == 0 and not one.ep_overlap and one.ep_overlap_gain_s == 0

    base = ["model.preset=mixtral-8x7b", "parallelism=auto", "training.global_batch_size=256",
            "training.seq_len=4096", "training.dtype=bfloat16"]
    topo = Topology.uniform(8, 8, "h100")
    spec = load_spec(None, base)
    _, result = plan_job(spec, topo)
    best = result.best
    assert best.candidate.ep > 1 and not any(p.candidate.ep_overlap for p in result.plans)
    assert effective_spec(spec, best.candidate).parallelism.ep_overlap is False
    said = explain(result)
    assert ("would hide behind the experts" in said) == (best.estimate.ep_overlap_gain_s > 0)
    assert ("would take" in said) == (best.estimate.ep_overlap_gain_s <= 0)
    on = load_spec(None, [*base, "parallelism.ep_overlap=true"])
    _, chosen = plan_job(on, topo)
    assert all(p.candidate.ep_overlap == (p.candidate.ep > 1) for p in chosen.plans)
    assert effective_spec(on, chosen.best.candidate).parallelism.ep_overlap is True
    assert "in two halves, parallelism.ep_overlap: the step" in explain(chosen)


def test_moe_capacity_under_tp_is_priced_and_planned_for_a_whole_microbatch():
    """Capacity decided over the whole microbatch: its tp ranks' all-gather of the assignments
    is in the MoE exchanges' time (none at tp 1), and experts' activations are planned for one
    tp rank's share holding the whole capacity (tp × capacity_factor, at most experts / top_k)."""
    def ep_comm(tp: int, capacity: str) -> float:
        spec = load_spec(None, ["model.preset=mixtral-8x7b", "training.seq_len=4096",
                                f"model.moe.capacity_factor={capacity}"])
        return cost_model.estimate(spec.model, candidate.Candidate(
            tp, 4, 8, 1, "1f1b", 1, 32, "full", True, True, "float32", 2), 4096,
            device_spec("h100"), 8, 2).ep_comm_s

    gather = ep_comm(2, "1.25") - ep_comm(2, "null")
    # 4096 tokens × top-2 × 8 bytes, half from the peer, forward and its recompute, over the
    # 32 blocks / pp 4 and 32 microbatches, at the node's links
    expected = 2 * 4096 * 2 * 8 / 2 / (device_spec("h100").intra_node_gbps * 1e9) * 8 * 32
    assert gather == pytest.approx(expected) and ep_comm(1, "1.25") == ep_comm(1, "null")
    moe = load_spec(None, ["model.preset=mixtral-8x7b", "model.moe.capacity_factor=0.5"]).model
    units = {tp: memory_model.moe_activation_units(moe, ep=2, tp=tp) for tp in (1, 2, 8, 16)}
    routed = moe.moe.top_k * (2 + 4 * moe.moe.expert_ffn_dim / moe.dim)
    assert units[1] == pytest.approx(0.5 * routed) and units[2] == pytest.approx(1.0 * routed)
    assert units[8] == units[16] == pytest.approx(moe.moe.experts / moe.moe.top_k * routed)


def test_a_replan_after_a_node_loss_keeps_the_largest_ep_that_still_divides():
    from trainmesh.planning.job_plan import plan_for

    spec = load_spec(None, ["model.preset=tiny-moe", "parallelism.dp=4", "parallelism.ep=4",
                            "training.global_batch_size=8", "training.microbatch_size=1",
                            "training.seq_len=32"])
    new = plan_for(spec, Topology.uniform(1, 2, "cpu"), replan=True)
    assert (new.dims.dp, new.dims.ep) == (2, 2) and new.spec.parallelism.ep == 2
    new = plan_for(spec, Topology.uniform(1, 3, "cpu"), replan=True)  # dp 3: no ep divides it
    assert new.dims.dp in (1, 2, 3) and new.dims.ep in (1, 2) and new.dims.dp % new.dims.ep == 0


def test_at_16k_gpus_the_planner_chooses_hybrid_sharding_and_says_why(capsys):
    """ZeRO-3 over 512 replicas pays a ring of 512 per collective; shard groups of 8 replicas
    (8 nodes of tp-8 ranks) all-reduced across 64 groups are predicted faster for the memory
    they cost: the plan table shows it, the explanation gives both."""
    from trainmesh.planning.job_plan import request_for

    spec = load_spec("jobs/llama-70b.yaml", ["parallelism=auto", "training.global_batch_size=2048",
                                             "elastic.max_world_size=16384"])
    result = plan(request_for(spec), Topology.uniform(2048, 8, "h100"))
    c = result.best.candidate
    assert c.dp_replicate > 1 and c.dp_shard * c.tp == 64 and result.best.idle == 0
    flat = next(p for p in result.plans if p.candidate == dataclasses.replace(c, dp_replicate=1))
    assert flat.estimate.dp_exposed_s > result.best.estimate.dp_exposed_s
    assert flat.estimate.memory_per_rank_gib < result.best.estimate.memory_per_rank_gib
    text = explain(result)
    assert (f"It runs hybrid sharding {c.dp_replicate}×{c.dp_shard} (ZeRO-3 inside groups "
            f"of {c.dp_shard} replicas") in text and f"ZeRO-3 over all {c.dp} replicas" in text
    # On 8 nodes a shard group over all of dp stays within 8 nodes: no hybrid option.
    small = plan(request_for(spec), Topology.uniform(8, 8, "h100"))
    assert {p.candidate.dp_replicate for p in small.plans} == {1}
    from trainmesh.cli.plan import _print_table  # the table `trainmesh plan` prints

    _print_table(spec, Topology.uniform(2048, 8, "h100"), [p.as_row() for p in result.plans[:2]])
    out = capsys.readouterr().out
    assert "hsdp" in out and f"{c.dp_replicate}×{c.dp_shard}" in out


def test_a_sequence_that_fits_no_rank_is_planned_with_context_parallel():
    """Llama-3.1-8B at 131,072 tokens on 4 nodes of 8 H100: without context parallel only
    layouts that recompute fit (keeping a block's input for most layers), so the
    planner splits sequences over cp ranks, faster, and says so; the job's own tp 4 × dp 8
    without cp does not fit; shorter sequences are never split."""
    spec = load_spec("jobs/llama-8b-128k.yaml", ["parallelism=auto"])
    result = plan(request_for(spec), Topology.uniform(4, 8, "h100"))
    best = result.best.candidate
    assert best.cp > 1 and best.world_size == 32
    whole = [p for p in result.plans if p.candidate.cp == 1]
    assert whole and all(p.candidate.recompute != "none" for p in whole)
    assert whole[0].estimate.tokens_per_s < result.best.estimate.tokens_per_s
    assert "Context parallel splits each sequence over" in explain(result)
    pinned = load_spec("jobs/llama-8b-128k.yaml", ["parallelism.cp=1", "parallelism.dp=8"])
    assert not plan(request_for(pinned), Topology.uniform(4, 8, "h100")).plans
    # activations per rank: 1/cp of a whole sequence's
    c = dataclasses.replace(best, cp=1, dp=best.dp * best.cp)
    whole = memory_model.rank_memory(spec.model, c, 131072).activations
    assert memory_model.rank_memory(spec.model, best, 131072).activations == pytest.approx(
        whole / best.cp, rel=0.15)
    short = plan(request_for(load_spec("jobs/llama-70b.yaml", ["parallelism=auto"])),
                 Topology.uniform(16, 8, "h100"))
    assert short.plans and {p.candidate.cp for p in short.plans} == {1}


def test_a_replan_keeps_the_pinned_context_parallel_degree():
    """One of the 4 nodes of the long-context job lost: tp 4 × cp 4 still fit, dp drops."""
    spec = load_spec("jobs/llama-8b-128k.yaml", ["elastic.min_world_size=1"])
    from trainmesh.planning.job_plan import replan_job

    new = replan_job(spec, Topology.uniform(3, 8, "h100"))
    c = new.result.best.candidate
    assert (c.tp, c.cp, c.dp) == (4, 4, 1) and new.changed is None
    assert new.dims.cp == 4 and new.spec.parallelism.cp == 4


def test_ring_traffic_hides_behind_attention_at_long_sequences_only():
    """The ring's exposed time per step falls as the sequence grows (attention per block
    grows with its square, a block's transfer linearly); all-gather is never hidden."""
    m = load_spec(None, ["model.preset=8b"]).model
    dev = Topology.uniform(1, 8, "h100").device

    def exposed(seq: int, mode: str) -> float:
        c = candidate.Candidate(1, 1, 1, 1, "1f1b", 1, 1, "none", cp=8, cp_mode=mode)
        return cost_model.cp_exposed(m, c, seq, dev, 8, 2) / (seq / 8192)  # per 8K tokens
    assert exposed(131072, "ring") < exposed(16384, "ring")
    assert exposed(131072, "allgather") > exposed(131072, "ring")


def test_mla_context_parallel_is_priced_by_what_its_ring_moves():
    """DeepSeek-V3 over a cp 8 ring: moving each token's latent and rotary key (512 + 64
    values, whole on every tp rank) against its expanded keys and values (128 heads × 2 ×
    192, split by tp) — less ring traffic exposed, the latents' expansion priced beside it,
    fewer saved activations (no expanded keys and values kept) and the planner's spec
    carrying the choice; a split-backward schedule moves the expanded ones."""
    from trainmesh.planning import memory_model
    from trainmesh.planning.job_plan import effective_spec, request_for

    m = _model("deepseek-v3-671b")
    dev = Topology.uniform(1, 8, "h100").device
    seq = 32768

    def cand(latent: bool, tp: int = 1, schedule: str = "1f1b"):
        return candidate.Candidate(tp, 1, 1, 1, schedule, 1, 1, "none", cp=8, cp_latent=latent)

    part = seq // 8
    assert candidate.cp_moved(m, cand(True, tp=2), part) == part * 576
    assert candidate.cp_moved(m, cand(False, tp=2), part) == 2 * part * 128 * 192 / 2
    assert candidate.cp_moved(m, cand(True, schedule="zb-h1"), part) == 2 * part * 128 * 192
    assert candidate.latent_expansion_flops(m, cand(False), part) == 0
    assert candidate.latent_expansion_flops(m, cand(True), part) == 29 * 2 * part * 512 * 128 * 256
    assert candidate.latent_expansion_flops(m, cand(True), part, 2) == 36 * 2 * part * 512 * 128 * 256
    for mode in ("ring", "allgather"):
        latent, expanded = (dataclasses.replace(cand(x), cp_mode=mode) for x in (True, False))
        assert (cost_model.cp_exposed(m, latent, seq, dev, 4, 2)
                < cost_model.cp_exposed(m, expanded, seq, dev, 4, 2))
        # (across nodes: per_node 4 < cp)
    acts = {x: memory_model.rank_memory(m, cand(x), seq).activations for x in (True, False)}
    assert acts[True] < acts[False]
    split = {x: memory_model.rank_memory(m, cand(x, schedule="zb-h1"), seq) for x in (True, False)}
    assert split[True] == split[False]  # (the engine moves the expanded ones there)
    spec = load_spec(None, ["model.preset=tiny-dsv3", "parallelism.cp=2", "parallelism.cp_latent=false"])
    c = plan(request_for(spec), Topology.uniform(1, 2, "cpu")).best.candidate
    assert not c.cp_latent and effective_spec(spec, c).parallelism.cp_latent is False
    on = load_spec(None, ["model.preset=tiny-dsv3", "parallelism.cp=2"])
    assert plan(request_for(on), Topology.uniform(1, 2, "cpu")).best.candidate.cp_latent
    # float8's wkv_b is a float8 linear: the ranks move the expanded keys and values, as priced
    req = dataclasses.replace(request_for(on), float8="tensorwise", compiled=True)
    assert not plan(req, Topology.uniform(1, 8, "h100")).best.candidate.cp_latent


def test_a_dense_model_whose_state_fits_each_rank_runs_as_ddp_where_that_is_faster():
    """Under ``parallelism: auto`` the planner weighs DDP (shard groups of one replica) beside
    ZeRO-3. On CPU ranks FSDP2 cannot hide its all-gathers and reduce-scatters (no streams)
    while DDP's all-reduce still overlaps backward: the demo's model runs as DDP, and the
    explanation names both. On 8 H100 the `small` model runs as DDP (no parameter gathers,
    more memory); `1b` stays ZeRO-3: its 1 GB embedding, whose gradient comes last, is
    all-reduced after backward; 8b does not fit whole; MoE never runs as DDP. The effective
    spec carries it to the ranks; a pinned layout stays as pinned."""
    from trainmesh.planning.job_plan import effective_spec

    demo = ["model.preset=tiny", "training.global_batch_size=16", "training.microbatch_size=4",
            "training.seq_len=64"]
    spec = load_spec(None, [*demo, "parallelism=auto"])
    result = plan(request_for(spec), Topology.uniform(1, 2, "cpu"))
    c = result.best.candidate
    assert (c.dp, c.dp_replicate) == (2, 2) and candidate.runs_ddp(spec.model, c)
    sharded = next(p for p in result.plans if p.candidate == dataclasses.replace(c, dp_replicate=1))
    assert sharded.estimate.dp_exposed_s > result.best.estimate.dp_exposed_s
    text = explain(result)
    assert "It runs DDP (no sharding: each of the 2 replicas holds the whole state" in text
    assert "ZeRO-3 over all 2 replicas" in text and "exposed DDP all-reduce traffic" in text
    assert effective_spec(spec, c).parallelism.dp_replicate == 2
    pinned = load_spec(None, [*demo, "parallelism.dp=2"])
    assert plan_job(pinned, Topology.uniform(1, 2, "cpu"))[1].best.candidate.dp_replicate == 1
    # ZeRO-3's traffic hides behind compute on a device with streams only
    cpu = device_spec("cpu")
    assert cost_model._zero3_exposed(spec.model, sharded.candidate, cpu, 2, 4, 1.0) > \
        cost_model._zero3_exposed(spec.model, sharded.candidate, dataclasses.replace(cpu, streams=True), 2, 4, 1.0)

    h100 = Topology.uniform(1, 8, "h100")
    small = load_spec(None, ["model.preset=small", "parallelism=auto", "training.global_batch_size=64",
                             "training.seq_len=1024"])
    best = plan(request_for(small), h100).best
    assert candidate.runs_ddp(small.model, best.candidate) and best.candidate.dp == 8
    # whole float32 state, gradients and the weights' bf16 casts autocast keeps for backward
    n = stage_params.rank_params(small.model, 1, 0, "1f1b").gathered(1, 1)
    mem = memory_model.rank_memory(small.model, best.candidate, 1024, compute_bytes=2)
    assert (mem.params, mem.grads, mem.optimizer, mem.gathered) == (4 * n, 4 * n, 8 * n, 2 * n)
    assert memory_model.rank_memory(small.model, best.candidate, 1024, compute_bytes=4).gathered == 0
    one_b = load_spec(None, ["model.preset=1b", "parallelism=auto", "training.global_batch_size=64",
                             "training.seq_len=2048"])
    plans = plan(request_for(one_b), h100).plans
    ddp = next(p for p in plans if candidate.runs_ddp(one_b.model, p.candidate))
    assert not candidate.runs_ddp(one_b.model, plans[0].candidate)
    embedding = 4 * one_b.model.vocab_size * one_b.model.dim  # fp32 gradients, ring over 8
    assert ddp.estimate.dp_exposed_s >= 2 * 7 / 8 * embedding / (h100.device.intra_node_gbps * 1e9)
    eight_b = load_spec(None, ["model.preset=8b", "parallelism=auto", "training.global_batch_size=64",
                               "training.seq_len=4096"])
    assert not any(candidate.runs_ddp(eight_b.model, p.candidate)
                   for p in plan(request_for(eight_b), h100).plans)
    moe = load_spec(None, ["model.preset=tiny-moe", "parallelism=auto", *demo[1:]])
    plans = plan(request_for(moe), Topology.uniform(1, 4, "cpu")).plans
    assert plans and not any(candidate.runs_ddp(moe.model, p.candidate) for p in plans)
    # In-memory snapshots: a DDP rank's hold the whole state. Where they do not fit a node's
    # host memory and ZeRO-3's do, the job runs ZeRO-3 rather than being refused.
    from trainmesh.planning.job_plan import plan_for

    snap = load_spec(None, [*demo, "parallelism=auto", "checkpoint.in_memory.every=1"])
    ddp_gib = 2 * memory_model.snapshot_host_bytes(snap.model, c) / candidate.GIB  # 2 ranks a node
    zero_gib = 2 * memory_model.snapshot_host_bytes(snap.model, sharded.candidate) / candidate.GIB
    assert zero_gib < ddp_gib
    tight = plan_for(snap, Topology.uniform(1, 2, "cpu").with_host_memory((zero_gib + ddp_gib) / 2), False)
    assert tight.result.best.candidate.dp_replicate == 1 and tight.spec.parallelism.dp_replicate == 1
    roomy = plan_for(snap, Topology.uniform(1, 2, "cpu").with_host_memory(2 * ddp_gib), False)
    assert roomy.spec.parallelism.dp_replicate == 2


def test_small_microbatches_pay_the_hosts_launches_and_the_devices_fixed_costs():
    """On a GPU each microbatch pays a fixed device cost per block and waits for the host to
    issue the block's work where that is longer: `1b` on one H200 at a global batch of 16 is
    planned at microbatch 8 (measured fastest there, bench/RESULTS.md), not at the smallest
    (the least memory, which the planner took when every size cost the same); microbatch 1 is
    host-bound and the explanation says what the choice weighed. Where the larger sizes do not
    fit (an A100 40GB without recomputation), the largest that fits. A CPU rank's host is its
    device: its per-op costs sit inside its throughput, and its plans stay as they were."""
    spec = load_spec(None, ["model.preset=1b", "training.seq_len=2048", "training.dtype=bfloat16",
                            "training.global_batch_size=16", "parallelism=auto"])
    result = plan(request_for(spec), Topology.uniform(1, 1, "h200"))
    best = result.best.candidate
    assert (best.microbatch_size, best.num_microbatches) == (8, 2)
    by_size = {p.candidate.microbatch_size: p.estimate for p in result.plans
               if dataclasses.replace(p.candidate, microbatch_size=8, num_microbatches=2) == best}
    assert sorted(by_size) == [1, 2, 4, 8]
    times = [by_size[m].step_time_s for m in (1, 2, 4, 8)]
    assert times == sorted(times, reverse=True)
    assert by_size[1].host_bound and not by_size[8].host_bound
    blocks = spec.model.n_layers * 16  # microbatch 1: 16 of them, each through every block
    assert by_size[1].compute_s == pytest.approx(blocks * device_spec("h200").host_dispatch_s)
    text = explain(result)
    assert "Microbatch 8 rather than 1" in text and "longer at microbatch 1" in text

    pinned = load_spec(None, ["model.preset=1b", "training.seq_len=2048", "training.dtype=bfloat16",
                              "training.global_batch_size=16", "training.microbatch_size=1"])
    one = plan(request_for(pinned), Topology.uniform(1, 1, "h200"))
    assert one.best.estimate.host_bound and "The host issuing its blocks' work bounds the step" in explain(one)
    assert "the GPU waits for its host" in explain(one)

    a100 = Topology.uniform(1, 1, "a100-40gb")
    no_recompute = load_spec(None, ["model.preset=1b", "training.seq_len=2048", "training.dtype=bfloat16",
                                    "training.global_batch_size=16", "parallelism=auto",
                                    "activation_checkpoint.mode=none"])
    req = request_for(no_recompute)
    req.fixed["recompute"] = "none"
    fits = plan(req, a100)
    sizes = {p.candidate.microbatch_size for p in fits.plans}
    assert 8 not in sizes and fits.best.candidate.microbatch_size == max(sizes) > 1

    cpu = load_spec(None, ["model.preset=tiny", "training.global_batch_size=16", "training.seq_len=64",
                           "parallelism=auto"])
    cpu_plans = [p for p in plan(request_for(cpu), Topology.uniform(1, 1, "cpu")).plans
                 if p.candidate.recompute == "none"]
    flops = cost_model.flops_per_token(cpu.model, 64) * 16 * 64
    assert {p.candidate.microbatch_size for p in cpu_plans} == {1, 2, 4, 8}
    for p in cpu_plans:  # the FLOPs alone, at every microbatch size
        assert p.estimate.compute_s == pytest.approx(
            flops / (device_spec("cpu").peak_tflops * 1e12 * cost_model.MATMUL_EFFICIENCY))
        assert not p.estimate.host_bound


def test_an_moe_model_at_scale_is_planned_with_hybrid_sharding_beside_expert_parallel():
    """Mixtral 8x22B on 8,192 H100: shard groups that hold whole expert-parallel groups,
    all-reduced across the replica groups, are predicted faster than ZeRO-3 over every replica
    with the same experts split (rings of thousands pay a hop each); a re-plan of a pinned
    hybrid layout keeps each shard group whole EP groups (the largest dp_replicate up to the
    pinned one that does)."""
    from trainmesh.planning.job_plan import plan_for, request_for

    spec = load_spec(None, ["model.preset=mixtral-8x22b", "training.seq_len=4096",
                            "training.global_batch_size=8192", "parallelism=auto"])
    result = plan(request_for(spec), Topology.uniform(1024, 8, "h100"))
    c = result.best.candidate
    assert c.ep > 1 and c.dp_replicate > 1 and c.dp_shard % c.ep == 0 and c.cp == 1
    flat = next(p for p in result.plans if p.candidate == dataclasses.replace(c, dp_replicate=1))
    assert flat.estimate.dp_exposed_s > result.best.estimate.dp_exposed_s
    assert result.best.estimate.tokens_per_s > 1.05 * flat.estimate.tokens_per_s
    assert f"It runs hybrid sharding {c.dp_replicate}×{c.dp_shard}" in explain(result)

    pinned = load_spec(None, ["model.preset=tiny-moe", "parallelism.dp=8", "parallelism.ep=2",
                              "parallelism.dp_replicate=4", "training.global_batch_size=12",
                              "training.microbatch_size=1", "training.seq_len=32"])
    new = plan_for(pinned, Topology.uniform(1, 6, "cpu"), replan=True)  # dp 6: groups of 3 or 6
    par = new.spec.parallelism
    assert (par.dp // par.dp_replicate) % par.ep == 0 and par.dp_replicate <= 4
    assert (par.dp, par.ep, par.dp_replicate) == (6, 2, 3)
    # pinned 2: groups of 3 replicas would split an EP group; the largest below that does not
    two = load_spec(None, ["model.preset=tiny-moe", "parallelism.dp=8", "parallelism.ep=2",
                           "parallelism.dp_replicate=2", "training.global_batch_size=12",
                           "training.microbatch_size=1", "training.seq_len=32"])
    par = plan_for(two, Topology.uniform(1, 6, "cpu"), replan=True).spec.parallelism
    assert (par.dp, par.ep, par.dp_replicate) == (6, 2, 1)


def test_hybrid_shard_groups_under_context_parallel_are_whole_nodes():
    """A replica of a stage is tp × cp ranks: hybrid sharding's shard groups span one node or
    8 (dp_shard × cp × tp ranks), as they do without context parallel."""
    from trainmesh.planning.job_plan import request_for

    spec = load_spec("jobs/llama-8b-128k.yaml", ["parallelism=auto", "training.global_batch_size=128"])
    plans = plan(request_for(spec), Topology.uniform(32, 8, "h100")).plans
    hybrid = [p.candidate for p in plans if p.candidate.cp > 1 and p.candidate.dp_replicate > 1]
    assert hybrid and {c.dp_shard * c.cp * c.tp for c in hybrid} <= {8, 64}


def test_two_different_sizes_in_a_rejection_never_print_alike():
    from trainmesh.planning.planner import gib_apart

    gib = 1024**3
    assert gib_apart(72.04 * gib, 72.01 * gib) == ("72.04", "72.01")  # was "72.0 ... 72.0"
    assert gib_apart(80.5 * gib, 72.0 * gib) == ("80.5", "72.0")


def test_a_layout_whose_largest_ep_does_not_fit_rejects_its_smaller_ones_unpriced_and_rightly():
    """Expert-parallel degrees ≥ 2 are weighed largest first, and one that does not fit rejects
    the layout's smaller ones by its bytes without pricing them: each so rejected does exceed
    the device when priced (so the plans found are those a pricing of every candidate finds),
    and ep 1 is priced on its own (its activations are not bounded by a larger ep's)."""
    m = load_spec(None, ["model.preset=deepseek-v2-lite"]).model
    req = PlanRequest(m, global_batch_size=128, seq_len=4096)
    topo = Topology.uniform(2, 8, "h100")
    result = plan(req, topo)
    limit = topo.device.memory_gib * MEMORY_HEADROOM * 1024**3
    fused = memory_model.uses_fused_kernels(req.kernels, topo.device.name)
    bound = [r for r in result.rejected if "as at a larger ep" in r.reason]
    assert bound and all(r.candidate.ep >= 2 for r in bound)
    # priced, every one of them exceeds the device: the plans are those of pricing them all
    with stage_params.memoized():
        for r in bound:
            assert memory_model.memory_bytes(m, r.candidate, req.seq_len, req.compute_bytes,
                                           topo.device.framework_gib * 1024**3, fused) > limit
    priced = [r for r in result.rejected if r.reason.startswith("memory") and r not in bound]
    assert any(r.candidate.ep == 1 for r in priced) and result.plans


@full("plans 405B at 16,384 GPUs twice (the choice, the paper's degrees pinned), ~11 s; make "
      "test keeps the planner's search and explanation (the tests above)")
def test_plan_prices_the_llama3_papers_layout_beside_its_choice(capsys):
    """``trainmesh plan`` for the 405b preset on 16,384 H100 prints the layout the Llama 3 paper
    published (tp 8 × pp 16 × dp 128) priced on that cluster: what the planner's own search
    predicts for the best plan with those degrees, beside its choice; on a cluster those
    degrees do not divide, it says so (and plans nothing)."""
    from trainmesh.planning.published import PUBLISHED, price, published_layout

    sets = ["model.preset=405b", "parallelism=auto", "training.global_batch_size=2048",
            "elastic.max_world_size=16384"]
    assert main(["plan", "jobs/llama-70b.yaml", *[x for s in sets for x in ("--set", s)],
                 "--nodes", "2048", "--device", "h100", "--top", "1"]) == 0
    [line] = [s for s in capsys.readouterr().out.splitlines() if s.startswith("Published: ")]
    assert line.startswith("Published: the Llama 3 paper (16,384 H100, 8k tokens), tp=8 × pp=16")
    spec = load_spec("jobs/llama-70b.yaml", sets)
    topo = Topology.uniform(2048, 8, "h100")
    _, ours = plan_job(spec, topo)
    same = [p for p in ours.plans
            if (p.candidate.tp, p.candidate.pp, p.candidate.dp, p.candidate.cp) == (8, 16, 128, 1)]
    assert same, "the search prices the published degrees too"
    head = ours.first_priced(same)  # (priced stage by stage, as a search's best is)
    assert f"(dp=128, vpp={head.candidate.vpp}, " in line
    assert f": {head.estimate.tokens_per_s:,.0f} tokens/s, " in line, line
    gap = 1 - head.estimate.tokens_per_s / ours.best.estimate.tokens_per_s
    assert f"{abs(gap):.1%} {'slower' if gap >= 0 else 'faster'} than the choice" in line
    assert "Not priced: " in line
    odd = price(request_for(spec), Topology.uniform(2047, 8, "h100"), PUBLISHED["405b"])
    assert odd == "16376 accelerators do not divide into its tp × pp × cp = 128"
    # another shape under the preset's name is another model: no published layout for it
    assert published_layout(spec.model) is PUBLISHED["405b"]
    assert published_layout(load_spec("jobs/llama-70b.yaml", [*sets, "model.n_layers=64"]).model) is None


@full("plans DeepSeek-V3 on 2,048 H100 twice (the choice, then DeepSeek's degrees): ~12 s; "
      "make test keeps the same comparison for Llama 3 405B")
def test_plan_prices_deepseeks_layout_and_names_the_nodes_its_expert_groups_span(capsys):
    """DeepSeek-V3 on 2,048 H100 (its own batch: 15,360 sequences of 4,096 tokens): the plan
    prints DeepSeek's published layout (tp 1 × pp 16 × ep 64) priced there, the step's parts
    that differ most, the nodes an expert group spans at ep 64 (8 of 8 accelerators) and the
    choice's, and what the cost model does not price (DualPipe's overlap among them)."""
    sets = ["model.preset=deepseek-v3-671b", "parallelism=auto", "training.seq_len=4096",
            "training.global_batch_size=15360", "elastic.max_world_size=2048"]
    assert main(["plan", "jobs/llama-70b.yaml", *[x for s in sets for x in ("--set", s)],
                 "--nodes", "256", "--device", "h100", "--top", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    [line] = [s for s in out if s.startswith("Published: ")]
    # the choice, as the plan's explanation names it: tp=T × ... (ep=E over dp)
    choice = re.search(r"^tp=(\d+) × pp=\d+ × dp=\d+( \(ep=(\d+) over dp)?", next(
        s for s in out if s.startswith("tp=")))
    tp, ep = int(choice.group(1)), int(choice.group(3) or 1)
    assert line.startswith("Published: DeepSeek-V3's technical report (2,048 H800), "
                           "tp=1 × pp=16 × ep=64, priced on this cluster (dp=128 (ep=64 over dp)")
    assert "Of its step (" in line and " against the choice's " in line
    if ep != 64:
        assert (f"Its ep=64 spreads each expert group over 8 node(s) of 8, the choice's "
                f"ep={ep} over {max(1, ep * tp // 8)}") in line
        # ... relayed (ep_dispatch auto): once to each of the 4 nodes its groups sit on
        assert "relayed, a token crosses once to each node its experts sit on (4 on " in line
    assert "Not priced: DualPipe" in line


def test_the_relay_is_priced_by_the_nodes_a_token_reaches():
    """parallelism.ep_dispatch: relayed, a token crosses once to each other node its experts
    sit on (at most topk_group where the router's groups map onto the nodes), then inside
    the node; direct, once per copy on another rank. The planner relays where the engine
    would (auto: the EP group spans nodes), prices the other way beside it, and says so."""
    dsv3 = load_spec(None, ["model.preset=deepseek-v3-671b"]).model
    mixtral = load_spec(None, ["model.preset=mixtral-8x7b"]).model
    # 4 of 8 groups on 8 nodes, a node each: 4 nodes exactly; 2 of 8 experts over 2 nodes
    assert cost_model.nodes_reached(dsv3.moe, 8) == 4.0
    assert cost_model.nodes_reached(mixtral.moe, 2) == pytest.approx(2 * (1 - 6 / 28))
    assert cost_model.nodes_reached(dsv3.moe, 1) == 1.0

    def priced(ep: int, dispatch: str):
        c = candidate.Candidate(1, 16, 128, 1, "1f1b", 1, 60, "full", False, True, "float32", ep,
                                ep_dispatch=dispatch)
        return cost_model.estimate(dsv3, c, 4096, device_spec("h100"), 8, 2)

    auto, direct, relay = priced(64, "auto"), priced(64, "direct"), priced(64, "relay")
    assert auto.ep_relay and relay.ep_relay and not direct.ep_relay
    assert auto.ep_nodes_reached == 4.0
    # half the copies cross (4 of 8 nodes, 7/8 of them another), a second hop inside the node
    assert 0 < auto.ep_relay_gain_s == direct.ep_relay_gain_s
    assert auto.ep_comm_s == pytest.approx(direct.ep_comm_s - direct.ep_relay_gain_s)
    # (the bytes between nodes halved; the hop inside the node, at ~9× the bandwidth, and the
    # relay's two extra latencies add back a little)
    assert 0.5 * direct.ep_comm_s < auto.ep_comm_s < 0.7 * direct.ep_comm_s
    inside = priced(8, "auto")  # an EP group inside a node: nothing to save, direct
    assert not inside.ep_relay and inside.ep_nodes_reached == 1.0 and inside.ep_relay_gain_s < 0
    # said by the plan's explanation
    from trainmesh.planning.explain import _relay_text
    assert "in two hops (parallelism.ep_dispatch: relay)" in _relay_text(auto, dsv3)
    assert "a token's 8 experts sit on 4 of 8 nodes on average" in _relay_text(auto, dsv3)
    assert "at most topk_group=4: the router's 8 groups map onto its 8 nodes" in _relay_text(
        auto, dsv3)
    assert "the step" in _relay_text(direct, dsv3) and "would cross" in _relay_text(direct, dsv3)
    assert _relay_text(inside, dsv3) == ""
    # auto is the planner's choice by price, written into the plan's spec; ep_node_ranks sets
    # the node (16: an EP group of 64 over 4 of them)
    from trainmesh.planning.cost_model import relayed
    c = candidate.Candidate(1, 16, 128, 1, "1f1b", 1, 60, "full", False, True, "float32", 64)
    assert relayed(dsv3, c, 4096, device_spec("h100"), 8, 2)
    wide = dataclasses.replace(c, ep_node_ranks=16)
    assert priced(64, "auto").ep_nodes == 8
    assert cost_model.estimate(dsv3, wide, 4096, device_spec("h100"), 8, 2).ep_nodes == 4
    # A run's plan: where the relay does not pay (or cannot run: an EP group inside a node),
    # auto becomes direct in the spec the ranks build; where it pays, auto stays (the ranks
    # relay where their real nodes allow it, else run direct); the plan's row says which.
    from trainmesh.planning.job_plan import plan_for
    from trainmesh.planning.topology import Topology
    for ep, extra, written, row in ((64, [], "auto", "relay"), (8, [], "direct", "direct"),
                                    (64, ["parallelism.ep_dispatch=direct"], "direct", "direct")):
        spec = load_spec(None, [
            "model.preset=deepseek-v3-671b", "parallelism.tp=1", "parallelism.pp=16",
            "parallelism.dp=128", f"parallelism.ep={ep}", "parallelism.vpp=2",
            "training.seq_len=4096", "training.global_batch_size=15360",
            "activation_checkpoint.mode=full", *extra])
        new = plan_for(spec, Topology.uniform(256, 8, "h100"), replan=False)
        assert new.spec.parallelism.ep_dispatch == written, (ep, extra)
        assert new.result.best.as_row()["ep_dispatch"] == row, (ep, extra)
    # ... a forced relay is not planned where a node would hold more of an EP group than
    # another (nodes of 3 ranks: ep 4 or 8 over dp 8 straddle them unevenly), and the
    # rejection says so; ep 2 stays
    spec = load_spec(None, ["model.preset=tiny-moe", "parallelism=auto",
                            "parallelism.ep_dispatch=relay", "parallelism.ep_node_ranks=3"])
    _, result = plan_job(spec, Topology.uniform(1, 8, "h100"))
    from trainmesh.spec.mesh_rules import uneven_ep_nodes
    for p in result.plans:
        c = p.candidate
        assert uneven_ep_nodes(c.pp, c.dp, c.cp, c.tp, c.ep,
                               [g // 3 for g in range(c.world_size)]) is None, c
    assert {p.candidate.ep for p in result.plans if p.candidate.dp == 8} == {1, 2}
    assert any("ep_dispatch=relay needs each node" in str(r.reason) for r in result.rejected)


@pytest.mark.parametrize("preset, nodes, batch, extra, fixed", [
    ("70b", 64, 1024, [], {}),  # a tier of every accelerator used, many plans in it
    ("tiny-dsv3", 2, 16, ["training.seq_len=256"], {}),  # MoE: ep choices inside each layout
    ("8b", 1, 8, ["training.seq_len=65536", "model.max_seq_len=65536"], {}),  # long: cp
    # 9 plans use every accelerator: the next tier (8 idle) is priced too, the rest not
    ("70b", 5, 36, [], {"tp": 8, "recompute": "full", "microbatch_size": 1}),
])
def test_the_search_prices_tiers_of_idle_accelerators_fewest_first(preset, nodes, batch, extra,
                                                                   fixed):
    """Layouts are priced a tier of idle accelerators at a time (fewest first) until the
    tiers priced hold PLANS_WEIGHED feasible plans; the rest are counted, not priced. The
    best plan, the first PLANS_WEIGHED in order (a plan's table) and every rejection kept are
    those pricing every candidate gives; each plan left out leaves more idle than every plan
    kept."""
    from trainmesh.planning.planner import PLANS_WEIGHED

    spec = load_spec(None, [f"model.preset={preset}", "parallelism=auto",
                            f"training.global_batch_size={batch}", *extra])
    req, topo = request_for(spec), Topology.uniform(nodes, 8, "h100")
    req = dataclasses.replace(req, fixed={**req.fixed, **fixed})
    fast, every = plan(req, topo), plan(req, topo, every=True)
    assert fast.plans and every.unpriced == 0
    assert fast.best == every.best
    head = min(len(every.plans), PLANS_WEIGHED)
    assert [p.candidate for p in fast.first(head)] == [p.candidate for p in every.first(head)]
    assert [p.estimate for p in fast.first(head)] == [p.estimate for p in every.first(head)]
    kept = {p.candidate for p in fast.plans}
    assert kept <= {p.candidate for p in every.plans}
    most_idle = max(p.idle for p in fast.plans)
    left = [p for p in every.plans if p.candidate not in kept]
    assert all(p.idle > most_idle for p in left)
    assert {r.reason for r in fast.rejected} <= {r.reason for r in every.rejected}
    assert left and fast.unpriced > 0  # (each case leaves some unpriced)
    assert f"Not priced: {fast.unpriced} layout(s)" in explain(fast)
    # the explanation's best other layout is the one pricing all gives
    other = re.search(r"The best other layout \(([^)]*)\)", explain(every))
    assert other and other.group(1) in explain(fast)


@pytest.mark.parametrize("preset", ["1b", "8b", "qwen3-30b-a3b", "mixtral-8x7b", "tiny-dsv3",
                                    "deepseek-v2-lite", "deepseek-v3-671b"])
def test_the_float8_linears_are_the_blocks_matmul_parameters(preset):
    """``model_math.linear_shapes``: every matrix of a block's attention and MLP (experts one
    per expert), less the router and the norms, for dense, GQA with q/k norms, MoE and latent
    attention (with and without the query's low-rank pair)."""
    from trainmesh.models.llama.model_math import attention_params, linear_shapes, mlp_params

    m = _model(preset)
    mla, moe = getattr(m, "mla", None), getattr(m, "moe", None)
    norms = (2 * (m.head_dim or m.dim // m.n_heads) if getattr(m, "qk_norm", False) else 0) + (
        (mla.q_lora_rank or 0) + mla.kv_lora_rank if mla is not None else 0)
    for layer in {0, m.n_layers - 1}:
        router = m.dim * moe.experts if moe is not None and layer >= moe.dense_layers else 0
        shapes = linear_shapes(m, layer)
        held = sum(a * b * n for a, b, _, n in shapes)
        assert held + router + norms == attention_params(m) + mlp_params(m, layer), layer
        used = sum(a * b * k for a, b, k, _ in shapes)  # (a token's: top_k experts)
        assert used + router + norms == attention_params(m) + mlp_params(m, layer, active=True)


def test_float8_is_priced_as_its_matmuls_at_the_float8_peak_less_their_casts():
    """``training.float8``: the blocks' linears at the device's float8 peak, less their casts
    (memory-bound: each linear's input and output per token, its weights per microbatch), and
    the host issuing more kernels. On an H200 the 8B shape gains more at microbatch 4 than at
    2 (its weights' casts shared by more tokens: measured 0.83× and 0.86× of bf16's step),
    `1b` at microbatch 2 is slower (host-bound: measured 1.5×); nothing changes on CPU ranks
    (emulated); a GPU without float8 is refused naming the field; an MoE block's routed
    experts cast only the rank's experts' weights."""
    from trainmesh.planning.cost_model import estimate, float8_parts

    h200, cpu = device_spec("h200"), device_spec("cpu")

    def step(preset_args, batch, mbs, float8, device=h200, ep=1):
        model = load_spec(None, preset_args).model
        c = dataclasses.replace(candidate.Candidate(1, 1, max(ep, 1), 1, "1f1b", mbs, batch // mbs,
                                                    "none"), ep=ep)
        return estimate(model, c, 2048, device, 1, compute_bytes=2, fused=True, float8=float8)

    eight = ["model.preset=8b", "model.n_layers=8"]
    ratios = {}
    for mbs, batch in ((4, 16), (2, 8)):
        bf16, f8 = step(eight, batch, mbs, "none"), step(eight, batch, mbs, "tensorwise")
        assert f8.step_time_s < bf16.step_time_s and not f8.host_bound
        assert f8.float8_gain_s == pytest.approx(bf16.step_time_s - f8.step_time_s)
        assert bf16.float8_gain_s == 0
        ratios[mbs] = f8.step_time_s / bf16.step_time_s
    assert ratios[4] < ratios[2] < 1
    assert ratios[4] == pytest.approx(0.695 / 0.837, abs=0.02)  # (the fitting point)
    small = step(["model.preset=1b"], 8, 2, "tensorwise")
    assert small.host_bound and small.float8_gain_s < 0
    on_cpu = [step(eight, 16, 4, f8, cpu) for f8 in ("none", "tensorwise")]
    assert on_cpu[0] == on_cpu[1]
    # experts: the rank's share of the routed experts' weights is cast, its tokens' copies
    moe = load_spec(None, ["model.preset=mixtral-8x7b"]).model
    c1, c8 = (dataclasses.replace(candidate.Candidate(1, 1, 8, 1, "1f1b", 1, 8, "none"), ep=e)
              for e in (1, 8))
    (lin1, cast1), (lin8, cast8) = (float8_parts(moe, c, 2048, h200) for c in (c1, c8))
    assert lin1 == lin8 and cast8 < cast1
    # ... where the device runs no float8 grouped GEMM (Ada), the experts stay bf16
    l40s = device_spec("l40s")
    assert float8_parts(moe, c1, 2048, l40s)[0] < lin1 * h200.peak_tflops / l40s.peak_tflops
    # a rank's share: half the blocks at pp 2, half the tokens at cp 2
    dense = load_spec(None, eight).model
    whole = candidate.Candidate(1, 1, 1, 1, "1f1b", 2, 4, "none")
    for part in (dataclasses.replace(whole, pp=2), dataclasses.replace(whole, cp=2)):
        assert float8_parts(dense, part, 2048, h200)[0] == pytest.approx(
            float8_parts(dense, whole, 2048, h200)[0] / 2)
    # a ZeRO-3 step: the gain is the whole step's (less of ZeRO-3's traffic hides)
    wide = dataclasses.replace(whole, dp=64)
    eight_b = load_spec(None, ["model.preset=8b"]).model
    f8, bf16 = (estimate(eight_b, wide, 2048, h200, 8, fused=True, float8=f)
                for f in ("tensorwise", "none"))
    assert f8.float8_gain_s == pytest.approx(bf16.step_time_s - f8.step_time_s)
    # ... and tensorwise's weights gather in float8 (a byte an element: torchao's float8
    # all-gather), every block linear of Llama 3 8B; rowwise's in bf16
    from trainmesh.planning.cost_model import _zero3_exposed, float8_gathered
    assert float8_gathered(eight_b, whole, h200) == 32 * (2 * 4096**2 + 2 * 4096 * 1024
                                                          + 3 * 4096 * 14336)
    regather = dataclasses.replace(wide, keep_gathered=False)  # (2 gathers a microbatch)
    elements = float8_gathered(eight_b, regather, h200)
    saved = (_zero3_exposed(eight_b, regather, h200, 8, 2, 0.0)
             - _zero3_exposed(eight_b, regather, h200, 8, 2, 0.0, elements))
    assert saved == pytest.approx(2 * regather.num_microbatches * elements * 63 / 64
                                  / (h200.inter_node_gbps * 1e9))
    tensorwise, rowwise = (estimate(eight_b, regather, 2048, h200, 8, fused=True, float8=f)
                           for f in ("tensorwise", "rowwise"))
    assert tensorwise.dp_exposed_s < rowwise.dp_exposed_s
    # a GPU without float8 matmuls: refused, naming the field
    spec = load_spec(None, ["model.preset=8b", "parallelism=auto", "training.float8=tensorwise",
                            "model.compile=true", "training.global_batch_size=64",
                            "training.seq_len=8192"])
    result = plan(request_for(spec), Topology.uniform(1, 8, "a100-80gb"))
    assert not result.plans and "training.float8=none" in summarize(result)
    with pytest.raises(PlanError, match="training.float8"):
        plan_job(spec, Topology.uniform(1, 8, "a100-80gb"))
    # ... and without model.compile on a GPU (the ranks would refuse it: half bf16's speed)
    eager = load_spec(None, ["model.preset=8b", "parallelism=auto", "training.float8=rowwise"])
    assert "model.compile=true" in summarize(plan(request_for(eager), Topology.uniform(1, 8, "h100")))
    # ... and on one that has them, the explanation says what it gains
    text = explain(plan(request_for(spec), Topology.uniform(1, 8, "h100")))
    assert re.search(r"float8 \(tensorwise\) linears: predicted [\d.]+ s a step faster than bf16",
                     text), text


def summarize(result) -> str:
    from trainmesh.planning.planner import summarize_rejections

    return summarize_rejections(result.rejected)


def test_explained_durations_print_without_an_exponent():
    """The sharding sentence's exposed times: "7,510 ms", not "7.51e+03 ms"."""
    from trainmesh.planning.explain import _ms

    assert (_ms(7.51), _ms(4.12e-4), _ms(0.0123)) == ("7,510 ms", "0.412 ms", "12.3 ms")


def test_dualpipev_pairs_hide_the_exchanges_they_run_beside():
    """schedule.pair_overlap: a DualPipeV pair's exchanges are in flight while its other half
    computes. The planner counts the pairs as torch's order has them (rank 0 pairs fewest:
    2m − 3pp + 1 of its 2m forwards), hides their share of the exchanges up to their share of
    the compute, and says so; other schedules and pair_overlap false hide nothing."""
    from trainmesh.parallel.pipeline.schedules import dualpipev_pairs, pipe_shape

    for pp, m in ((2, 4), (3, 7), (4, 8), (4, 16), (8, 24)):
        counts = [len(p) for p in dualpipev_pairs(pipe_shape("dualpipev", pp, 2, m))]
        assert min(counts) == counts[0] == round(cost_model.paired_share(pp, m) * 2 * m)
    mixtral = load_spec(None, ["model.preset=mixtral-8x7b"]).model

    def priced(schedule: str, pairs: bool = True):
        c = candidate.Candidate(1, 4, 16, 2, schedule, 1, 32, "full", False, True, "float32", 8,
                                pair_overlap=pairs)
        return c, cost_model.estimate(mixtral, c, 4096, device_spec("h100"), 8, 2)

    c, paired = priced("dualpipev")
    _, alone = priced("dualpipev", pairs=False)
    share = cost_model.paired_share(4, 32)
    assert share == pytest.approx(53 / 64)
    assert paired.ep_pair_hidden_s > 0
    assert paired.ep_pair_hidden_s == pytest.approx(share * alone.ep_comm_s)
    assert paired.ep_comm_s == pytest.approx(alone.ep_comm_s - paired.ep_pair_hidden_s)
    assert paired.step_time_s == pytest.approx(alone.step_time_s - paired.ep_pair_hidden_s)
    assert alone.ep_pair_hidden_s == 0 and priced("zbv")[1].ep_pair_hidden_s == 0
    from trainmesh.planning.explain import _pair_text
    assert "DualPipeV's pairs hide" in _pair_text(paired, c) and "83% of a rank's" in _pair_text(paired, c)
    assert "pair_overlap: false" in _pair_text(alone, dataclasses.replace(c, pair_overlap=False))
