"""What a run checks before any Ray or rank starts, in one call that ``run_job`` (and the
other entry points: ``dry_run_job``, ``evaluate_job``, ``trainmesh submit``) owns: the spec's
rules (``spec.validate.problems``, with what only this machine can see: the datasets, the
checkpoint store's filesystem, Triton's interpreter), the output directory, the tracking URI,
and whether anything is left to train. The command line only parses and prints."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainmesh.spec.job import JobSpec
from trainmesh.spec.problems import Problem, SpecError
from trainmesh.spec.validate import problems


def read_datasets(spec: JobSpec, local_only: bool = False) -> dict[str, Any]:
    """The metadata of ``data.path`` and ``data.eval_path`` (or the error reading each raised),
    and the sha256 of ``model.init_from``'s tokenizer.json when it has one: what
    ``spec.validate.dataset_problems`` checks. ``local_only``: skip datasets on other
    filesystems (``validate`` checks what it can see)."""
    from trainmesh.data.shards import read_meta

    out: dict[str, Any] = {}
    for field in ("path", "eval_path"):
        path = getattr(spec.data, field)
        if not path or (local_only and "://" in path):
            continue
        try:
            out[field] = read_meta(path)
        except (OSError, ValueError) as err:
            out[field] = err
    tok = Path(spec.model.init_from or "", "tokenizer.json")
    if spec.model.init_from and "://" not in spec.model.init_from and tok.is_file():
        out["tokenizer_sha256"] = hashlib.sha256(tok.read_bytes()).hexdigest()
    return out


def filesystem_problems(spec: JobSpec) -> list[Problem]:
    """``checkpoint.dir`` on a filesystem whose fsspec implementation is not installed."""
    ckpt_dir = spec.checkpoint.dir
    if not ckpt_dir or "://" not in ckpt_dir:
        return []
    from fsspec.core import url_to_fs

    try:
        url_to_fs(ckpt_dir)
    except (ImportError, ValueError) as err:
        return [Problem("checkpoint.dir", f"no filesystem for {ckpt_dir!r} ({err})",
                        "install the fsspec implementation it names (s3fs, gcsfs, adlfs) or give "
                        "a local path")]
    return []


def preflight_problems(spec: JobSpec, environ: Mapping[str, str] = os.environ,
                       local_only: bool = False) -> list[Problem]:
    """Every problem a run of ``spec`` from here would meet before training: the spec's rules
    with what this version runs, the datasets and the checkpoint store."""
    # the ranks of a local cluster inherit this process's environment
    interpreted = {**os.environ, **environ}.get("TRITON_INTERPRET") == "1"
    return [*problems(spec, runnable=True, datasets=read_datasets(spec, local_only),
                      triton_interpreted=interpreted),
            *filesystem_problems(spec)]


def with_absolute_output(spec: JobSpec, cwd: Path) -> JobSpec:
    """Actors run in other directories: pin ``runtime.output_dir`` and the local paths of
    data and ``model.init_from`` to absolute paths."""
    def pinned(path: str | None) -> str | None:
        return path if path is None or "://" in path else str((cwd / path).resolve())

    runtime = spec.runtime.model_copy(update={"output_dir": pinned(spec.resolved_output_dir())})
    data = spec.data.model_copy(update={"path": pinned(spec.data.path),
                                        "eval_path": pinned(spec.data.eval_path)})
    model = spec.model.model_copy(update={"init_from": pinned(spec.model.init_from)})
    return spec.model_copy(update={"runtime": runtime, "data": data, "model": model})


def make_output_dir(spec: JobSpec) -> Path:
    """The run's output directory (and a local checkpoint directory), created now: a run
    refuses one it cannot create the way ``validate`` refuses a spec — one line naming the
    field and the fix — before any Ray or rank starts."""
    out = Path(spec.runtime.output_dir)
    dirs = [("runtime.output_dir", out)]
    if spec.checkpoint.dir and "://" not in spec.checkpoint.dir:
        dirs.append(("checkpoint.dir", Path(spec.checkpoint.dir)))
    for field, path in dirs:
        try:
            path.mkdir(parents=True, exist_ok=True)
            probe = path / f".trainmesh-write-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as err:
            raise SpecError([Problem(field, f"cannot create or write {path} "
                                     f"({err.strerror or err})", f"give a writable directory, "
                                     f"e.g. --set {field}=runs/my-job")]) from None
    return out


def earlier_run_problems(spec: JobSpec, store) -> list[Problem]:
    """``checkpoint.resume: never`` starts the run from its initialisation; its checkpoints
    must not mix with an earlier run's in one directory (a recovery restores the run's own
    newest checkpoint, and a save never replaces a verified one): a ``checkpoint.dir`` (a
    ``CheckpointStore``) that holds one already is refused."""
    if spec.checkpoint.resume == "auto":
        return []
    held = store.verified_steps()
    if not held:
        return []
    return [Problem("checkpoint.resume", f"never, but {store.root_uri} holds checkpoints of an "
                    f"earlier run (newest: step {held[-1]})", "give the run its own "
                    "checkpoint.dir (or runtime.output_dir), or set checkpoint.resume=auto to "
                    "continue from them")]


def nothing_to_train(spec: JobSpec, step: int, where: str) -> SpecError:
    """The refusal of a run whose checkpoint already holds its last step."""
    return SpecError([Problem("training.steps", f"{spec.training.steps}, but {where} {step}: "
                              "nothing to train", f"raise training.steps above {step} to train "
                              "further, or start anew with another runtime.output_dir")])


def checkpoints(spec: JobSpec):
    """The run's ``Checkpointer`` (its store: ``checkpoint.dir``, else the output directory's)."""
    from trainmesh.controller.checkpointing import Checkpointer

    return Checkpointer(spec, Path(spec.resolved_output_dir()), lambda message: None)


def final_checkpoint_step(spec: JobSpec) -> int | None:
    """The step of the newest checkpoint a run of ``spec`` would resume from when that is its
    last step or later (nothing left to train), else None. Such a refusal trains nothing, so
    the checkpoint must verify whole first (its files' sha256s, read here once): a corrupt one
    is the ranks' to set aside, and the run resumes from the one before it."""
    ckpts = checkpoints(spec)
    found = ckpts.latest()  # (files present at their sizes)
    if found is None or int(found[1]["data_position"]["step"]) < spec.training.steps:
        return None
    if ckpts.store.read_manifest(found[0], hashes=True) is None:
        return None
    return int(found[1]["data_position"]["step"])


@dataclass(frozen=True)
class Prepared:
    """A run's spec with absolute paths, its output directory and tracking URI (None: off)."""

    spec: JobSpec
    out: Path
    tracking_uri: str | None


def prepare_run(spec: JobSpec, environ: Mapping[str, str], train: bool = True) -> Prepared:
    """Everything before Ray starts; raises ``SpecError`` naming the field and the fix.
    ``train``: a training run (refused when its checkpoint already holds its last step, and
    tracked), not a dry run or an evaluation."""
    broken = preflight_problems(spec, environ)
    if broken:
        raise SpecError(broken)
    spec = with_absolute_output(spec, Path.cwd())
    out = make_output_dir(spec)
    if not train:
        return Prepared(spec, out, None)
    broken = earlier_run_problems(spec, checkpoints(spec).store)
    if broken:
        raise SpecError(broken)
    reached = final_checkpoint_step(spec)
    if reached is not None:  # known before any rank starts
        raise nothing_to_train(spec, reached, "its newest checkpoint is at step")
    uri = None
    if spec.tracking.enabled:
        from trainmesh.tracking.mlflow_tracker import resolve_tracking_uri

        uri = resolve_tracking_uri(spec.tracking.uri, environ.get("MLFLOW_TRACKING_URI"), out)
    return Prepared(spec, out, uri)
