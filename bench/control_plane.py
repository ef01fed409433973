"""The control plane with hundreds of rank actors: the real controller, the real Ray rank actors
and the real control protocol, each rank's engine a stand-in that does no torch work and sleeps
a fixed step time (``trainmesh/testing/standin.py``: what it stands in for and what not), on
simulated nodes of 8 accelerators (``ray.cluster_utils.Cluster``) on this one machine.

    .venv/bin/python bench/control_plane.py [--ranks 8,32,128] [--step-s 0.1] [--steps 40]
                                            [--no-kill] [--long 600]

Per rank count, one job of --steps steps (a checkpoint at the middle step, an in-memory
snapshot every 10 steps): the controller's CPU seconds per step over its training loop (its
thread's), controller → rank calls per rank per step (every call each rank received, counted
by the rank), start → first step (and the controller thread's CPU seconds in it), each
checkpoint's and snapshot's coordination (the controller's call: the ranks' writes are a few
bytes here); then, unless --no-kill, a second
job in which one rank's process exits mid-run: its death → the first step on the new mesh
(orchestration only) and the controller thread's CPU seconds in it; then,
with --long N, a job of N steps with no checkpoint and no
snapshot, whose only boundaries are the segments' own: the controller's CPU per step amortised
over a long run (the segments stretched so that a boundary is at most 1% of one). Then the
slope of each against the ranks (least squares over the rank counts, per rank added).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the cluster helper
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("RAY_enable_metrics_collection", "0")


def job(ranks: int, step_s: float, steps: int, out: Path, kill: bool, saves: bool = True) -> dict:
    from trainmesh.cli.loading import load_spec
    from trainmesh.controller.launch import run_job
    from trainmesh.testing.faults import FaultyRank, fault_run
    from trainmesh.testing.standin import CALLS_DIR_ENV, STEP_S_ENV, StandInRank, counting

    calls = out / "calls"
    calls.mkdir(parents=True)
    spec = load_spec(None, [
        "model.preset=tiny", f"training.global_batch_size={max(8, ranks)}",
        "training.microbatch_size=1", "training.seq_len=32", "runtime.device=auto",
        "runtime.cpus_per_rank=0.01", f"parallelism.dp={ranks}", f"training.steps={steps}",
        f"checkpoint.every={steps // 2 if saves else 0}", "checkpoint.save_final=false",
        "checkpoint.async_save=false", f"checkpoint.in_memory.every={10 if saves else 0}",
        "tracking.enabled=false",
        "elastic.ready_ranks_per_node=0", "elastic.max_restarts=3",
        # (the group forms once every rank process has started: here they start one after
        # another on 2 cores, ~5 s each, past the default bound at 64 ranks)
        f"runtime.collective_timeout_s={max(120, 6 * ranks)}",
        f"elastic.min_world_size={max(1, ranks - 8)}", f"runtime.output_dir={out / 'run'}"])
    env = {STEP_S_ENV: str(step_s), CALLS_DIR_ENV: str(calls)}
    if kill:  # rank 1 (the first node) exits as step steps/2 + 5 begins: warm on the survivors
        run = fault_run(f"exit@rank=1,step={steps // 2 + 4},phase=forward,marker={out / 'fired'}")
        cls = type("FaultyStandIn", (FaultyRank, StandInRank), {})
        s = run_job(spec, environ={}, show_progress=False, rank_cls=cls,
                    job_env={**env, **run["job_env"]})
    else:
        s = run_job(spec, environ={}, show_progress=False, rank_cls=counting(StandInRank), job_env=env)
    s["calls"] = [json.loads(p.read_text()) for p in calls.glob("calls-*.json")]
    return s


def cluster_of(ranks: int):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=False, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "include_log_monitor": False,
        "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}})
    for _ in range(max(1, ranks // 8)):
        cluster.add_node(num_cpus=8, num_gpus=min(8, ranks))
    cluster.wait_for_nodes()
    return cluster


def settled(timeout_s: float = 600.0) -> None:
    """Wait until every accelerator of the cluster is free again: a job's rank processes exit
    after it returns, and the next job's could not all start beside them (128 ranks, 2 cores)."""
    import ray

    total = ray.cluster_resources().get("GPU", 0)
    end = time.monotonic() + timeout_s
    while ray.available_resources().get("GPU", 0) < total and time.monotonic() < end:
        time.sleep(1.0)


def slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.mean(xs), statistics.mean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def main() -> None:
    import ray

    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="8,32,128")
    ap.add_argument("--step-s", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--no-kill", action="store_true")
    ap.add_argument("--long", type=int, default=0, help="steps of a job without saves (0: none)")
    args = ap.parse_args()
    rows = []
    for n in (int(r) for r in args.ranks.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            cluster = cluster_of(n)
            try:
                ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
                t0 = time.monotonic()
                s = job(n, args.step_s, args.steps, Path(tmp) / "a", kill=False)
                wall = time.monotonic() - t0
                c = s["control"]
                print(json.dumps({"ranks": n, "control": c, "job_wall_s": wall,
                                  "calls": [x["calls"] for x in s["calls"][:2]]}), flush=True)
                rec = long = None
                if not args.no_kill:
                    settled()
                    k = job(n, args.step_s, args.steps, Path(tmp) / "b", kill=True)
                    rec = k["recoveries"][0] if k["recoveries"] else None
                if args.long:
                    settled()
                    long = job(n, args.step_s, args.long, Path(tmp) / "c", kill=False, saves=False)["control"]
            finally:
                ray.shutdown()
                cluster.shutdown()
        c = s["control"]
        per_rank = [sum(x["calls"].values()) for x in s["calls"]]
        row = {"ranks": n, "cpu_ms_per_step": 1e3 * c["cpu_s"] / c["steps"],
               "calls_per_rank_step": statistics.mean(per_rank) / c["steps"] if per_rank else None,
               "segments": c["segments"], "first_step_s": c["first_step_s"],
               "first_step_cpu_s": c.get("first_step_cpu_s"),
               "boundary_ms": 1e3 * statistics.median(c["boundary_cpu_s"]) if c["boundary_cpu_s"] else None,
               "save_s": statistics.median(c["save_s"]) if c["save_s"] else None,
               "snapshot_s": statistics.median(c["snapshot_s"]) if c["snapshot_s"] else None,
               "death_to_step_s": rec["downtime_s"] if rec else None,
               "recovery_cpu_s": rec.get("controller_cpu_s") if rec else None,
               "recovery_phases": rec["phases"] if rec else None, "job_wall_s": wall,
               "long_cpu_ms_per_step": 1e3 * long["cpu_s"] / long["steps"] if long else None,
               "long_segments": long["segments"] if long else None}
        rows.append(row)
        print(json.dumps(row), flush=True)

    def f(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    print(f"\nstand-in ranks, {args.step_s * 1e3:.0f} ms steps, {args.steps} steps, simulated "
          "nodes of 8 on one 2-core machine")
    print("\n| ranks | controller CPU ms / step | boundary CPU ms (per rank) | calls / rank / step | "
          "segments | start → first step s (controller CPU s) | checkpoint s | snapshot s | "
          f"death → step s (controller CPU s) | long job ({args.long} steps): CPU ms / step "
          "(segments) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        per = None if r["boundary_ms"] is None else r["boundary_ms"] / r["ranks"]
        print(f"| {r['ranks']} | {f(r['cpu_ms_per_step'], '{:.3f}')} | "
              f"{f(r['boundary_ms'])} ({f(per, '{:.3f}')}) | "
              f"{f(r['calls_per_rank_step'], '{:.3f}')} | {r['segments']} | "
              f"{f(r['first_step_s'])} ({f(r['first_step_cpu_s'])}) | {f(r['save_s'], '{:.3f}')} | "
              f"{f(r['snapshot_s'], '{:.3f}')} | {f(r['death_to_step_s'])} "
              f"({f(r['recovery_cpu_s'])}) | "
              f"{f(r['long_cpu_ms_per_step'], '{:.3f}')} ({r['long_segments'] or '-'}) |")
    if len(rows) > 1:
        xs = [r["ranks"] for r in rows]
        print("\nslope per rank added (least squares):")
        for key in ("cpu_ms_per_step", "boundary_ms", "first_step_s", "first_step_cpu_s",
                    "save_s", "snapshot_s", "death_to_step_s", "recovery_cpu_s",
                    "long_cpu_ms_per_step"):
            ys = [r[key] for r in rows]
            if all(y is not None for y in ys):  # (in ms: the seconds' keys scaled)
                scale = 1.0 if "ms" in key else 1e3
                print(f"  {key}: {slope(xs, ys) * scale:.4f} ms/rank")


if __name__ == "__main__":
    main()
