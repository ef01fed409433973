"""Planned memory = real memory: real ranks build their parts on the meta device (as the
planner's effective spec says) and run a step; the bytes they hold are compared with the cost
model's prediction for each rank. The same 4 rank actors are re-formed for every plan."""

from __future__ import annotations

import pytest
from rank_pool import next_generation

from trainmesh.cli.loading import load_spec
from trainmesh.controller.dry_run import memory_rows
from trainmesh.controller.launch import dry_run_job
from trainmesh.data.shards import ensure_tiny_corpus
from trainmesh.models.llama.model_math import num_params
from trainmesh.planning.devices import device_spec
from trainmesh.planning.job_plan import effective_spec, plan_job
from trainmesh.planning.topology import Topology

GIB = 1024**3
BASE = ["model.preset=tiny", "model.dim=128", "model.ffn_dim=352", "training.global_batch_size=8",
        "training.microbatch_size=2", "training.seq_len=64", "tracking.enabled=false",
        "runtime.device=cpu", "runtime.collective_timeout_s=60", "training.steps=2",
        "optimizer.warmup_steps=1"]

PLANS = {  # every plan on 4 ranks
    "dp4-keep-gathered": ["parallelism.dp=4", "parallelism.keep_gathered=true"],
    "ddp-dp4": ["parallelism.dp=4", "parallelism.dp_replicate=4"],  # every rank the whole state
    "tp2-dp2-reshard-full-recompute": ["parallelism.tp=2", "parallelism.dp=2",
                                       "parallelism.keep_gathered=false",
                                       "activation_checkpoint.mode=full"],
    "tp2-sp-dp2": ["parallelism.tp=2", "parallelism.dp=2", "parallelism.sequence_parallel=true"],
    "pp2-1f1b-dp2": ["parallelism.pp=2", "parallelism.dp=2", "schedule.name=1f1b",
                     "training.global_batch_size=16"],
    # stages of unequal size, as pinned: 1 block on the first rank, 3 on the last
    "pp2-1f1b-dp2-pinned-1-3": ["parallelism.pp=2", "parallelism.dp=2", "schedule.name=1f1b",
                                "training.global_batch_size=16", "parallelism.stage_layers=[1, 3]"],
    "pp2-vpp2-interleaved-tp2-sp": ["parallelism.pp=2", "parallelism.vpp=2", "parallelism.tp=2",
                                    "parallelism.sequence_parallel=true",
                                    "schedule.name=interleaved-1f1b"],
    "pp2-gpipe-tp2-reshard": ["parallelism.pp=2", "parallelism.tp=2", "schedule.name=gpipe",
                              "parallelism.keep_gathered=false"],
    # DeepSeek-V3's blocks with a multi-token module (its experts over ep, its logits)
    "dsv3-mtp-ep2-dp4": ["model.preset=tiny-dsv3", "model.mtp.depth=1", "parallelism.dp=4",
                         "parallelism.ep=2"],
    # ... beside tensor and sequence parallel: the modules' activations whole on each tp rank
    "dsv3-mtp-tp2-sp-dp2": ["model.preset=tiny-dsv3", "model.mtp.depth=1", "parallelism.tp=2",
                            "parallelism.sequence_parallel=true", "parallelism.dp=2"],
    # ... beside context parallel: the module on each rank's chunks, attending over the ring
    "dsv3-mtp-cp2-dp2": ["model.preset=tiny-dsv3", "model.mtp.depth=1", "parallelism.cp=2",
                         "parallelism.dp=2"],
    # ... beside both at once: the modules' inputs whole on each tp rank of a ring rank's part
    "dsv3-mtp-cp2-tp2-sp": ["model.preset=tiny-dsv3", "model.mtp.depth=1", "parallelism.cp=2",
                            "parallelism.tp=2", "parallelism.sequence_parallel=true"],
    # ... the ring moving the expanded keys and values (kept for backward) in the latents' place
    "dsv3-cp2-dp2-expanded": ["model.preset=tiny-dsv3", "parallelism.cp=2", "parallelism.dp=2",
                              "parallelism.cp_latent=false"],
    # ... on two pipeline stages: the module, the head and a copy of the embedding on the last
    "dsv3-mtp-pp2-dp2": ["model.preset=tiny-dsv3", "model.mtp.depth=1", "parallelism.pp=2",
                         "parallelism.dp=2", "schedule.name=1f1b"],
}


@pytest.mark.timeout(600)
def test_planned_memory_matches_what_ranks_hold(rank_pool, tmp_path):
    """Parameter + gradient + optimizer shards within 10% of the prediction for every rank of
    every plan; the activations autograd saved within 25%; the host memory of an in-memory
    snapshot (``checkpoint.in_memory``) within 15% (on a model this small, DCP's framing of
    each tensor is a tenth of it and varies with the sharding)."""
    data_dir = str(ensure_tiny_corpus(tmp_path / "data"))
    topo = Topology.uniform(1, 4, "cpu")
    failures = []
    for i, (name, extra) in enumerate(PLANS.items()):
        spec = load_spec(None, [*BASE, *extra, f"runtime.output_dir={tmp_path}",
                                "checkpoint.in_memory.every=1"])

        def snapshot(group, reports, i=i) -> None:  # (named above what the processes hold)
            snaps = group.memory_snapshot(f"{next_generation(group):04d}-{i:08d}", [None] * 4, wait=True)
            for r, snap in zip(reports, snaps, strict=True):
                r["snapshot"], r["staged"] = snap["files_bytes"], snap["bytes"]

        for row in _planned_and_measured(rank_pool, spec, topo, data_dir, snapshot):
            p = row["predicted"]
            state = row["params_gib"] + row["grads_gib"] + row["optimizer_gib"]
            planned = p["params"] * 4  # after the step, gradients are sharded like params
            if abs(state / planned - 1) > 0.10:
                failures.append(f"{name} rank {row['rank']}: state {state * GIB:.0f} B, "
                                f"planned {planned * GIB:.0f} B")
            if abs(row["activations_gib"] / p["activations"] - 1) > 0.25:
                failures.append(f"{name} rank {row['rank']}: activations "
                                f"{row['activations_gib'] * GIB:.0f} B, planned "
                                f"{p['activations'] * GIB:.0f} B")
            host = row["snapshot_host_gib"]
            if abs(host["measured"] / host["predicted"] - 1) > 0.15:  # DCP's framing varies
                failures.append(f"{name} rank {row['rank']}: snapshot + copy {host['measured']:.4f} "
                                f"GiB, planned {host['predicted']:.4f} GiB")
    assert not failures, "\n".join(failures)


def _planned_and_measured(rank_pool, spec, topo, data_dir: str, after=None) -> list[dict]:
    """``spec`` planned on ``topo``, built on the pool's ranks as planned and stepped once
    (activations counted); ``after(group, reports)`` adds to the reports; each rank's
    measured bytes beside the plan's (``memory_rows``)."""
    dims, result = plan_job(spec, topo)
    eff = effective_spec(spec, result.best.candidate)
    group = rank_pool.group_for(eff, dims)
    try:
        group.build(eff.model_dump_json(), dims, data_dir)
        group.train_step(measure_activations=True)
        reports = group.memory_reports()
        if after is not None:
            after(group, reports)
    finally:
        rank_pool.release(group)
    return memory_rows(reports, eff, result.best.candidate, dims, device_spec("cpu"), stepped=True)


@pytest.mark.timeout(300)
def test_context_parallel_divides_activations_as_planned(rank_pool, tmp_path):
    """At the same 256-token sequence, cp 4 saves about a quarter of the activations that
    cp 1 does (each rank holds 2 of its 8 chunks), and each within 10% of its plan."""
    data_dir = str(ensure_tiny_corpus(tmp_path / "data"))
    topo = Topology.uniform(1, 4, "cpu")
    measured = {}
    for name, extra in {"cp4-ring": ["parallelism.cp=4"], "cp1-dp4": ["parallelism.dp=4"],
                        "cp2-dp2-allgather": ["parallelism.cp=2", "parallelism.dp=2",
                                              "parallelism.cp_mode=allgather"]}.items():
        spec = load_spec(None, [*BASE, *extra, "training.seq_len=256",
                                f"runtime.output_dir={tmp_path}"])
        rows = _planned_and_measured(rank_pool, spec, topo, data_dir)
        assert ("cp=" in rows[0]["mesh"]) == ("cp" in name[:2] and name[2] != "1"), rows[0]["mesh"]
        for row in rows:
            got, planned = row["activations_gib"], row["predicted"]["activations"]
            assert abs(got / planned - 1) <= 0.10, (name, row["rank"], got * GIB, planned * GIB)
        measured[name] = max(row["activations_gib"] for row in rows)
    assert 0.2 <= measured["cp4-ring"] / measured["cp1-dp4"] <= 0.3, measured
    assert 0.4 <= measured["cp2-dp2-allgather"] / measured["cp1-dp4"] <= 0.6, measured


@pytest.mark.timeout(600)
def test_dry_run_builds_a_1b_model_over_4_ranks_in_a_fraction_of_its_size(ray_local, tmp_path):
    """The meta build: no rank ever holds the whole model. 1b in fp32 is 4.6 GiB; each of 4
    ZeRO-3 ranks holds a quarter of it, and its peak RSS stays far below the whole."""
    spec = load_spec(None, ["model.preset=1b", "parallelism.dp=4", "training.seq_len=128",
                            "training.microbatch_size=1", "training.global_batch_size=4",
                            "topology.memory_gib=16", "tracking.enabled=false",
                            "runtime.device=cpu", f"runtime.output_dir={tmp_path}"])
    full_gib = 4 * num_params(spec.model) / GIB  # fp32, 1,235,814,400 parameters
    rows = dry_run_job(spec, {}, step=False)
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        assert r["params_gib"] == pytest.approx(full_gib / 4, rel=0.01)
        assert r["params_gib"] == pytest.approx(r["predicted"]["params"], rel=0.01)
        assert r["measured_peak_gib"] < 0.5 * full_gib, r
        assert r["grads_gib"] == r["optimizer_gib"] == 0  # nothing before the first step


def test_step_and_json_without_dry_run_are_refused(capsys):
    from trainmesh.cli.main import main

    assert main(["run", "jobs/tiny-cpu.yaml", "--step"]) == 2
    err = capsys.readouterr().err
    assert "--dry-run" in err and "Traceback" not in err


def test_snapshots_that_do_not_fit_in_host_memory_are_refused_with_the_numbers():
    from trainmesh.planning.job_plan import PlanError, plan_for

    args = ["model.preset=8b", "parallelism.tp=8", "parallelism.dp=2", "training.seq_len=1024",
            "training.microbatch_size=1", "training.global_batch_size=16", "checkpoint.in_memory.every=10"]
    topo = Topology.uniform(2, 8, "h100")
    with pytest.raises(PlanError) as err:
        plan_for(load_spec(None, args), topo.with_host_memory(64), replan=False)
    # 8.03e9 parameters over tp 8 × dp 2: 0.50e9 each, 12 B apiece, seven times at the peak
    # (own two and one being written, a buddy's two and one arriving, the host copy)
    assert "checkpoint.in_memory: snapshots need 314.5 GiB of host memory per node (39.31 GiB " \
           "per rank" in str(err.value) and "× 8 ranks) but a node has 64.0 GiB" in str(err.value)
    assert plan_for(load_spec(None, args), topo.with_host_memory(320), replan=False).dims.world_size == 16
    plan_for(load_spec(None, args[:-1]), topo.with_host_memory(64), replan=False)  # tier off: fine


def test_the_dry_run_table_uses_a_unit_that_fits_its_numbers():
    """A tiny model's figures in MiB (0.001 GiB says nothing); a big one's in GiB."""
    from trainmesh.controller.dry_run import format_rows

    def row(gib: float) -> dict:
        return {"rank": 0, "node": "n0", "pp_rank": 0, "params_gib": gib, "grads_gib": gib,
                "optimizer_gib": 2 * gib, "activations_gib": gib, "measured_peak_gib": 0.46,
                "predicted_gib": 0.65, "predicted": {k: gib for k in (
                    "params", "grads", "optimizer", "gathered", "activations", "framework")}}

    tiny = format_rows([row(0.0012)], stepped=False)
    assert "(MiB; built, no step)" in tiny and "     1.2 " in tiny and "471.0" in tiny
    big = format_rows([row(4.25)], stepped=True)
    assert "(GiB; after one step)" in big and "4.250" in big


def test_latent_attention_activations_count_every_heads_keys_and_values_and_the_latents():
    """Multi-head Latent Attention saves the query, every head's expanded key (the shared
    rotary key in each) and value and the attention's output — split by tp — and the latents
    with their norms' outputs, which every tp rank holds whole (DeepSeek-V3: 11.4 + 0.58 units
    of the width per token, against grouped-query attention's 5 at the same width)."""
    from trainmesh.cli.loading import load_spec
    from trainmesh.planning.memory_model import activation_units, mla_activation_units

    dsv3 = load_spec(None, ["model.preset=deepseek-v3-671b"]).model
    heads, latent = mla_activation_units(dsv3)
    assert heads == pytest.approx((2 * 128 * 192 + 2 * 128 * 128) / 7168)
    assert latent == pytest.approx((2 * 1536 + 2 * 512 + 64) / 7168)
    gqa = dsv3.model_copy(update={"mla": None, "n_kv_heads": 128})
    for tp, sp in ((1, False), (8, False), (8, True)):
        got = activation_units(dsv3, tp, sp, "none")
        want = activation_units(gqa, tp, sp, "none") + (heads - 5.0) / tp + latent
        assert got == pytest.approx(want), (tp, sp)


def test_uneven_stages_are_planned_for_the_rank_holding_the_most_blocks():
    """Where pp × vpp do not divide the blocks, the middle ranks hold the extra ones: a rank's
    parameters count its own chunks' blocks (interleaved too), and the memory checked against
    the device is the heaviest rank's of all (DeepSeek-V3 at pp 32: rank 2, the first with two
    MoE blocks, not the first or the last)."""
    from trainmesh.cli.loading import load_spec
    from trainmesh.planning.candidate import Candidate
    from trainmesh.planning.memory_model import memory_bytes, rank_memory
    from trainmesh.planning.stage_params import _block_parts, rank_params

    m = load_spec(None, ["model.preset=tiny", "model.n_layers=5"]).model
    t = _block_parts(m, 0)[0]
    V, d = m.vocab_size, m.dim
    # 5 blocks over pp 2 × vpp 2: stages 1, 2, 1, 1; rank 0 holds stages 0 and 2, rank 1 1 and 3
    assert rank_params(m, 2, 0, "interleaved-1f1b", 2).tp_sharded == 2 * t + V * d
    assert rank_params(m, 2, 1, "interleaved-1f1b", 2).tp_sharded == 3 * t + V * d
    dsv3 = load_spec(None, ["model.preset=deepseek-v3-671b"]).model
    c = Candidate(tp=2, pp=32, dp=32, vpp=1, schedule="1f1b", microbatch_size=1,
                  num_microbatches=480, recompute="selective", sequence_parallel=True, ep=4)
    every = [rank_memory(dsv3, c, 4096, r).total for r in range(32)]
    assert memory_bytes(dsv3, c, 4096) == max(every) and max(every) > max(every[0], every[-1])
    assert min(rank_memory(dsv3, c, 4096, r).gathered for r in range(32)) > 0


@pytest.mark.parametrize("pp,vpp,schedule", [(1, 1, "1f1b"), (2, 1, "1f1b"), (4, 1, "1f1b"),
                                              (2, 2, "interleaved-1f1b"), (2, 2, "zbv")])
def test_each_pipeline_ranks_counted_parameters_are_the_ones_it_builds(pp, vpp, schedule):
    """DeepSeek-V3's blocks with two multi-token modules: what the cost model counts for each
    pipeline rank (its dense and MoE blocks, the embedding on the first, the head, the modules
    and a copy of the embedding on the last: the rank's Llama's without the first stage, the
    engine's own beside it under a V schedule) is what the rank builds."""
    import torch

    from trainmesh.models.llama.model import LlamaArgs
    from trainmesh.models.llama.stage import rank_model
    from trainmesh.planning.stage_params import holds_head, rank_params

    v = schedule == "zbv"  # (a V: stages of equal size, 8 blocks over 4)
    m = load_spec(None, ["model.preset=tiny-dsv3", "model.mtp.depth=2",
                         f"model.n_layers={8 if v else 6}", "runtime.device=cpu"]).model
    for r in range(pp):
        with torch.device("meta"):
            built, _ = rank_model(LlamaArgs.from_config(m, "cpu"), r, pp, vpp,
                                  [r, 2 * pp - 1 - r] if v else None)
        rp = rank_params(m, pp, r, schedule, vpp)
        both = v and r == 0  # (the V's rank 0: the engine's copy for the modules, LocalCopy)
        assert rp.tp_sharded + rp.replicated + rp.experts == sum(
            p.numel() for p in built.parameters()) + (m.vocab_size * m.dim if both else 0), (r, rp)
        assert rp.mtp_modules == (2 if holds_head(schedule, pp, r) else 0)


@pytest.mark.parametrize("preset", ["tiny-dsv3", "tiny-moe", "tiny"])
def test_a_blocks_tp_split_and_whole_parameters_are_the_tensor_parallel_plans(preset):
    """What the cost model counts as split over tp and as whole on every tp rank in a block is
    what the TP plan splits: the modules it names (column- and row-wise) against the rest
    (norms, Multi-head Latent Attention's latent projections and their norms, per-head q/k
    norms, an MoE block's router, experts and shared expert)."""
    import torch
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from trainmesh.engine.engine import build_model
    from trainmesh.models.llama.parallelize import block_plan
    from trainmesh.planning.stage_params import _block_parts

    qk_norm = [] if preset == "tiny-dsv3" else ["model.qk_norm=true"]  # (Qwen3's q/k norms)
    spec = load_spec(None, [f"model.preset={preset}", *qk_norm, "runtime.device=cpu"])
    model = build_model(spec, torch.device("cpu"))
    args = spec.model
    for i in (0, args.n_layers - 1):  # (DeepSeek-V3's: a dense block and an MoE one)
        block = model.layers[str(i)]
        split = {name for name, style in block_plan(args, block, Replicate(), True).items()
                 if isinstance(style, ColwiseParallel | RowwiseParallel)}
        experts = sum(p.numel() for n, p in block.named_parameters()
                      if n.startswith("feed_forward.experts."))
        sharded = sum(p.numel() for n, p in block.named_parameters()
                      if n.rsplit(".", 1)[0] in split)
        whole = sum(p.numel() for p in block.parameters()) - sharded - experts
        assert _block_parts(args, i) == (sharded, whole, experts), (preset, i)
