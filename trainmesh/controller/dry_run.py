"""``trainmesh run --dry-run``: what every rank really holds after building its part (and
after one step with ``--step``), next to what the planner predicted for it."""

from __future__ import annotations

from trainmesh.parallel.dims import Axis, ParallelDims
from trainmesh.planning.candidate import GIB, Candidate
from trainmesh.planning.devices import DeviceSpec
from trainmesh.planning.memory_model import rank_memory, snapshot_host_bytes, uses_fused_kernels
from trainmesh.spec.job import JobSpec


def memory_rows(reports: list[dict], spec: JobSpec, c: Candidate, dims: ParallelDims,
                device: DeviceSpec, stepped: bool) -> list[dict]:
    """One row per rank: measured bytes (from ``RankWorker.memory_report``) beside the cost
    model's prediction for that rank. Before any step a rank holds its parameter shards only
    (FSDP2 gathers lazily, optimizer state is created by the first step): that is what is
    predicted then."""
    tr = spec.training
    compute_bytes = 2 if tr.dtype == "bfloat16" else 4
    fused = uses_fused_kernels(spec.model.kernels, device.name, spec.model.compile)
    rows = []
    for r in reports:
        pp_rank = dims.coords(r["rank"])[Axis.PP]
        pred = rank_memory(spec.model, c, tr.seq_len, pp_rank, compute_bytes,
                           device.framework_gib * GIB, fused_head=fused)
        predicted = pred.total if stepped else pred.params + pred.framework
        rows.append({
            "rank": r["rank"], "node": r["node"], "device": r["device"], "pp_rank": pp_rank,
            "predicted_gib": predicted / GIB, "measured_peak_gib": r["peak"] / GIB,
            "params_gib": r["params"] / GIB, "grads_gib": r["grads"] / GIB,
            "optimizer_gib": r["optimizer"] / GIB, "activations_gib": r["activations"] / GIB,
            "predicted": pred.as_gib(), "mesh": plan_summary(c),
        })
        if spec.checkpoint.in_memory.every:  # host memory (snapshot_host_bytes): its peak,
            # from one snapshot's files and host copy as measured
            rows[-1]["snapshot_host_gib"] = {
                "predicted": snapshot_host_bytes(spec.model, c, pp_rank) / GIB,
                "measured": (6 * r["snapshot"] + r["staged"]) / GIB if "snapshot" in r else None}
    return rows


def plan_summary(c: Candidate) -> str:
    """The plan the ranks were built for, in one line."""
    cp = f" × cp={c.cp} ({c.cp_mode})" if c.cp > 1 else ""
    ep = f", ep={c.ep}" if c.ep > 1 else ""
    hsdp = f", hybrid sharding {c.dp_replicate}×{c.dp_shard}" if c.dp_replicate > 1 else ""
    rc = f"{c.recompute} every {c.recompute_stride}" if c.recompute == "selective" else c.recompute
    return (f"tp={c.tp} × pp={c.pp} × dp={c.dp}{cp}{ep}{hsdp}, vpp={c.vpp} {c.schedule}, "
            f"microbatch {c.microbatch_size} × {c.num_microbatches}, recompute {rc}, ZeRO-3 "
            f"{'keep gathered' if c.keep_gathered else 're-gather'}")


def format_rows(rows: list[dict], stepped: bool) -> str:
    """A table for people: one line per rank, in GiB, or MiB when every figure is below 1 GiB
    (a tiny model's 0.001 GiB says nothing)."""
    when = "after one step" if stepped else "built, no step"
    keys = ("params_gib", "grads_gib", "optimizer_gib", "activations_gib", "measured_peak_gib",
            "predicted_gib")
    small = all(r[k] < 1 for r in rows for k in keys)
    unit, scale, fmt = ("MiB", 1024.0, ".1f") if small else ("GiB", 1.0, ".3f")

    def v(x: float, width: int = 8) -> str:
        return f"{x * scale:>{width}{fmt}}"

    head = (f"{'rank':>4} {'node':<10} {'pp':>2} {'params':>8} {'grads':>8} {'optim':>8} "
            f"{'acts':>8} {'peak':>8} {'predicted':>9}  ({unit}; {when})")
    lines = [f"plan: {rows[0]['mesh']}"] if rows and "mesh" in rows[0] else []
    lines.append(head)
    for r in rows:
        p = r["predicted"]
        lines.append(f"{r['rank']:>4} {r['node'][:10]:<10} {r['pp_rank']:>2} "
                     f"{v(r['params_gib'])} {v(r['grads_gib'])} {v(r['optimizer_gib'])} "
                     f"{v(r['activations_gib'])} {v(r['measured_peak_gib'])} "
                     f"{v(r['predicted_gib'], 9)}")
        if r["rank"] == 0 and "snapshot_host_gib" in r:
            h = r["snapshot_host_gib"]
            got = "" if h["measured"] is None else f", measured {v(h['measured'], 0)}"
            lines.append("     host memory for in-memory snapshots (own three, a buddy's three, the host "
                         f"copy): predicted {v(h['predicted'], 0)}{got} {unit} per rank")
        if r["rank"] == 0:
            lines.append(f"     predicted for rank 0 ({unit}): params {v(p['params'], 0)}, grads "
                         f"{v(p['grads'], 0)}, optimizer {v(p['optimizer'], 0)}, gathered "
                         f"{v(p['gathered'], 0)}, activations {v(p['activations'], 0)}, framework "
                         f"{v(p['framework'], 0)}")
    return "\n".join(lines)


def measure(group, spec_json: str, dims, data_dir: str, step: bool) -> list[dict]:
    """Build every rank's part (and with ``step`` train: activations counted in a first step,
    which also creates the optimizer state; the peak of a second, without the counting
    hooks); each rank's memory report."""
    group.build(spec_json, dims, data_dir)
    if step:
        group.train_step(measure_activations=True)
        group.reset_peak_memory()
        group.train_step()
    reports = group.memory_reports()
    if step and JobSpec.model_validate_json(spec_json).checkpoint.in_memory.every:
        snaps = group.memory_snapshot("0000-00000000", [None] * len(reports), wait=True)
        for r, snap in zip(reports, snaps, strict=True):
            r["snapshot"], r["staged"] = snap["files_bytes"], snap["bytes"]
    return reports
