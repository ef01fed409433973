"""The Python API (``trainmesh/api.py``): the command line's verbs as functions returning data.
Its ``run`` and ``load_model`` on real ranks: ``test_dp_zero3.py``'s ZeRO-3 case."""

from __future__ import annotations

import json
import re

import pytest
import torch

from trainmesh import api


def test_a_spec_from_python_with_overrides_and_a_bad_one_naming_the_field():
    spec = api.load_spec("jobs/tiny-cpu.yaml", ["training.steps=20"])
    assert isinstance(spec, api.JobSpec) and spec.training.steps == 20
    assert api.load_spec("jobs/tiny-cpu.yaml", "training.steps=30").training.steps == 30
    with pytest.raises(api.SpecError) as err:
        api.load_spec(None, ["training.stepz=3"])
    assert [str(p) for p in err.value.problems] == [
        "training.stepz: unknown field; did you mean `steps`?"]


def test_plans_from_python_as_the_command_line_prints_them(capsys):
    from trainmesh.cli.main import main

    spec = api.load_spec("jobs/llama-70b.yaml", ["parallelism=auto"])
    rows = api.plan(spec, nodes=16, gpus_per_node=8, device="h100", top=3)
    assert main(["plan", "jobs/llama-70b.yaml", "--set", "parallelism=auto", "--nodes", "16",
                 "--device", "h100", "--top", "3", "--json"]) == 0
    assert rows == json.loads(capsys.readouterr().out)
    assert 1 <= len(rows) <= 3 and rows[0]["tp"] * rows[0]["pp"] * rows[0]["dp"] <= 128


def test_a_checkpoint_loads_as_a_plain_module_and_exports(tmp_path):
    """``load_model`` gives the checkpoint's model whole in this process (its logits the
    trained model's), ``export`` the Hugging Face directory."""
    from test_hf_interop import _committed_checkpoint

    from trainmesh.engine.engine import build_model

    spec = api.load_spec(None, ["model.preset=tiny", "training.seed=3"])
    trained = build_model(spec, torch.device("cpu"))
    with torch.no_grad():
        for p in trained.parameters():  # not the seeded initialisation load_model starts from
            p.add_(0.01 * torch.randn_like(p))
    _committed_checkpoint(trained, spec, tmp_path / "run" / "checkpoints", 7)
    model = api.load_model(str(tmp_path / "run"))
    assert type(model) is type(trained) and not model.training
    tokens = torch.randint(0, spec.model.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), trained(tokens), rtol=0, atol=0)
    written = api.export(str(tmp_path / "run"), str(tmp_path / "hf"))
    assert written["step"] == 7 and (tmp_path / "hf" / "config.json").is_file()


def _shown(expected: str, got: list[str]) -> bool:
    """Every line the page shows is, in order, one of the lines the cell printed (others, such
    as a run's progress lines, may come between); ``…`` in a shown line stands for anything."""
    it = iter(got)
    for line in expected.splitlines():
        pattern = re.compile(".*".join(re.escape(part) for part in line.split("…")) + r"\Z")
        if not any(pattern.match(g) for g in it):
            return False
    return True


@pytest.mark.cluster  # (a local Ray cluster, in the page's own interpreter)
@pytest.mark.ray_apart
@pytest.mark.timeout(600)
def test_the_python_api_guide_runs_as_a_notebook_and_prints_what_it_shows(tmp_path):
    """``docs/guides/python-api.md`` is a notebook: its cells run in order in one fresh
    interpreter (from a directory holding the repository's ``jobs/``) — a spec, a plan, a run
    on a local Ray cluster, its held-out loss, the export, the checkpoint as a module and
    transformers' logits of the export — and each prints what the page shows under it."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from notebook import CELL, cells

    repo = Path(__file__).resolve().parents[1]
    page = repo / "docs" / "guides" / "python-api.md"
    (tmp_path / "jobs").symlink_to(repo / "jobs")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(repo), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(repo / "tests" / "notebook.py"), str(page)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    printed = proc.stdout.split("\n")
    marks = [printed.index(CELL.format(n)) for n in range(len(cells(page.read_text())))]
    shown = [text for _, text in cells(page.read_text())]
    assert len(shown) >= 7 and all(text is not None for text in shown), "a cell shows no output"
    for n, (start, end) in enumerate(zip(marks, [*marks[1:], len(printed)], strict=True)):
        got = printed[start + 1:end]
        assert _shown(shown[n], got), (n, shown[n], got)
    assert (tmp_path / "runs" / "api-demo" / "summary.json").is_file()
    assert (tmp_path / "out" / "hf" / "config.json").is_file()
