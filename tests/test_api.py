"""The Python API (``trainmesh/api.py``): the command line's verbs as functions returning data.
Its ``run`` and ``load_model`` on real ranks: ``test_dp_zero3.py``'s ZeRO-3 case."""

from __future__ import annotations

import json

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
