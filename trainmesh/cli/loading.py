"""Load a job spec from YAML with dotted overrides, and explain every problem with it.

Every problem is a :class:`Problem` ``(path, what, fix)`` rendered as
``field.path: what is wrong; what to do``. Nothing here raises anything but :class:`SpecError`.
"""

from __future__ import annotations

import argparse
import difflib
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from trainmesh.data.tokenizer import VOCAB_SIZE as BYTE_TOKENIZER_VOCAB
from trainmesh.spec.job import JobSpec
from trainmesh.spec.mesh_rules import (
    cp_problems,
    dp_problems,
    hsdp_problems,
    runnable_problems,
    shape_problems,
)
from trainmesh.spec.problems import Problem, SpecError


def add_spec_args(p: argparse.ArgumentParser) -> None:
    """A command's job spec argument and its ``--set`` overrides (read by :func:`load_spec`)."""
    p.add_argument("spec", help="job spec YAML")
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
    problems = consistency_problems(spec)
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
        raise SpecError([Problem("model.init_from", str(err), "give a Hugging Face Llama "
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
        return f"use one of {e['ctx']['expected']}"
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


def consistency_problems(spec: JobSpec) -> list[Problem]:
    """Problems that involve more than one field."""
    m, par, tr, el = spec.model, spec.parallelism, spec.training, spec.elastic
    out: list[Problem] = []

    def need(ok: bool, path: str, what: str, fix: str) -> None:
        if not ok:
            out.append(Problem(path, what, fix))

    need(m.head_dim is not None or m.dim % m.n_heads == 0, "model.dim",
         f"{m.dim} is not divisible by n_heads={m.n_heads}",
         "make dim a multiple of model.n_heads, or give model.head_dim")
    need(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads",
         f"n_heads={m.n_heads} is not divisible by n_kv_heads={m.n_kv_heads}",
         f"use a divisor of {m.n_heads}")
    hd = m.head_dim or m.dim // m.n_heads
    need(hd % 2 == 0, "model.head_dim" if m.head_dim else "model.dim", f"head dim {hd} is odd",
         "RoPE needs an even head dim: change model.dim or model.n_heads (or model.head_dim)")
    need(spec.data.path is not None or m.vocab_size >= BYTE_TOKENIZER_VOCAB, "model.vocab_size",
         f"{m.vocab_size} is smaller than the byte tokenizer's {BYTE_TOKENIZER_VOCAB} tokens",
         f"use at least {BYTE_TOKENIZER_VOCAB} (264 keeps it divisible by 8)")
    need(tr.seq_len <= m.max_seq_len, "training.seq_len",
         f"{tr.seq_len} exceeds model.max_seq_len={m.max_seq_len}",
         "shorten training.seq_len or raise model.max_seq_len")
    out += dp_problems(tr.global_batch_size, tr.microbatch_size, *((1, 1) if par.auto
                                                                     else (par.dp, par.pp)))
    if not par.auto:
        out += shape_problems(m, par.tp, par.pp, par.vpp, par.dp * par.cp, par.ep)
        out += hsdp_problems(par.dp, par.dp_replicate, par.ep, par.cp)
        out += cp_problems(tr.seq_len, par.cp, par.tp, par.ep, par.pp,
                           par.sequence_parallel or m.moe is not None, spec.data.document_mask)
        need(tr.float8 == "none" or par.tp == 1, "training.float8",
             f"{tr.float8} beside tensor parallel (tp={par.tp}) is not built",
             "set training.float8=none or parallelism.tp=1")
        need(m.moe is None or par.tp == 1 or tr.seq_len % par.tp == 0, "training.seq_len",
             f"{tr.seq_len} is not divisible by tp={par.tp} (each tensor-parallel rank routes "
             "its share of a sequence to the experts)", f"use a multiple of {par.tp}")
        need(par.vpp == 1 or spec.schedule.name in ("interleaved-1f1b", "zbv"), "schedule.name",
             f"{spec.schedule.name} runs one model chunk per stage but parallelism.vpp={par.vpp}",
             "use schedule.name=interleaved-1f1b (the default when vpp > 1) or zbv, or set vpp=1")
        need(spec.schedule.name != "zbv" or par.pp == 1 or par.vpp == 2, "parallelism.vpp",
             f"zbv places two chunks per rank in a V, but parallelism.vpp={par.vpp}",
             "set parallelism.vpp=2")
        world = par.world_size
        need(world >= el.min_world_size, "elastic.min_world_size",
             f"{el.min_world_size} exceeds the planned world size {world}",
             f"lower it to at most {world}")
        need(el.max_world_size is None or world <= el.max_world_size, "elastic.max_world_size",
             f"{el.max_world_size} is below the planned world size {world}",
             f"raise it to at least {world}")
    need(el.max_world_size is None or el.min_world_size <= el.max_world_size,
         "elastic.min_world_size", f"{el.min_world_size} exceeds max_world_size={el.max_world_size}",
         "make min_world_size ≤ max_world_size")
    need(spec.eval.every == 0 or bool(spec.data.eval_path or spec.data.eval_fraction), "eval.every",
         "evaluation needs held-out data", "set data.eval_path or data.eval_fraction, or eval.every=0")
    need(not (spec.data.eval_path and spec.data.eval_fraction), "data.eval_fraction",
         "is set beside data.eval_path", "hold out one way: drop one of them")
    need(spec.optimizer.warmup_steps <= tr.steps, "optimizer.warmup_steps",
         f"{spec.optimizer.warmup_steps} exceeds training.steps={tr.steps}",
         "shorten the warm-up or train longer")
    return out


def unsupported_problems(spec: JobSpec) -> list[Problem]:
    """What a valid spec asks for that this version cannot run yet (``trainmesh run`` refuses
    it; ``validate`` accepts it, so reference specs for larger layouts stay checkable)."""
    par = spec.parallelism
    out = runnable_problems(spec.model, par.tp, par.pp, par.sequence_parallel and not par.auto)
    kernels = spec.model.kernels
    asked = kernels.values() if isinstance(kernels, dict) else [kernels]
    if ("triton" in asked and spec.runtime.device == "cpu"
            and os.environ.get("TRITON_INTERPRET") != "1"):
        out.append(Problem("model.kernels", "triton kernels need a CUDA device (runtime.device is "
                           "cpu)", "use model.kernels=auto, or TRITON_INTERPRET=1 to interpret "
                           "them on CPU (slow)"))
    out += dataset_problems(spec)
    ckpt_dir = spec.checkpoint.dir
    if ckpt_dir and "://" in ckpt_dir:
        from fsspec.core import url_to_fs

        try:
            url_to_fs(ckpt_dir)
        except (ImportError, ValueError) as err:
            out.append(Problem("checkpoint.dir", f"no filesystem for {ckpt_dir!r} ({err})",
                               "install the fsspec implementation it names (s3fs, gcsfs, adlfs) "
                               "or give a local path"))
    return out


def dataset_problems(spec: JobSpec, local_only: bool = False) -> list[Problem]:
    """The datasets must exist, the model's vocabulary hold every id in them, and the held-out
    data and an imported model's tokenizer be the training data's tokenizer. ``local_only``:
    only datasets on this machine's filesystem (``validate`` checks what it can see)."""
    from trainmesh.data.shards import read_meta

    out, metas = [], {}
    for field in ("path", "eval_path"):
        path = getattr(spec.data, field)
        if not path or (local_only and "://" in path):
            continue
        try:
            meta = metas[field] = read_meta(path)
        except (OSError, ValueError) as err:
            what = str(err).removeprefix(f"data.path {path}: ").split("; prepare it")[0]
            again = "again " if isinstance(err, ValueError) else ""
            out.append(Problem(f"data.{field}", f"{path}: {what}", f"prepare it {again}with "
                               f"`trainmesh data prepare INPUTS --out {path}`"))
            continue
        if meta["vocab_size"] > spec.model.vocab_size:
            out.append(Problem("model.vocab_size", f"{spec.model.vocab_size} is smaller than the "
                               f"{meta['vocab_size']} tokens of the dataset at {path} "
                               f"(tokenizer: {_tokenizer_name(meta)})",
                               f"use at least {meta['vocab_size']}, or a dataset made with a "
                               "smaller tokenizer"))
    train = metas.get("path", {}).get("tokenizer", {"kind": "byte"} if not spec.data.path else None)
    if train and "eval_path" in metas and _tokenizer_id(metas["eval_path"]["tokenizer"]) != _tokenizer_id(train):
        out.append(Problem("data.eval_path", f"made with tokenizer {_tokenizer_name(metas['eval_path'])}, "
                           f"the training data with {train.get('source', train['kind'])}",
                           "prepare both with the same --tokenizer"))
    model_tok = Path(spec.model.init_from or "", "tokenizer.json")
    if train and spec.model.init_from and "://" not in spec.model.init_from and model_tok.is_file():
        import hashlib

        if hashlib.sha256(model_tok.read_bytes()).hexdigest() != train.get("sha256"):
            out.append(Problem("data.path", f"made with tokenizer {train.get('source', train['kind'])}, "
                               f"not model.init_from's {model_tok}",
                               f"prepare the data with --tokenizer {spec.model.init_from}"))
    return out


def _tokenizer_id(tok: dict[str, Any]) -> str:
    return tok.get("sha256", tok["kind"])


def _tokenizer_name(meta: dict[str, Any]) -> str:
    return meta["tokenizer"].get("source", meta["tokenizer"]["kind"])
