"""Every bad spec gets exit 2 and one line per problem naming its field; never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainmesh.cli.loading import load_spec
from trainmesh.cli.main import main

# (spec text, field path that must start a line of the error output)
BAD_SPECS = [
    ("model: {dimm: 64}", "model.dimm"),
    ("trainig: {steps: 5}", "trainig"),
    ("training: {stepz: 5}", "training.stepz"),
    ("training: {steps: many}", "training.steps"),
    ("training: {steps: 0}", "training.steps"),
    ("training: {steps: -3}", "training.steps"),
    ("training: {steps: 2.5}", "training.steps"),
    ("training: {global_batch_size: 0}", "training.global_batch_size"),
    ("training: {microbatch_size: 3, global_batch_size: 8}", "training.global_batch_size"),
    ("parallelism: {dp: 4, dp_replicate: 3}", "parallelism.dp_replicate"),
    # a share of 1 microbatch cannot fill 2 pipeline stages
    ("training: {global_batch_size: 8, microbatch_size: 2}\nparallelism: {dp: 4, pp: 2}",
     "parallelism.dp"),
    # beside expert parallel each shard group holds whole EP groups (of ep / cp replicas)
    ("model: {preset: tiny-moe}\nparallelism: {dp: 4, ep: 4, dp_replicate: 2}",
     "parallelism.dp_replicate"),
    ("model: {preset: tiny-moe}\ntraining: {seq_len: 64}\nparallelism: {dp: 4, cp: 2, ep: 4, "
     "dp_replicate: 4}", "parallelism.dp_replicate"),
    # dp need not divide the batch's microbatches, but may not exceed them
    ("training: {global_batch_size: 8, microbatch_size: 2}\nparallelism: {dp: 5}",
     "parallelism.dp"),
    # context parallel: 2·cp equal chunks; each rank's part split again over tp under SP;
    # an EP group holds whole rings; document masks need the tokens (no pipeline)
    ("training: {seq_len: 60}\nparallelism: {cp: 4}", "training.seq_len"),
    ("training: {seq_len: 36}\nparallelism: {cp: 2, tp: 4, sequence_parallel: true}\n"
     "model: {n_heads: 4, n_kv_heads: 4}", "training.seq_len"),
    ("model: {preset: tiny-moe}\nparallelism: {dp: 2, cp: 4, ep: 2}", "parallelism.ep"),
    ("data: {document_mask: true}\nparallelism: {pp: 2}", "data.document_mask"),
    # the two-hop expert dispatch runs its hops whole; a node holds at least one rank
    ("model: {preset: tiny-moe}\nparallelism: {dp: 2, ep: 2, ep_dispatch: relay, "
     "ep_overlap: true}", "parallelism.ep_dispatch"),
    ("parallelism: {ep_node_ranks: 0}", "parallelism.ep_node_ranks"),
    # ... and relays only over nodes holding as many of an EP group's ranks (3 a node: 3 + 1)
    ("model: {preset: tiny-moe}\nparallelism: {dp: 8, ep: 4, ep_dispatch: relay, "
     "ep_node_ranks: 3}", "parallelism.ep_dispatch"),
    # (only the second EP group uneven: nodes of 5, group 0 = ranks 0-3 on one node, group 1
    # = ranks 4-7 on 1 + 3)
    ("model: {preset: tiny-moe}\nparallelism: {dp: 8, ep: 4, ep_dispatch: relay, "
     "ep_node_ranks: 5}", "parallelism.ep_dispatch"),
    ("parallelism: {cp: 2, cp_mode: ulysses}", "parallelism.cp_mode"),
    ("training: {float8: tensorwise}\nparallelism: {tp: 2}", "training.float8"),
    ("training: {float8: mxfp8}", "training.float8"),
    ("training: {seq_len: 1}", "training.seq_len"),
    ("training: {seq_len: 4096}", "training.seq_len"),
    ("training: {dtype: float8}", "training.dtype"),
    ("training: {seed: -1}", "training.seed"),
    ("model: {preset: 13b}", "model.preset"),
    ("model: {n_heads: 4, n_kv_heads: 3}", "model.n_kv_heads"),
    ("model: {dim: 66, n_heads: 4}", "model.dim"),
    ("model: {vocab_size: 100}", "model.vocab_size"),
    ("model: {n_layers: 0}", "model.n_layers"),
    ("model: {preset: null, dim: 64}", "model"),
    ("model: 12", "model"),
    ("parallelism: {tp: 0}", "parallelism.tp"),
    ("parallelism: {tp: 3}", "parallelism.tp"),
    ("model: {vocab_size: 263}\nparallelism: {tp: 2}", "parallelism.tp"),  # vocab-parallel
    ("parallelism: {pp: 5}", "parallelism.pp"),  # stages beyond tiny's 4 blocks
    # an uneven split that does not add up to the blocks, or has not one count per stage
    ("parallelism: {pp: 2, stage_layers: [1, 2]}", "parallelism.stage_layers"),
    ("parallelism: {pp: 2, stage_layers: [2, 1, 1]}", "parallelism.stage_layers"),
    ("parallelism: {pp: 2, stage_layers: [4, 0]}", "parallelism.stage_layers.1"),
    # zbv's V with stages of unequal size
    ("model: {n_layers: 6}\nparallelism: {pp: 2, vpp: 2}\nschedule: {name: zbv}", "parallelism.pp"),
    ("parallelism: {vpp: 2}", "parallelism.vpp"),
    ("parallelism: {dp: two}", "parallelism.dp"),
    ("parallelism: manual", "parallelism"),
    ("schedule: {name: zigzag}", "schedule.name"),
    ("optimizer: {lr: 0}", "optimizer.lr"),
    ("optimizer: {beta2: 1.5}", "optimizer.beta2"),
    ("optimizer: {warmup_steps: 500}\ntraining: {steps: 10}", "optimizer.warmup_steps"),
    ("optimizer: {name: sgd}", "optimizer.name"),
    ("checkpoint: {every: -1}", "checkpoint.every"),
    ("checkpoint: {resume: always}", "checkpoint.resume"),
    ("checkpoint: {keep_last: 0}", "checkpoint.keep_last"),
    ("elastic: {min_world_size: 4, max_world_size: 2}", "elastic.min_world_size"),
    ("elastic: {min_world_size: 8}\nparallelism: {dp: 2}", "elastic.min_world_size"),
    ("tracking: {enabled: maybe}", "tracking.enabled"),
    ("runtime: {device: tpu}", "runtime.device"),
    ("runtime: {collective_timeout_s: 0}", "runtime.collective_timeout_s"),
    ("name: 'bad name with spaces'", "name"),
    ("- just\n- a list", "spec.yaml"),
    ("'just a string'", "spec.yaml"),
    ("", "spec.yaml"),
    ("model: {dim: [1, 2}", "spec.yaml"),
    ("training: {steps: 5}\ntraining: {steps: 6}", "spec.yaml"),  # a key given twice
    ("training: {steps: 5, steps: 6}", "spec.yaml"),
    ("a: " + "[" * 5000 + "]" * 5000, "spec.yaml"),  # nested past the parser's recursion
    ("parallelism: {pp: 2, vpp: 2}\nschedule: {name: 1f1b}", "schedule.name"),
]


@pytest.mark.parametrize(("text", "field"), BAD_SPECS, ids=[f for _, f in BAD_SPECS])
def test_bad_spec_exits_2_naming_the_field(tmp_path, capsys, text, field):
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    code = main(["validate", str(path)])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert lines, "no problem reported"
    name = str(path) if field == "spec.yaml" else field
    assert any(line.startswith(f"{name}: ") for line in lines), err
    assert all("; " in line for line in lines), err  # what is wrong; what to do
    assert "Traceback" not in err


def test_at_least_30_bad_specs():
    assert len(BAD_SPECS) >= 30


def test_unknown_key_suggests_the_closest(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text("training: {microbatch_sise: 2}")
    assert main(["validate", str(path)]) == 2
    assert "did you mean `microbatch_size`?" in capsys.readouterr().err


def test_missing_file_and_bad_override(tmp_path, capsys):
    assert main(["validate", str(tmp_path / "nope.yaml")]) == 2
    assert "file not found" in capsys.readouterr().err
    good = tmp_path / "g.yaml"
    good.write_text("name: ok")
    assert main(["validate", str(good), "--set", "training.steps"]) == 2
    assert "key.path=value" in capsys.readouterr().err
    assert main(["validate", str(good), "--set", "name.sub=3"]) == 2
    assert capsys.readouterr().err.startswith("name: ")


def test_several_problems_one_line_each(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text("training: {steps: 0, seq_len: 1}\nruntime: {device: tpu}")
    assert main(["validate", str(path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert sorted(line.split(":")[0] for line in lines) == [
        "runtime.device", "training.seq_len", "training.steps"]


def test_valid_spec_prints_resolved_yaml_with_overrides(capsys):
    assert main(["validate", "jobs/tiny-cpu.yaml", "--set", "training.steps=70",
                 "--set", "model.dim=128"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["training"]["steps"] == 70
    assert resolved["model"]["dim"] == 128  # explicit field beats the preset
    assert resolved["model"]["n_layers"] == 4  # the rest from the preset
    assert resolved["model"]["n_kv_heads"] == 2


@pytest.mark.parametrize("path", ["jobs/tiny-cpu.yaml", "jobs/tiny-3d-cpu.yaml",
                                  "jobs/small-gpu.yaml", "jobs/llama-70b.yaml"])
def test_shipped_specs_are_valid(path):
    load_spec(path)


def test_parallelism_auto_string():
    spec = load_spec(None, ["parallelism=auto"])
    assert spec.parallelism.auto


@pytest.mark.timed  # (its own time bounds: with the Ray tests under `make test`)
def test_cli_subprocess_never_tracebacks(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(": : :\n\t- [")
    proc = subprocess.run([sys.executable, "-m", "trainmesh.cli.main", "validate", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "not valid YAML" in proc.stderr


@pytest.mark.parametrize(("overrides", "field"), [
    (["parallelism.sequence_parallel=true"], "parallelism.sequence_parallel"),
    (["model.preset=1b", "parallelism.pp=2", "parallelism.dp=1"], "model.tie_embeddings"),
    (["model.preset=1b", "parallelism.tp=2", "parallelism.dp=1"], "model.tie_embeddings"),
    (["checkpoint.dir=nosuchfs://bucket/run"], "checkpoint.dir")])
def test_run_refuses_what_this_version_cannot_run(capsys, overrides, field):
    assert main(["run", "jobs/tiny-cpu.yaml", *(a for o in overrides for a in ("--set", o))]) == 2
    assert capsys.readouterr().err.startswith(f"{field}: ")


def test_duplicate_keys_name_both_lines(tmp_path, capsys):
    path = tmp_path / "spec.yaml"
    path.write_text("name: a\ntraining:\n  steps: 5\n  seed: 1\n  steps: 7\n")
    assert main(["validate", str(path)]) == 2
    assert "key 'steps' appears twice (lines 3 and 5)" in capsys.readouterr().err


def test_vpp_above_one_means_interleaved_unless_a_schedule_is_named():
    spec = load_spec(None, ["parallelism.pp=2", "parallelism.vpp=2"])
    assert spec.schedule.name == "interleaved-1f1b"
    assert load_spec(None, ["parallelism.pp=2"]).schedule.name == "1f1b"


BAD_COMMAND_LINES = [
    ["validate", "no/such/spec.yaml"],
    ["run", "jobs/tiny-cpu.yaml", "--step"],
    ["run", "jobs/tiny-cpu.yaml", "--set", "parallelism.pp=2", "--set", "schedule.name=gpipe",
     "--set", "parallelism.vpp=2"],
    ["plan", "jobs/tiny-cpu.yaml", "--nodes", "0"],
    ["plan", "jobs/llama-70b.yaml", "--nodes", "1", "--gpus-per-node", "8"],
    ["plan", "jobs/llama-70b.yaml", "--set", "parallelism.tp=6", "--nodes", "128"],
    ["plan", "jobs/llama-70b.yaml", "--set", "parallelism=auto", "--nodes", "1",
     "--set", "topology.memory_gib=4"],
    ["schedule", "--pp", "0", "--microbatches", "4"],
    ["schedule", "--pp", "2", "--vpp", "2", "--microbatches", "1"],
    ["k8s", "render", "jobs/tiny-cpu.yaml", "--set", "parallelism=auto"],
    ["k8s", "render", "jobs/llama-70b.yaml", "--gpus-per-node", "0"],
    ["submit", "jobs/tiny-cpu.yaml", "--set", "training.steps=-1", "--address", "http://127.0.0.1:9"],
    ["doctor", "jobs/tiny-cpu.yaml", "--set", "runtime.ray_adress=auto"],
]


@pytest.mark.parametrize("argv", BAD_COMMAND_LINES, ids=[" ".join(a[:3]) for a in BAD_COMMAND_LINES])
def test_bad_command_lines_get_a_few_plain_lines(argv, capsys):
    """Every refusal: a non-zero exit, one to three lines naming what is wrong — never empty,
    never a traceback, never a Python class path."""
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc != 0 and err, argv
    lines = err.splitlines()
    assert 1 <= len(lines) <= 3, lines
    assert "Traceback" not in err and "trainmesh." not in err and "Error:" not in err, err
    assert ": ;" not in err and not err.endswith(":"), err


@pytest.mark.parametrize("field", ["runtime.output_dir", "checkpoint.dir"])
def test_run_refuses_a_directory_it_cannot_create_in_one_line(tmp_path, capsys, field):
    """What only a run can see is refused as `validate` refuses a spec: one line naming the
    field and the fix, exit 2, no traceback — before any Ray or rank starts."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["run", "jobs/tiny-cpu.yaml", "--set", f"{field}={blocker}/out"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{field}: cannot create or write {blocker}/out")
    assert "--set " in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.timed  # (its own time bounds: with the Ray tests under `make test`)
def test_run_refuses_an_unreachable_ray_address_in_one_line_at_once(tmp_path, capsys):
    """Nothing listens on the port (one this test held and closed): refused in one line naming
    runtime.ray_address, without ray.init's minutes of retries."""
    import socket
    import time

    import ray

    # Not connected to any cluster, as a `trainmesh run` process starts (a process connected
    # to another is refused with its own message). The shared local instance is ended as the
    # modules with clusters of their own end it: those that share it run first (conftest).
    ray.shutdown()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    assert main(["run", "jobs/tiny-cpu.yaml", "--set", f"runtime.ray_address=127.0.0.1:{port}",
                 "--set", f"runtime.output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"runtime.ray_address: no Ray cluster reachable at '127.0.0.1:{port}'")
    assert "ray start --head" in err and len(err.strip().splitlines()) == 1
    # Not a speed figure: ray.init alone retries for over two minutes before it gives up.
    assert time.monotonic() - t0 < 30


JOBS = Path(__file__).resolve().parents[1] / "jobs"


@pytest.mark.parametrize("job", sorted(p.name for p in JOBS.glob("*.yaml")))
def test_every_shipped_job_spec_validates(job):
    """The specs under jobs/ (the README names them) load and pass every rule a run applies
    before it plans."""
    from trainmesh.controller.preflight import preflight_problems

    spec = load_spec(JOBS / job)
    assert spec.name and not [p for p in preflight_problems(spec) if p.path != "data.path"]


def test_validate_checks_a_local_dataset_naming_its_path_and_one_fix(tmp_path, capsys):
    """`validate` refuses what `run` would: a dataset that is not there (named, one fix), and a
    model vocabulary smaller than the dataset's."""
    missing = tmp_path / "nothing"
    assert main(["validate", "jobs/tiny-cpu.yaml", "--set", f"data.path={missing}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"data.path: {missing}: no dataset.json; prepare it with "
                   f"`trainmesh data prepare INPUTS --out {missing}`"), err
    from trainmesh.data.shards import ensure_tiny_corpus

    data = ensure_tiny_corpus(tmp_path / "data")
    assert main(["validate", "jobs/tiny-cpu.yaml", "--set", f"data.path={data}",
                 "--set", "model.vocab_size=64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("model.vocab_size: 64 is smaller than the") and str(data) in err


def test_any_dp_up_to_the_microbatches_is_valid(capsys):
    """dp 3 over 4 microbatches (shares 2, 1, 1) is accepted; dp 5 is refused with the fix."""
    assert main(["validate", "jobs/tiny-cpu.yaml", "--set", "parallelism.dp=3",
                 "--set", "training.global_batch_size=8", "--set", "training.microbatch_size=2"]) == 0
    capsys.readouterr()
    assert main(["validate", "jobs/tiny-cpu.yaml", "--set", "parallelism.dp=5",
                 "--set", "training.global_batch_size=8", "--set", "training.microbatch_size=2"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("parallelism.dp: dp=5 replicas but the global batch holds 4 microbatches")
    assert "use dp ≤ 4" in line


def test_a_bad_flag_is_one_line_naming_the_closest_value(capsys):
    """argparse's refusals are one line naming the command's help (not its usage block); an
    unknown device names the closest the planner knows (it was a traceback)."""
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "jobs/tiny-cpu.yaml", "--device", "h1000"])
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("trainmesh plan: argument --device: unknown device 'h1000'; "
                           "did you mean `h100`? known: a100-40gb, "), line
    assert line.endswith("(see `trainmesh plan --help`)")
    with pytest.raises(SystemExit) as exit_:
        main(["plann", "jobs/tiny-cpu.yaml"])
    assert exit_.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1


def test_an_unknown_choice_is_one_line_naming_the_closest(capsys):
    assert main(["validate", "jobs/tiny-cpu.yaml", "--set", "model.preset=tiny_moe"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "model.preset: unknown value 'tiny_moe'; did you mean `tiny-moe`?"]
    assert main(["validate", "jobs/tiny-cpu.yaml", "--set", "model.preset=zzz"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("model.preset: unknown value 'zzz'; use one of 'tiny', 'small'")


def test_doctors_writability_probe_leaves_no_directory_it_made_and_its_plan_names_ep(tmp_path):
    from trainmesh.cli.doctor import _writable, degrees
    from trainmesh.parallel.dims import ParallelDims

    found = _writable("checkpoints", str(tmp_path / "a" / "b" / "c"), "here", "fix")
    assert found.ok and not (tmp_path / "a").exists()  # (it left a/b/c behind)
    (tmp_path / "kept").mkdir()
    found = _writable("checkpoints", str(tmp_path / "kept"), "here", "fix")
    assert found.ok and (tmp_path / "kept").is_dir() and not any((tmp_path / "kept").iterdir())
    assert degrees(ParallelDims(tp=2, dp=2, ep=2)) == "tp=2 pp=1 dp=2 ep=2"
    assert degrees(ParallelDims(dp=4, cp=2)) == "tp=1 pp=1 dp=4 cp=2"
