"""Goodput measured under sustained faults, beside what ``trainmesh goodput``'s simulator predicts
for the same job, costs and faults.

    .venv/bin/python bench/soak.py [--minutes 15] [--every-min 1,5] [--seed 0] [--replace-s 30]

A 3D job (tiny model, pp 2 × tp 2 × dp 2 = 8 ranks, 4 per node) runs on a simulated cluster
(ray.cluster_utils.Cluster: 2 nodes of 4 advertised GPUs and a spare, real ranks on gloo,
background checkpoints every 4 steps, the spec's default hang bound) while faults arrive at a
set mean interval (``--every-min``; exponential gaps), their kinds drawn from Llama 3's
interruption table (Meta, 2024; 419 unexpected interruptions in 54 days), grouped by what they
do to a job:

- node lost (~78%: GPU, HBM, SRAM, GPU processor, NIC, switch or cable, SSD, power, chassis,
  CPU, memory faults): its raylet and processes killed (``remove_node_hard``);
- rank process killed (~13%: software bugs, dependencies): SIGKILL, the node unharmed;
- rank hung (~3%: NCCL watchdog timeouts, silent data corruption): SIGSTOP;
- preemption notice (~8%: unplanned host maintenance): SIGTERM to a rank; the node is taken
  away 20 s later.

Every node lost, hung or taken away is replaced: a fresh node joins ``--replace-s`` later (the
job grows back onto it at a checkpoint). Faults are placed with the test-only fault hook
(``actors/progress.py``) at the step the mean interval gives from the uninterrupted step time,
on a rank present in every mesh (0-3).

Reported per fault rate: the wall time from the first step to the last; the measured
effective-training-time ratio (the steps kept × the uninterrupted step time / that wall time);
steps lost; recoveries by mode and cause; and, beside it, the simulator
(``planning/goodput.py``, strategy "trainmesh warm") replaying the same faults at the same
times on the same job: once with the costs it ships with (``failure_costs.MEASURED``) and a
node-level view of every fault, once calibrated from this soak (its measured phases, and the
kinds of fault as they happened). The soaked run's losses are checked against the single
process's (the uninterrupted run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("RAY_enable_metrics_collection", "0")  # see tests/conftest.py
os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the test harness

ARGS = ["model.preset=tiny", "training.global_batch_size=16", "training.microbatch_size=2",
        "training.seq_len=32", "optimizer.warmup_steps=1", "optimizer.lr=3e-4", "runtime.device=auto",
        "runtime.cpus_per_rank=0.25", "parallelism.pp=2", "parallelism.tp=2", "parallelism.dp=2",
        "schedule.name=1f1b", "checkpoint.every=4", "checkpoint.async_save=true",
        "checkpoint.keep_last=3", "elastic.max_restarts=10000", "elastic.max_world_size=8",
        "elastic.ready_ranks_per_node=2"]
GPUS_PER_NODE = 4
# Llama 3's unexpected interruptions grouped by what they do to a job (see the docstring)
MIX = {"node": 0.76, "process": 0.13, "hang": 0.03, "notice": 0.08}
HOOK = {"node": "wait", "process": "exit", "hang": "hang", "notice": "term"}
SIM_KIND = {"node": "crash", "process": "process", "hang": "hang", "notice": "notice"}
NOTICE_S = 20.0  # a notified node is taken away this long after its notice
# The losses' tolerance against the single process. float32 reductions run in another order on
# every mesh; at the spec's default learning rate (3e-3) the tiny model memorises its corpus and
# its trajectory amplifies that: two single-process runs that differ only in gradient
# accumulation order part by 1e-4 relative at step 23 and by 8% over 300 steps (an uninterrupted
# 3D run, by 12% over 1,000). At 3e-4 they stay within 6e-7 over 300 steps, so the soak trains at
# 3e-4 and a replayed or skipped batch shows.
RTOL = 1e-4


def _spec(out: Path, steps: int, extra: list[str] = ()):
    from trainmesh.cli.loading import load_spec

    return load_spec(None, [*ARGS, f"training.steps={steps}", f"runtime.output_dir={out}", *extra])


def _metric(summary: dict, name: str) -> list[float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(summary["tracking_uri"])
    return [m.value for m in client.get_metric_history(summary["mlflow_run_id"], name)]


def _events(summary: dict, tmp: Path) -> list[dict]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(summary["tracking_uri"])
    path = client.download_artifacts(summary["mlflow_run_id"], "events.json", str(tmp))
    return json.loads(Path(path).read_text())


def calibrate(cluster, tmp: Path) -> dict[int, float]:
    """The uninterrupted step time of the job's mesh on 2 nodes (8 ranks) and on 1 (4 ranks)."""
    from servers import job_in_background

    out = {}
    for world, extra in ((8, []), (4, ["parallelism.dp=1", "elastic.max_world_size=4"])):
        thread, box = job_in_background(_spec(tmp / f"calibrate-{world}", 12, extra), {})
        thread.join()
        if "error" in box:
            raise box["error"]
        out[world] = statistics.median(_metric(box["summary"], "step_time_s")[2:])
    return out


def draw_faults(rng: random.Random, every_s: float, step_s: float, steps: int) -> list[tuple]:
    """(step, kind, rank) of the faults of one soak: exponential gaps of mean ``every_s``,
    placed at the step the uninterrupted step time gives."""
    faults, t = [], 0.0
    while True:
        t += rng.expovariate(1 / every_s)
        step = 3 + int(t / step_s)
        if step >= steps - 2:
            return faults
        kind = rng.choices(list(MIX), list(MIX.values()))[0]
        if all(f[0] != step for f in faults):  # one fault per step
            faults.append((step, kind, rng.randrange(4)))


class Harness:
    """Acts on each fault as it fires (its marker appears), from the main thread (Ray adds and
    removes nodes from there only), and keeps the cluster at 3 nodes by replacing every node
    it loses ``replace_s`` later."""

    def __init__(self, cluster, replace_s: float):
        self.cluster, self.replace_s = cluster, replace_s
        self.todo: list[tuple[float, str, str | None]] = []  # (when, "remove" | "add", node)
        self.fired: list[dict] = []  # {"t", "kind"}

    def fire(self, kind: str, where: dict, t: float) -> None:
        node = where["node"]
        self.fired.append({"t": t, "kind": kind})
        if kind == "node":
            self._remove(node)
        elif kind == "hang":  # the job drops the frozen node; the machine is replaced
            self.todo.append((t + 2.0, "remove", node))
        elif kind == "notice":
            self.todo.append((t + NOTICE_S, "remove", node))

    def _remove(self, node: str) -> None:
        from servers import remove_node_hard

        if any(n.node_id == node for n in self.cluster.worker_nodes):
            remove_node_hard(self.cluster, node)
            self.todo.append((time.time() + self.replace_s, "add", None))

    def tick(self) -> None:
        now = time.time()
        for item in [x for x in self.todo if x[0] <= now]:
            self.todo.remove(item)
            _, what, arg = item
            if what == "remove":
                self._remove(arg)
            else:
                self.cluster.add_node(num_cpus=1, num_gpus=GPUS_PER_NODE)

    def settle(self) -> None:
        """Every pending replacement, now (the next soak starts with 3 nodes)."""
        for _, what, arg in list(self.todo):
            if what == "remove":
                self._remove(arg)
        for _, what, _ in list(self.todo):
            if what == "add":
                self.cluster.add_node(num_cpus=1, num_gpus=GPUS_PER_NODE)
        self.todo = []
        self.cluster.wait_for_nodes()


def soak(cluster, tmp: Path, every_min: float, minutes: float, step_s: dict[int, float],
         replace_s: float, seed: int) -> dict:
    from servers import job_in_background

    from trainmesh.testing.faults import fault_run

    steps = int(minutes * 60 * 0.85 / step_s[8])  # about ``minutes`` of wall time at ~85%
    faults = draw_faults(random.Random(seed), every_min * 60, step_s[8], steps)
    marks = {i: tmp / f"soak-{every_min}-fired-{i}" for i in range(len(faults))}
    env = ";".join(f"{HOOK[k]}@rank={r},step={s},phase=forward,marker={marks[i]}"
                   for i, (s, k, r) in enumerate(faults))
    spec = _spec(tmp / f"soak-{every_min}", steps)
    harness = Harness(cluster, replace_s)
    t_start = time.time()
    thread, box = job_in_background(spec, {}, **fault_run(env))
    seen: set[int] = set()
    while thread.is_alive():
        for i, path in marks.items():
            if i not in seen and path.exists() and path.read_text():
                seen.add(i)
                harness.fire(faults[i][1], json.loads(path.read_text()), path.stat().st_mtime)
        harness.tick()
        time.sleep(0.1)
    t_end = time.time()
    if "error" in box:
        raise box["error"]
    s = box["summary"]
    events = _events(s, tmp / f"events-{every_min}")
    t0 = next(e["time"] for e in events if e["kind"] == "start")  # the first step's start
    harness.settle()
    return {"every_min": every_min, "summary": s, "spec": spec, "t0": t0, "wall_s": t_end - t0,
            "job_wall_s": t_end - t_start, "fired": harness.fired, "planned": len(faults),
            "events": events}


def measured(run: dict, step_s: dict[int, float]) -> dict:
    s = run["summary"]
    recs = s["recoveries"]
    kept = s["steps_done"] * step_s[8]
    by = {}
    for r in recs:
        key = f"{r['mode']}: {r['cause'].split(',')[0].split('(')[0]}"
        by[key] = by.get(key, 0) + 1
    times = _metric(s, "step_time_s")
    return {"goodput": kept / run["wall_s"], "steps": s["steps_done"],
            "step_s": statistics.median(times), "steps_s": sum(times),
            "downtime_s": sum(r["downtime_s"] for r in recs),
            "steps_lost": sum(r["steps_lost"] for r in recs), "recoveries": by,
            "faults": {k: sum(f["kind"] == k for f in run["fired"]) for k in MIX}}


def phases(runs: list[dict]) -> dict[str, float]:
    """Medians over every recovery of the soaks: what the calibrated simulator is given."""
    recs = [r for run in runs for r in run["summary"]["recoveries"]
            if r["cause"] not in ("scale-up", "preemption")]
    med = {k: statistics.median(r["phases"][k] for r in recs if k in r["phases"])
           for k in ("decide_s", "reform_s", "restore_s", "first_step_s")}
    return med


def simulated(run: dict, step_s: dict[int, float], calibrated: dict | None, replace_s: float,
              hang_s: float) -> float:
    """The simulator's goodput for this soak's job and faults: shipped costs and every fault a
    node-level crash or hang (``calibrated`` None), else the soak's own phase medians, its
    fault kinds and its steps' mean time: on 2 cores a background checkpoint's write and the
    ready processes refilled after a recovery slow the steps beside them, which the shipped
    model does not count (it charges a save only the time it blocks)."""
    from trainmesh.planning.failure_costs import MEASURED, MeshCosts
    from trainmesh.planning.goodput import Cluster, Fault, simulate

    s = run["summary"]
    blocked = _metric(s, "checkpoint_blocked_s")
    save_b = statistics.median(blocked) if blocked else 0.0
    m = MEASURED
    if calibrated is not None:
        m = dataclasses.replace(MEASURED, decide_s=calibrated["decide_s"],
                                warm_reform_s=calibrated["reform_s"],
                                cold_reform_s=calibrated["reform_s"],
                                warm_restore_s=calibrated["restore_s"],
                                first_step_s=calibrated["first_step_s"])

    slow = 1.0
    if calibrated is not None:  # the soak's own steps (every one it ran, checkpoints' and
        # refills' slow-downs included), against the uninterrupted median
        ran = s["steps_done"] + sum(r["steps_lost"] for r in s["recoveries"])
        slow = sum(_metric(s, "step_time_s")) / ran / step_s[8]

    def mesh(nodes: int) -> MeshCosts | None:
        if nodes < 1:
            return None
        world = 8 if nodes >= 2 else 4
        return MeshCosts(f"{world} ranks", world, min(nodes, 2), step_s[world] * slow, 1,
                         0.0, save_blocked_s=save_b, save_write_s=save_b * 2,
                         save_durable_s=save_b * 2, restore_s=m.warm_restore_s, restore_bytes_s=0.0,
                         warm_reform_s=m.warm_reform_s, cold_reform_s=m.cold_reform_s,
                         restart_s=m.restart_s)

    faults = sorted(
        (Fault(f["t"] - run["t0"], None,  # the job's own interruptions: a node of its mesh
               SIM_KIND[f["kind"]] if calibrated is not None else
               ("hang" if f["kind"] == "hang" else "crash"))
         for f in run["fired"] if f["t"] >= run["t0"]), key=lambda f: f.t)
    every = run["spec"].checkpoint.every
    out = simulate("trainmesh warm", Cluster(2, 1, replace_s=replace_s), faults, run["wall_s"],
                   mesh, lambda mc: every, run["spec"].runtime.collective_timeout_s, m=m,
                   hang_s=hang_s if calibrated is not None else None)
    # its useful time is valued at its first mesh's step time; the measured ratio at the
    # uninterrupted one's
    return out.goodput / slow


def losses_equal(run: dict, tmp: Path) -> tuple[bool, float, int | None]:
    """Whether the soaked run's losses are the single process's within ``RTOL``; the largest
    relative difference; the first step beyond it."""
    import torch
    from reference import reference_run

    s = run["summary"]
    data = str(Path(run["spec"].runtime.output_dir) / "data" / "tiny-corpus")
    want, _ = reference_run(run["spec"], data, steps=s["steps_done"])
    rel = ((torch.tensor(s["losses"]) - torch.tensor(want)).abs() / torch.tensor(want).abs())
    bad = (rel > RTOL).nonzero()
    return len(bad) == 0, float(rel.max()), (int(bad[0]) + 1 if len(bad) else None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=15.0, help="wall time of each soak")
    ap.add_argument("--every-min", default="1,5", help="mean minutes between faults, per soak")
    ap.add_argument("--replace-s", type=float, default=30.0, help="a lost node's replacement "
                    "joins this many seconds later")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import ray
    from ray.cluster_utils import Cluster

    from trainmesh.controller.ray_group import HANG_FLOOR_S, HANG_STEPS, hang_found_after_s

    runs = []
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        cluster = Cluster(initialize_head=True, connect=False,
                          head_node_args={"num_cpus": 1, "include_dashboard": False})
        try:
            for _ in range(3):
                cluster.add_node(num_cpus=1, num_gpus=GPUS_PER_NODE)
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
            step_s = calibrate(cluster, tmp)
            print(f"uninterrupted step: {step_s[8]:.3f} s on 8 ranks, {step_s[4]:.3f} s on 4",
                  flush=True)
            for i, every in enumerate(float(x) for x in args.every_min.split(",")):
                run = soak(cluster, tmp, every, args.minutes, step_s, args.replace_s, args.seed + i)
                run["equal"] = losses_equal(run, tmp)
                runs.append(run)
                print(f"soak every {every:g} min: {json.dumps(measured(run, step_s))}; losses "
                      f"equal, max rel diff, first step off: {run['equal']}; recoveries at steps "
                      f"{[(r['step'], r['cause'][:20]) for r in run['summary']['recoveries']]}",
                      flush=True)
        finally:
            ray.shutdown()
            cluster.shutdown()
        hang_s = hang_found_after_s(max(HANG_FLOOR_S, HANG_STEPS * step_s[8]))
        cal = phases(runs)
        print(f"\nmeasured recovery phases (medians over the soaks' failures): "
              f"{ {k: round(v, 2) for k, v in cal.items()} }")
        print("\n| mean fault interval | wall s | steps kept | steps lost | step s (median) | "
              "in steps s | recovering s | faults (node, process, hang, notice) | recoveries | "
              "measured goodput | simulated, shipped costs | simulated, calibrated | "
              "losses = single process |")
        print("|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---|")
        for run in runs:
            mm = measured(run, step_s)
            before = simulated(run, step_s, None, args.replace_s, hang_s)
            after = simulated(run, step_s, cal, args.replace_s, hang_s)
            f = mm["faults"]
            recs = ", ".join(f"{k} {v}" for k, v in sorted(mm["recoveries"].items()))
            print(f"| {run['every_min']:g} min | {run['wall_s']:.0f} | {mm['steps']} | "
                  f"{mm['steps_lost']} | {mm['step_s']:.2f} | {mm['steps_s']:.0f} | "
                  f"{mm['downtime_s']:.0f} | {f['node']}, {f['process']}, {f['hang']}, {f['notice']} "
                  f"({len(run['fired'])} of {run['planned']} fired) | {recs} | "
                  f"{mm['goodput']:.1%} | {before:.1%} ({(before - mm['goodput']) * 100:+.1f}) | "
                  f"{after:.1%} ({(after - mm['goodput']) * 100:+.1f}) | "
                  f"{'yes' if run['equal'][0] else 'NO'} (max rel diff {run['equal'][1]:.1e}) |")


if __name__ == "__main__":
    main()
