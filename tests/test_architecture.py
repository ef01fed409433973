"""Guards for DESIGN.md's layering: no import cycles, downward-only subpackage imports,
no torch in the planning side, no ray in parallel/."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "trainmesh"

# What each subpackage may import (besides itself): jobs → platform → actors → (interop →) the
# leaves, with no exemption. The job spec (plain data) is a leaf every layer may read; deploy gets the
# plan's numbers from its caller.
LEAVES = {"parallel", "models", "kernels", "checkpoint", "data", "spec"}
ALLOWED = {
    "jobs": {"platform", "actors", "tracking", "deploy", "interop"} | LEAVES,
    "platform": {"actors", "tracking"} | LEAVES,
    "actors": {"interop"} | LEAVES,
    "interop": {"models", "checkpoint", "data"},  # Hugging Face in and out: above the leaves
    "parallel": {"models", "kernels", "spec"},
    "models": {"kernels", "spec"},
    "kernels": set(),
    "checkpoint": set(),
    "data": set(),
    "tracking": set(),
    "spec": set(),
    "deploy": {"spec"},
}


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
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


def test_spec_and_planning_side_import_no_torch():
    mods = ["trainmesh.spec.job", "trainmesh.jobs.loading", "trainmesh.deploy.render",
            "trainmesh.platform.devices",
            "trainmesh.parallel.dims", "trainmesh.parallel.layout",
            "trainmesh.models.llama.model_math", "trainmesh.checkpoint.manifest"]
    assert _fresh_import(mods, "torch") == "[]"


def test_parallel_imports_no_ray():
    mods = [_module(p) for p in (PKG / "parallel").rglob("*.py")]
    assert _fresh_import(mods, "ray") == "[]"
