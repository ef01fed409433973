"""Load a job spec from YAML with dotted overrides, and explain every problem with it (the
rules themselves live in ``spec.validate``; this module parses and reports).

Every problem is a :class:`Problem` ``(path, what, fix)`` rendered as
``field.path: what is wrong; what to do``. Nothing here raises anything but :class:`SpecError`.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from trainmesh.spec.job import JobSpec
from trainmesh.spec.problems import Problem, SpecError
from trainmesh.spec.validate import problems as spec_problems


def add_spec_args(p: argparse.ArgumentParser) -> None:
    """A command's job spec argument and its ``--set`` overrides (read by :func:`load_spec`)."""
    p.add_argument("spec", help="job spec YAML")
    add_overrides_arg(p)


def add_overrides_arg(p: argparse.ArgumentParser) -> None:
    """``--set KEY=VALUE`` (repeatable), into ``overrides``."""
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field, e.g. --set training.steps=20 (repeatable)")


ENV_PREFIX = "env:"  # a spec in an environment variable: how submitted jobs carry theirs


def load_spec(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> JobSpec:
    """Read ``path`` (None: all defaults; ``env:NAME``: the YAML or JSON text in environment
    variable NAME), apply ``key.path=value`` overrides, validate."""
    if isinstance(path, str) and path.startswith(ENV_PREFIX):
        raw = _read_env(path[len(ENV_PREFIX):])
    else:
        raw = _read_yaml(Path(path)) if path is not None else {}
    for item in overrides:
        _apply_override(raw, item)
    return spec_from_dict(raw)


def spec_from_dict(raw: dict[str, Any]) -> JobSpec:
    _default_schedule(raw)
    _shape_from_init(raw)
    try:
        spec = JobSpec.model_validate(raw)
    except ValidationError as err:
        raise SpecError(_problems_from_pydantic(err)) from None
    problems = spec_problems(spec)
    if problems:
        raise SpecError(problems)
    return spec


def _default_schedule(raw: dict[str, Any]) -> None:
    """``parallelism.vpp > 1`` means interleaved 1F1B unless a schedule is named."""
    par, sched = raw.get("parallelism"), raw.get("schedule")
    vpp = par.get("vpp") if isinstance(par, dict) else None
    named = isinstance(sched, dict) and "name" in sched
    if isinstance(vpp, int) and vpp > 1 and not named and (sched is None or isinstance(sched, dict)):
        raw["schedule"] = {**(sched or {}), "name": "interleaved-1f1b"}


def _shape_from_init(raw: dict[str, Any]) -> None:
    """``model.init_from``: the shape comes from its config.json; a shape field the spec gives
    (or its named preset gives) that differs is refused, naming both values."""
    from trainmesh.interop.hf_config import (
        MOE_STRUCTURE,
        SHAPE_FIELDS,
        HfConfigError,
        model_fields,
        read_config,
    )
    from trainmesh.spec.presets import PRESETS

    model = raw.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("init_from"), str):
        return
    src = model["init_from"]
    try:
        theirs = model_fields(read_config(src))
    except (HfConfigError, OSError, ValueError) as err:
        raise SpecError([Problem("model.init_from", str(err), "give a Hugging Face model "
                                 "directory (config.json + model.safetensors)")]) from None
    given = {**PRESETS.get(model.get("preset") or "", {}), **model}
    training: dict[str, Any] = {}
    if isinstance(given.get("moe"), dict) and theirs.get("moe"):
        # The config fixes the experts; how they are balanced and dropped is the spec's.
        training = {k: v for k, v in given["moe"].items() if k not in MOE_STRUCTURE}
        given["moe"] = {k: v for k, v in given["moe"].items() if k in MOE_STRUCTURE}
        given["moe"] = {**{k: theirs["moe"][k] for k in MOE_STRUCTURE}, **given["moe"]}
    structure = {**theirs, "moe": theirs["moe"] and {k: theirs["moe"][k] for k in MOE_STRUCTURE}}
    differ = [f for f in SHAPE_FIELDS
              if f in given and f in theirs and not _same(given[f], structure[f])]
    wrong = [Problem(f"model.{f}", f"{given[f]!r} here but {structure[f]!r} in {src}/config.json",
                     "drop it (the shape comes from model.init_from) or import a matching model")
             for f in differ if f in model]
    from_preset = [f for f in differ if f not in model]
    if from_preset:  # the user never wrote these: the preset did
        wrong.append(Problem("model.preset", f"{model.get('preset', 'tiny')!r} sets "
                             + ", ".join(f"{f}={given[f]!r}" for f in from_preset)
                             + f" where {src}/config.json has "
                             + ", ".join(f"{structure[f]!r}" for f in from_preset),
                             "drop model.preset (set it to null): the shape comes from "
                             "model.init_from"))
    if wrong:
        raise SpecError(wrong)
    if theirs.get("moe"):
        theirs["moe"] = {**theirs["moe"], **training}
    model.update({**theirs, "preset": None})


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return all(_same(a.get(k), b.get(k)) for k in {*a, *b} - {"type"})
    if isinstance(a, int | float) and isinstance(b, int | float):
        return float(a) == float(b)
    return a == b


def _read_env(name: str) -> dict[str, Any]:
    where = f"{ENV_PREFIX}{name}"
    if name not in os.environ:
        raise SpecError([Problem(where, "environment variable not set",
                                 "set it to the job spec's YAML, or pass a file")])
    return _parse_yaml(os.environ[name], where)


def _read_yaml(path: Path) -> dict[str, Any]:
    where = str(path)
    if not path.exists():
        raise SpecError([Problem(where, "file not found", "pass the path of a job spec YAML")])
    if path.is_dir():
        raise SpecError([Problem(where, "is a directory", "pass the path of a job spec YAML")])
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise SpecError([Problem(where, f"cannot be read ({err})", "pass a readable UTF-8 YAML file")]) from None
    return _parse_yaml(text, where)


class _UniqueKeyLoader(yaml.SafeLoader):
    """Safe YAML that refuses a key given twice in one mapping (plain YAML keeps the last one
    silently: a classic way to run the wrong experiment)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[object, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _DuplicateKey(f"key {key!r} appears twice (lines {seen[key]} and {line})")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


class _DuplicateKey(yaml.YAMLError):
    pass


def _parse_yaml(text: str, where: str) -> dict[str, Any]:
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKey as err:
        raise SpecError([Problem(where, str(err), "keep one of them")]) from None
    except RecursionError:
        raise SpecError([Problem(where, "is nested too deeply to be a job spec",
                                 "write the spec as `section: {field: value}` mappings")]) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SpecError([Problem(where, f"is not valid YAML{at}", "fix the YAML syntax")]) from None
    if data is None:
        raise SpecError([Problem(where, "is empty", "write at least `name: my-job` in it")])
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise SpecError([Problem(where, f"top level is a YAML {kind}, not a mapping",
                                 "write the spec as `section: {field: value}` mappings")])
    return data


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise SpecError([Problem(f"--set {item}", "is not of the form key.path=value",
                                 "write e.g. --set training.steps=20")])
    try:
        value = yaml.safe_load(text) if text else ""
    except yaml.YAMLError:
        value = text
    parts = key.strip().split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if child == "auto" and part == "parallelism":
            child = node[part] = {"auto": True}
        if not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            raise SpecError([Problem(where, f"is a value ({child!r}), not a section",
                                     f"--set {where}=VALUE instead")])
        node = child
    node[parts[-1]] = value


def _problems_from_pydantic(err: ValidationError) -> list[Problem]:
    problems = []
    for e in err.errors():
        loc = [str(p) for p in e["loc"] if not str(p).startswith(("function-", "literal["))]
        path = ".".join(loc) or "spec"
        what, _, fix = _what(e).partition("; ")
        problems.append(Problem(path, what, fix or _fix(e, loc)))
    return problems


def _what(e: dict[str, Any]) -> str:
    if e["type"] == "extra_forbidden":
        return "unknown field"
    if e["type"] == "literal_error":
        return f"unknown value {e['input']!r}"
    msg = e["msg"]
    return msg[len("Value error, "):] if msg.startswith("Value error, ") else msg[:1].lower() + msg[1:]


def _fix(e: dict[str, Any], loc: list[str]) -> str:
    kind = e["type"]
    if kind == "extra_forbidden":
        known = _known_fields(loc[:-1])
        close = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.5)
        if close:
            return f"did you mean `{close[0]}`?"
        return f"known fields here: {', '.join(known)}"
    if kind == "literal_error":
        choices = re.findall(r"'([^']*)'", e["ctx"]["expected"])  # (as pydantic lists them)
        close = difflib.get_close_matches(str(e["input"]), choices, n=1, cutoff=0.6)
        return f"did you mean `{close[0]}`?" if close else f"use one of {e['ctx']['expected']}"
    if kind in ("int_parsing", "int_type", "int_from_float"):
        return "give a whole number, e.g. 8"
    if kind in ("float_parsing", "float_type"):
        return "give a number, e.g. 0.001"
    if kind in ("bool_parsing", "bool_type"):
        return "give true or false"
    if kind in ("string_type",):
        return "give a string"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        if loc == ["parallelism"]:
            return "write `parallelism: auto` or a mapping such as {tp: 2, dp: 4}"
        return "give a mapping of field: value"
    if kind.startswith(("greater_than", "less_than")):
        return "give a value in the allowed range"
    if kind == "string_pattern_mismatch":
        return "use letters, digits, '.', '_' or '-' (at most 63 characters)"
    return "see the field's documentation in trainmesh/spec/job.py"


def _known_fields(loc: list[str]) -> list[str]:
    model: type[BaseModel] = JobSpec
    for part in loc:
        field = model.model_fields.get(part)
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return sorted(model.model_fields)


def device_kind(name: str) -> str:
    """``--device``'s type: a kind of the planner's device table, or argparse's one-line error
    naming the closest kind."""
    from trainmesh.planning.devices import DEVICES

    key = name.lower()
    if key in DEVICES:
        return key
    close = difflib.get_close_matches(key, list(DEVICES), n=1, cutoff=0.5)
    hint = f"did you mean `{close[0]}`? " if close else ""
    raise argparse.ArgumentTypeError(f"unknown device {name!r}; {hint}known: {', '.join(sorted(DEVICES))}")
