"""Guards for the layout (README's Layout): each top-level folder answers one question, and
subpackages import downward only: cli → controller → actors → engine → the leaves, with
planning (torch-free) beside them. No import cycles (submodule edges included), no torch on the
planning side or in the controller's process, no ray in parallel/, and nothing imports cli/."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "trainmesh"

# What each subpackage may import (besides itself), with no exemption. The job spec (plain data
# and the rules for what a mesh can run) is a leaf every layer may read; deploy gets the plan's
# numbers from its caller; no package imports cli.
LEAVES = {"parallel", "models", "kernels", "checkpoint", "data", "spec"}
ALLOWED = {
    "cli": {"controller", "actors", "planning", "tracking", "deploy", "interop"} | LEAVES,
    "controller": {"actors", "planning", "tracking"} | LEAVES,
    "actors": {"engine"} | LEAVES,
    "engine": {"interop"} | LEAVES,
    "planning": {"parallel", "models", "spec"},
    "interop": {"models", "checkpoint", "data"},  # Hugging Face in and out: above the leaves
    "parallel": {"models", "kernels", "spec"},
    "models": {"kernels", "spec"},
    "kernels": {"spec"},  # what model.kernels means on a device (spec/kernel_choice.py)
    "checkpoint": set(),
    "data": set(),
    "tracking": set(),
    "spec": set(),
    "deploy": {"spec"},
    # what only tests and benches use: it plugs into the product's seams; nothing imports it
    "testing": {"controller", "actors", "engine", "planning"} | LEAVES,
}


def _imports(path: Path) -> set[str]:
    """Every trainmesh module ``path`` imports, at any depth of the file; ``from pkg import mod``
    counts as an import of the submodule ``pkg.mod`` (an edge the cycle check must see)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            base = PKG.parent.joinpath(*node.module.split("."))
            subs = {f"{node.module}.{a.name}" for a in node.names
                    if (base / f"{a.name}.py").is_file() or (base / a.name / "__init__.py").is_file()}
            out.update(subs or {node.module})
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("trainmesh.")}


def _module(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_subpackages_import_downward_only():
    bad = []
    for path in PKG.rglob("*.py"):
        sub = path.relative_to(PKG).parts[0]
        if sub not in ALLOWED:
            assert path.parent == PKG, f"{sub}/ has no layering rule in ALLOWED"
            continue
        for mod in _imports(path):
            target = mod.split(".")[1]
            if target != sub and target not in ALLOWED[sub]:
                bad.append(f"{_module(path)} imports {mod}")
    assert not bad, bad


def test_no_import_cycles():
    graph = {_module(p): {m for m in _imports(p)} for p in PKG.rglob("*.py")}
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                raise AssertionError(" -> ".join([*stack, node, nxt]))
            if nxt in graph and not state.get(nxt):
                visit(nxt, [*stack, node])
        state[node] = 2

    for mod in graph:
        if not state.get(mod):
            visit(mod, [])


def _fresh_import(modules: list[str], forbidden: str) -> str:
    code = (f"import sys\nfor m in {modules!r}: __import__(m)\n"
            f"print(sorted(k for k in sys.modules if k == {forbidden!r} or "
            f"k.startswith({forbidden + '.'!r})))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=120).stdout.strip()


def _modules(*subpackages: str) -> list[str]:
    return sorted(_module(p) for sub in subpackages for p in (PKG / sub).rglob("*.py"))


def test_planning_spec_and_controller_import_no_torch():
    """The planner, the cost model, the policies and the whole controller (which creates the rank
    actors, but never runs one) load no torch: `trainmesh plan` and the driver stay light."""
    mods = [*_modules("planning", "controller", "spec", "deploy", "tracking"),
            "trainmesh.cli.main", "trainmesh.cli.loading", "trainmesh.actors.worker_group",
            "trainmesh.actors.rank_worker", "trainmesh.parallel.dims", "trainmesh.parallel.layout",
            "trainmesh.models.llama.model_math", "trainmesh.checkpoint.manifest"]
    assert _fresh_import(mods, "torch") == "[]"


def test_nothing_imports_cli():
    """The command line and the Python API (``api.py``) are the top: only they and ``python -m
    trainmesh`` (``__main__``) use it, and nothing imports the API."""
    bad = [f"{_module(p)} imports {m}" for p in PKG.rglob("*.py")
           for m in _imports(p) if m == "trainmesh.api" or m.startswith("trainmesh.api.")]
    bad += [f"{_module(p)} imports {m}" for p in PKG.rglob("*.py")
            if p.relative_to(PKG).parts[0] != "cli" and p.name not in ("__main__.py", "api.py")
            for m in _imports(p) if m.split(".")[1] == "cli"]
    assert not bad, bad


def test_no_product_module_imports_the_test_hooks():
    """Fault injection, the NCCL-rules transport and the parallel tests' probes live in
    ``trainmesh/testing``: a user's process carries none of it (not even a switch)."""
    bad = [f"{_module(p)} imports {m}" for p in PKG.rglob("*.py")
           if p.relative_to(PKG).parts[0] != "testing"
           for m in _imports(p) if m.split(".")[1] == "testing"]
    assert not bad, bad
    product = [p for p in PKG.rglob("*.py") if p.relative_to(PKG).parts[0] != "testing"]
    for switch in ("TRAINMESH_FAULT", "TRAINMESH_P2P"):
        assert not [p for p in product if switch in p.read_text()], switch


def test_the_step_knows_no_model_family():
    """One step for every family: MoE's balancing and any later family's losses and updates
    come in as the model's hooks (``models/hooks.py``), not as imports of the family."""
    step = PKG / "engine" / "step.py"
    families = {p.name for p in (PKG / "models").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert families >= {"llama", "moe"}
    bad = [m for m in _imports(step) if m.startswith("trainmesh.models.") and m.split(".")[2] in families]
    assert not bad, bad


def test_parallel_imports_no_ray():
    mods = [_module(p) for p in (PKG / "parallel").rglob("*.py")]
    assert _fresh_import(mods, "ray") == "[]"


@pytest.mark.timed  # (its own time bounds: with the Ray tests under `make test`)
def test_readme_commands_name_real_subcommands_after_activating_the_makefiles_venv():
    """README's tour is typed as written after `make demo`: it activates the venv the Makefile
    installs the `trainmesh` console script into, and every `trainmesh X` is a command."""
    import re

    from trainmesh.cli.main import _parser

    root = PKG.parent
    readme = (root / "README.md").read_text()
    block = readme.split("## A five-minute tour", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    lines = [ln.split("#", 1)[0].strip() for ln in block.splitlines()]
    lines = [ln for ln in lines if ln]
    venv = re.search(r"^VENV := (\S+)$", (root / "Makefile").read_text(), re.M).group(1)
    assert lines[0] == f"source {venv}/bin/activate"
    scripts = (root / "pyproject.toml").read_text().split("[project.scripts]", 1)[1]
    assert re.match(r'\s*trainmesh = "trainmesh.cli.main:main"', scripts)
    typed = [ln.split()[1] for ln in lines if ln.startswith("trainmesh ")]
    assert len(typed) >= 8
    choices = set(_parser()._subparsers._group_actions[0].choices)
    assert set(typed) <= choices, sorted(set(typed) - choices)
