"""The documentation: the reference pages generated from the code and current, every field,
command and flag documented, the README the front page, the examples in the README and the
docs valid and runnable in order after ``make demo``, and the MkDocs site built strictly."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainmesh.cli.loading import load_spec

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _reference():
    spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "docs" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_pages_are_what_the_code_generates():
    ref = _reference()
    for name, make in ref.PAGES.items():
        page = ROOT / "docs" / "reference" / name
        assert page.read_text() == make(), f"docs/reference/{name} is stale: run python docs/reference.py"


def test_the_guides_generated_sections_are_what_the_code_gives_and_trainmesh_goodput_prints(
        capsys):
    """The goodput guide's table is what ``docs/reference.py`` computes, and its figures are
    those the documented ``trainmesh goodput`` command prints for the same configuration."""
    import json

    from trainmesh.cli.main import main

    ref = _reference()
    for page, name, make in ref.SECTIONS:
        text = (ROOT / "docs" / page).read_text()
        assert ref.with_section(text, name, make()) == text, (
            f"the {name} of docs/{page} is stale: run python docs/reference.py")
    # (the command the guide shows, its optional parts dropped)
    assert ref.GOODPUT_COMMAND[1:] in _commands("goodput"), "the guide's goodput command changed"
    label, flags = ref.GOODPUT_CONFIGS[1]
    capsys.readouterr()
    argv = [str(ROOT / a) if a.startswith("jobs/") else a for a in ref.GOODPUT_COMMAND]
    assert main([*argv, *flags, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)["results"]
    rows = [line for line in (ROOT / "docs" / "guides" / "goodput.md").read_text().splitlines()
            if line.startswith("| ") and "steps |" in line]
    start = next(i for i, line in enumerate(rows) if line.startswith(f"| {label} |"))
    for row, result in zip(rows[start:start + 2], printed, strict=True):
        cells = [c.strip() for c in row.split("|")[1:-1]]
        by = {o["strategy"]: o["goodput"] for o in result["outcomes"]}
        assert cells[1] == f"{result['gpus']:,}"
        assert cells[2] == f"{result['checkpoint_every_steps']} steps"
        assert cells[3:6] == [f"{by[s]:.1%}" for s in ("trainmesh warm", "trainmesh cold", "restart")]
    with pytest.raises(ValueError, match="no generated section 'x'"):
        ref.with_section("text\n", "x", "")


def test_every_spec_field_command_and_flag_is_documented():
    from pydantic import BaseModel

    from trainmesh.spec.job import JobSpec

    ref = _reference()
    missing = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, f in model.model_fields.items():
            sub = ref._submodel(f.annotation)
            if sub is not None:
                walk(sub, f"{prefix}{name}.")
            elif not (f.description or "").strip():
                missing.append(f"{prefix}{name}")

    walk(JobSpec, "")
    assert not missing, f"spec fields without a description: {missing}"
    undocumented = [f"{name} {a.option_strings or a.dest}" for name, parser, text in ref._commands()
                    for a in ref.flags(parser) if not (a.help or "").strip()]
    undocumented += [name for name, parser, text in ref._commands() if not (text or parser.description)]
    assert not undocumented, f"commands and flags without help: {undocumented}"
    page = (ROOT / "docs" / "reference" / "spec.md").read_text()
    assert "## `topology`" in page and "## `model.moe`" in page


def test_the_readme_is_the_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), "dated results belong in bench/RESULTS.md"
    assert not re.search(r"\d+ passed|\d+ tests\b", text), "test counts go stale"
    for target in re.findall(r"\]\(([^)#]+)", text):  # every link leads somewhere
        assert (ROOT / target).exists(), target


def test_every_shipped_job_spec_is_named_in_the_docs():
    text = "".join(p.read_text() for p in PAGES)
    for job in sorted((ROOT / "jobs").glob("*.yaml")):
        assert f"jobs/{job.name}" in text, f"jobs/{job.name} is in no page"


def _blocks(*langs: str, pages: list[Path] = PAGES) -> list[tuple[Path, str]]:
    """Every fenced block in ``pages`` whose language is one of ``langs`` ("": none given)."""
    found = []
    for page in pages:
        lang, lines = None, []
        for line in page.read_text().splitlines():
            if line.startswith("```"):
                if lang is None:
                    lang, lines = line[3:].strip(), []
                else:
                    if lang in langs:
                        found.append((page, "\n".join(lines) + "\n"))
                    lang = None
            elif lang is not None:
                lines.append(line)
    return found


def test_the_job_specs_shown_in_the_docs_validate(tmp_path):
    shown = [(page, yaml.safe_load(block)) for page, block in _blocks("yaml")]
    specs = [(page, doc) for page, doc in shown if isinstance(doc, dict) and "name" in doc and "model" in doc]
    assert specs
    for i, (_, doc) in enumerate(specs):
        path = tmp_path / f"shown-{i}.yaml"
        path.write_text(yaml.safe_dump(doc))
        load_spec(str(path), [])  # raises, naming the field, if a page shows a bad spec


def _commands(word: str, pages: list[Path] = PAGES) -> list[list[str]]:
    """Every ``trainmesh WORD ...`` command line in the README's and the docs' shell blocks,
    continuation lines joined, comments and ``[optional]`` parts dropped, split as the shell
    would; each once, in page order (a page repeating another's example runs it once)."""
    commands: list[list[str]] = []
    for _, block in _blocks("bash", "", pages=pages):
        joined = re.sub(r"\\\n\s*", " ", "\n".join(re.split(r"\s#", line)[0] for line in block.splitlines()))
        for line in joined.splitlines():
            if line.strip().startswith(f"trainmesh {word} "):
                argv = shlex.split(re.sub(r"\[[^\]]*\]", "", line))[2:]
                if argv not in commands:
                    commands.append(argv)
    return commands


def test_the_run_examples_each_train_a_run_of_their_own_after_the_demo():
    """The ``trainmesh run`` examples, run in order after ``make demo``: each is a valid spec,
    and none trains into another's output directory (nor the demo's, complete by then: it
    would refuse, nothing left to train)."""
    seen = {load_spec("jobs/tiny-cpu.yaml", []).resolved_output_dir(): "make demo"}
    runs = [argv for argv in _commands("run")  # (the shipped specs': not a placeholder's)
            if "--dry-run" not in argv and argv[0].startswith("jobs/")]
    assert len(runs) >= 3, runs
    for argv in runs:
        overrides = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
        out = load_spec(argv[0], overrides).resolved_output_dir()
        assert out not in seen, f"`trainmesh run {' '.join(argv)}` trains into {out}, as {seen[out]}"
        seen[out] = " ".join(argv)


def test_the_plan_schedule_and_validate_examples_run(tmp_path, monkeypatch, capsys):
    """Every ``trainmesh plan``, ``schedule``, ``validate``, ``goodput`` and ``k8s render`` example in the
    README and the docs — shell blocks and inline — runs and exits 0 (one of the README's plans
    once named a node count its spec's pinned dp could not hold)."""
    from trainmesh.cli.main import main

    inline = []
    for page in PAGES:
        for code in re.findall(r"`(trainmesh (?:plan|schedule|validate) [^`]*)`", page.read_text()):
            argv = shlex.split(code)[1:]
            if argv not in inline:
                inline.append(argv)
    examples = [[word, *argv] for word in ("plan", "schedule", "validate", "goodput")
                for argv in _commands(word)]
    examples += [["k8s", *argv] for argv in _commands("k8s")]
    examples += [argv for argv in inline if argv not in examples]
    assert any(a[0] == "plan" and "--nodes" in a and "127" in a for a in examples), examples
    monkeypatch.chdir(tmp_path)  # (the schedule's PNG lands here)
    for argv in examples:
        argv = [str(ROOT / a) if a.startswith("jobs/") else a for a in argv]
        assert main(argv) == 0, (argv, capsys.readouterr().err[-2000:])
        capsys.readouterr()


@pytest.mark.timed  # (its own time bound: with the Ray tests under `make test`)
@pytest.mark.timeout(300)
def test_the_site_builds_strictly(tmp_path):
    """``mkdocs build --strict``: a broken link or anchor, or a page outside the navigation,
    fails."""
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d",
                          str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                         timeout=240, env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "spec" / "index.html").is_file()
