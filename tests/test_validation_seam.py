"""One validation entry point (``spec.validate.problems``): the CLI, ``run_job``, the controller
and every planner candidate apply the same rules, so that a layout the planner returns is never
refused when the same spec pins it, and a refused pinned layout is never returned."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

from trainmesh.cli.loading import load_spec
from trainmesh.planning.job_plan import PlanError, effective_spec, plan_job
from trainmesh.planning.topology import Topology
from trainmesh.spec.problems import SpecError
from trainmesh.spec.validate import Layout, problems

PKG = Path(__file__).resolve().parents[1] / "trainmesh"
LAYOUT_FIELDS = ("tp", "pp", "dp", "cp", "ep", "vpp", "dp_replicate", "schedule",
                 "sequence_parallel", "microbatch_size")


def _draw_spec(rng: random.Random):
    """A random small job under ``parallelism: auto`` (or None when its fields already clash)."""
    moe = rng.random() < 0.4
    heads = rng.choice([2, 4, 6, 8])
    kv = rng.choice([d for d in (1, 2, 3, 4, 6, 8) if heads % d == 0])
    args = [f"model.preset={'tiny-moe' if moe else 'tiny'}", "parallelism=auto",
            "model.tie_embeddings=false", f"model.n_layers={rng.choice([2, 3, 4, 6])}",
            f"model.n_heads={heads}", f"model.n_kv_heads={kv}", f"model.dim={heads * 8}",
            f"model.vocab_size={rng.choice([264, 266, 272, 300])}",
            f"training.seq_len={rng.choice([24, 30, 32, 48, 64])}",
            f"training.global_batch_size={rng.choice([2, 4, 6, 8, 12, 16])}",
            f"training.microbatch_size={rng.choice([1, 2])}", "runtime.device=cpu",
            "tracking.enabled=false", "optimizer.warmup_steps=1"]
    if moe:
        args.append(f"model.moe.experts={rng.choice([2, 4, 6, 8])}")
    if rng.random() < 0.2:
        args.append("data.document_mask=true")
    if rng.random() < 0.2:
        args.append("training.float8=tensorwise")
    try:
        return load_spec(None, args)
    except SpecError:
        return None


def _layout(c) -> tuple:
    return tuple(getattr(c, f) for f in LAYOUT_FIELDS)


def test_a_layout_the_planner_returns_is_never_refused_when_pinned():
    rng = random.Random(20261129)
    planned = 0
    for _ in range(60):
        spec = _draw_spec(rng)
        if spec is None:
            continue
        topo = Topology.uniform(rng.choice([1, 2]), rng.choice([2, 4]), "cpu")
        try:
            _, result = plan_job(spec, topo)
        except PlanError:
            continue
        for ranked in result.plans:
            pinned = effective_spec(spec, ranked.candidate)
            assert problems(pinned, runnable=True) == [], (ranked.candidate, spec.model)
            planned += 1
    assert planned > 200  # the draws reach the planner's interesting cases, not only refusals


def test_a_refused_pinned_layout_is_never_returned_by_the_planner():
    rng = random.Random(7)
    refused = 0
    for _ in range(120):
        spec = _draw_spec(rng)
        if spec is None:
            continue
        lay = Layout(tp=rng.choice([1, 2, 4]), pp=rng.choice([1, 2, 3]), dp=rng.choice([1, 2, 3, 4]),
                     cp=rng.choice([1, 2]), ep=rng.choice([1, 2, 4]), vpp=rng.choice([1, 2]),
                     dp_replicate=rng.choice([1, 2]),
                     schedule=rng.choice(["1f1b", "gpipe", "interleaved-1f1b", "zbv"]),
                     sequence_parallel=rng.random() < 0.5,
                     microbatch_size=spec.training.microbatch_size)
        if not problems(spec, lay, runnable=True):
            continue
        refused += 1
        topo = Topology.uniform(1, lay.world_size, "cpu")
        try:
            _, result = plan_job(spec, topo)
        except PlanError:
            continue
        returned = {_layout(p.candidate) for p in result.plans}
        assert _layout(lay) not in returned, lay
    assert refused > 30


def test_moe_at_cp1_is_planned_only_where_tp_splits_the_sequence():
    """The rule that used to reach pinned specs only: a tensor-parallel rank routes its share of
    a sequence, so tp divides seq_len, at cp = 1 too."""
    base = ["model.preset=tiny-moe", "training.seq_len=31", "model.tie_embeddings=false",
            "runtime.device=cpu"]
    spec = load_spec(None, [*base, "parallelism=auto"])
    _, result = plan_job(spec, Topology.uniform(1, 4, "cpu"))
    assert result.plans and {p.candidate.tp for p in result.plans} == {1}
    assert any("training.seq_len: 31 is not divisible by tp=2" in r.reason for r in result.rejected)
    with pytest.raises(SpecError, match="training.seq_len: 31 is not divisible by tp=2"):
        load_spec(None, [*base, "parallelism.tp=2", "parallelism.dp=1"])


def test_the_controller_and_run_job_refuse_what_the_cli_refuses(tmp_path):
    """The Python API and the benches skip the CLI: the controller validates what it is given,
    and ``run_job`` refuses before any Ray starts."""
    pytest.importorskip("ray")
    from trainmesh.controller.controller import Controller
    from trainmesh.controller.launch import run_job

    good = load_spec(None, ["model.preset=tiny", f"runtime.output_dir={tmp_path}",
                            "tracking.enabled=false"])
    bad = good.model_copy(update={"parallelism": good.parallelism.model_copy(update={"tp": 3})})
    with pytest.raises(SpecError) as err:
        Controller(bad.model_dump_json(), None, {})
    assert err.value.problems[0].path == "parallelism.tp"
    with pytest.raises(SpecError, match="parallelism.tp: tp=3 does not divide"):
        run_job(bad, environ={}, show_progress=False)
    import ray

    assert not ray.is_initialized()


# The modules other than spec/ that may build a Problem, and what about: reading the spec (files,
# YAML, --set, pydantic's messages, model.init_from's config.json), reaching Ray, and what only
# the machine a run starts from can see (output directory, checkpoint store, checkpoint step).
PARSERS_AND_ENVIRONMENT = {"cli/loading.py", "controller/launch.py", "controller/preflight.py"}
# The single rules of spec/mesh_rules.py, besides spec/validate.py: the planner prunes its search
# with them (its search space and its search), and the parallelizers guard the split they make.
RULE_USERS = {"planning/planner.py", "planning/search_space.py", "models/llama/parallelize.py"}


def test_no_module_outside_spec_states_a_spec_rule():
    stated, used = [], []
    rules = {n.name for n in ast.parse((PKG / "spec" / "mesh_rules.py").read_text()).body
             if isinstance(n, ast.FunctionDef) and n.name.endswith("_problems")}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).as_posix()
        if rel.startswith("spec/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Problem"
                    and rel not in PARSERS_AND_ENVIRONMENT):
                stated.append(f"{rel}:{node.lineno}")
            if (isinstance(node, ast.ImportFrom) and node.module == "trainmesh.spec.mesh_rules"
                    and rel not in RULE_USERS):
                used += [f"{rel} imports {a.name}" for a in node.names if a.name in rules
                         and a.name != "float8_device_problems"]  # the device's, at build
    assert not stated, f"rules stated outside spec/: {stated}"
    assert not used, used


def test_the_byte_vocabulary_the_spec_checks_is_the_tokenizers():
    from trainmesh.data.tokenizer import VOCAB_SIZE
    from trainmesh.spec.validate import BYTE_TOKENIZER_VOCAB

    assert VOCAB_SIZE == BYTE_TOKENIZER_VOCAB
