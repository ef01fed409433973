"""The demo job end to end through the CLI, read back from MLflow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiers import everyday

pytestmark = [pytest.mark.cluster,  # every test here starts Ray,
              pytest.mark.ray_apart]  # only in processes of its own

REPO = Path(__file__).resolve().parents[1]


def _readme_commands_on_the_demo() -> list[list[str]]:
    """The README's commands that read the demo's run (its spec's checkpoint, its directory),
    in the README's order, as a user types them after ``make demo``."""
    from test_docs import _commands

    found = []
    for word in ("eval", "export"):
        found += [[word, *argv] for argv in _commands(word)
                  if argv and argv[0] in ("jobs/tiny-cpu.yaml", "runs/tiny-cpu")]
    text = (REPO / "README.md").read_text()
    return sorted(found, key=lambda argv: text.index(f"trainmesh {' '.join(argv[:2])}"))


def _trainmesh(argv: list[str], cwd: Path, env: dict, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainmesh.cli.main", *argv],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, dict, subprocess.CompletedProcess]:
    """``make demo``'s run, once for the module, as it runs it: from a directory holding the
    repository's jobs/, so the run lands in runs/tiny-cpu there. (directory, environment,
    the finished process)"""
    root = tmp_path_factory.mktemp("demo")
    (root / "jobs").symlink_to(REPO / "jobs")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return root, env, _trainmesh(["run", "jobs/tiny-cpu.yaml", "--no-progress"], root, env, 380)


@pytest.mark.timeout(500)
@everyday("the demo: the README's first command, through the CLI, read back from MLflow, "
          "then the README's commands on its run (eval, export) in order")
def test_demo_job_through_cli_lands_in_mlflow(demo, tmp_path):
    root, env, proc = demo
    out = root / "runs" / "tiny-cpu"
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    # Ray's start-up notice (token authentication on, its default) is not trainmesh's output.
    assert "Token authentication" not in proc.stderr and "RAY_AUTH_MODE" not in proc.stderr
    final = proc.stdout.strip().splitlines()[-1]
    assert final.startswith("done: 150 steps, final loss ") and ", held-out loss " in final, final

    summary = json.loads((out / "summary.json").read_text())
    for key in ("name", "steps_done", "losses", "final_loss", "mesh", "checkpoints",
                "recoveries", "mlflow_run_id", "tracking_uri"):
        assert key in summary, key
    assert summary["name"] == "tiny-cpu" and summary["steps_done"] == 150
    assert len(summary["losses"]) == 150 and summary["final_loss"] == summary["losses"][-1]
    assert summary["mesh"] == {"pp": 1, "dp": 2, "tp": 1, "vpp": 1, "world_size": 2}
    assert summary["tracking_uri"] == f"sqlite:///{out / 'mlflow.db'}"
    # keep_last: 2 of the saves at 50, 100, 150
    assert [Path(c).name for c in summary["checkpoints"]] == ["step-000100", "step-000150"]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=summary["tracking_uri"])
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["parallelism.dp"] == "2"
    assert run.data.params["model.dim"] == "64"
    history = client.get_metric_history(run.info.run_id, "loss")
    losses = [m.value for m in sorted(history, key=lambda m: m.step)]
    assert len(losses) == 150
    assert losses == pytest.approx(summary["losses"])
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.5 * first, (first, last)  # it visibly learns
    for name in ("lr", "grad_norm", "tokens_per_s", "tokens_per_s_per_gpu", "step_time_s", "mfu"):
        assert len(client.get_metric_history(run.info.run_id, name)) == 150, name
    # every rank's breakdown at each segment's last step: the boundaries (the first step, the
    # checkpoints and evaluations at 50, 100, 150; a background save's end ends one too)
    assert summary["control"]["steps"] == 150
    for name in ("step/compute_s", "step/data_s", "step/comm_s", "step/compute_s_max",
                 "memory/peak_gib_max", "rank1/compute_s"):
        steps = [m.step for m in client.get_metric_history(run.info.run_id, name)]
        assert {1, 50, 100, 150} <= set(steps) and len(steps) == summary["control"]["segments"], name
    # Where each rank's last step went (its parts add up to the step), in summary.json
    for r in summary["step_breakdown"]["ranks"]:
        parts = r["data_s"] + r["compute_s"] + r["comm_s"] + r["bubble_s"]
        assert parts == pytest.approx(r["step_s"], rel=1e-6) and r["compute_s"] > 0, r
    # Held-out loss every 50 steps, in MLflow and the summary; it falls as training goes on.
    evals = sorted(client.get_metric_history(run.info.run_id, "eval_loss"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in evals] == [(e["step"], e["loss"]) for e in summary["eval"]]
    assert [m.step for m in evals] == [50, 100, 150] and evals[-1].value < evals[0].value
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"spec.json", "mesh.json", "summary.json", "events.json"} <= artifacts
    events = json.loads(Path(client.download_artifacts(run.info.run_id, "events.json", str(tmp_path)))
                        .read_text())
    saves = {e["step"]: e for e in events if e["kind"] == "checkpoint"}
    assert sorted(saves) == [50, 100, 150]
    # The demo saves in the background (the final save waits: nothing is left to overlap).
    assert saves[50]["background"] and saves[100]["background"] and not saves[150]["background"]

    # The README's next command, as a new user types it after the demo: fewer steps than the
    # demo's checkpoint holds. It says so at once (no rank started), names the ways out and
    # trains nothing.
    again = _trainmesh(["run", "jobs/tiny-cpu.yaml", "--set", "training.steps=20", "--no-progress"],
                       root, env, 300)
    assert again.returncode == 2, again.stderr[-3000:]
    assert ("training.steps: 20, but its newest checkpoint is at step 150: nothing to train"
            in again.stderr)
    assert "Ray" not in again.stderr  # nothing started
    # (not resume=never: a directory holding an earlier run's checkpoints is refused under it)
    assert "another runtime.output_dir" in again.stderr and "done:" not in again.stdout

    # The README's commands on the demo's run, in its order, each as written there: the
    # held-out loss of the newest checkpoint (the run's own last evaluation), then its export.
    commands = _readme_commands_on_the_demo()
    assert [argv[0] for argv in commands] == ["eval", "export"], commands
    for argv in commands:
        done = _trainmesh(argv, root, env, 300)
        assert done.returncode == 0, (argv, done.stderr[-3000:])
        assert "Traceback" not in done.stderr
        if argv[0] == "eval":
            line = done.stdout.strip().splitlines()[-1]
            assert line.startswith("eval loss ") and "(step 150)" in line, line
            # (printed to 4 decimals)
            assert float(line.split()[2]) == pytest.approx(summary["eval"][-1]["loss"], abs=2e-4)
        else:
            hf = root / argv[argv.index("--hf") + 1]
            assert "exported step 150" in done.stdout, done.stdout
            assert (hf / "config.json").is_file() and list(hf.glob("*.safetensors"))


@pytest.mark.timeout(600)
def test_the_readmes_run_examples_each_train_after_the_demo_in_order(demo):
    """The README's ``trainmesh run`` examples, as a user types them after ``make demo`` (its
    run complete in runs/tiny-cpu), in the README's order, in the demo's directory: each
    trains to its end in a run of its own (none refused for another's complete run)."""
    from test_docs import _commands

    from trainmesh.cli.loading import load_spec

    root, env, proc = demo
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = [argv for argv in _commands("run", pages=[REPO / "README.md"])  # (in its order)
            if argv[0].startswith("jobs/")]
    assert len(runs) >= 4, runs
    outputs = set()
    for argv in runs:
        done = _trainmesh(["run", *argv], root, env, 300)
        assert done.returncode == 0, (argv, done.stderr[-3000:])
        assert "Traceback" not in done.stderr
        spec = load_spec(str(root / argv[0]), [argv[i + 1] for i, a in enumerate(argv) if a == "--set"])
        final = done.stdout.strip().splitlines()[-1]
        assert final.startswith(f"done: {spec.training.steps} steps, final loss "), (argv, final)
        out = root / spec.resolved_output_dir()
        summary = json.loads((out / "summary.json").read_text())
        assert summary["name"] == spec.name and summary["steps_done"] == spec.training.steps
        outputs.add(out.resolve())
    assert len(outputs) == len(runs) and (root / "runs" / "tiny-cpu").resolve() not in outputs
