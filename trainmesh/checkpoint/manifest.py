"""Checkpoint directories and their manifests (pure file handling, no torch).

Layout: ``ROOT/step-NNNNNN/`` holds the Distributed Checkpoint files and ``manifest.json``.
A save goes to ``ROOT/step-NNNNNN.partial/``; the manifest (sizes and sha256 of every file)
is written last, atomically, and only then is the directory renamed to its final name. So a
crash at any point leaves every complete checkpoint as it was, and restore skips anything
without a manifest that matches its files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_PREFIX = "step-"
_PARTIAL = ".partial"


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"{_PREFIX}{step:06d}"


def partial_dir(root: str | Path, step: int) -> Path:
    """A fresh, empty directory to save ``step`` into (leftovers of a crashed save removed)."""
    p = Path(root) / f"{_PREFIX}{step:06d}{_PARTIAL}"
    if p.exists():
        shutil.rmtree(p)
    p.mkdir(parents=True)
    return p


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _payload_files(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file() and p.name != MANIFEST)


def commit(partial: Path, meta: dict[str, Any]) -> Path:
    """Write the manifest last and atomically, then publish the directory. Returns it."""
    files = {str(p.relative_to(partial)): {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in _payload_files(partial)}
    tmp = partial / (MANIFEST + ".tmp")
    with tmp.open("w") as f:
        json.dump({**meta, "files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, partial / MANIFEST)
    final = partial.with_name(partial.name[: -len(_PARTIAL)])
    if final.exists():  # the same step saved before (a resumed run): keep the older copy
        shutil.rmtree(partial)
        return final
    os.rename(partial, final)
    _fsync_dir(final.parent)
    return final


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(d: Path, verify: bool = True) -> dict[str, Any] | None:
    """The manifest of a complete, intact checkpoint, else None (with a warning why)."""
    try:
        meta = json.loads((d / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        log.warning("skipping checkpoint %s: no readable manifest (%s)", d, err)
        return None
    if not verify:
        return meta
    for rel, want in meta.get("files", {}).items():
        p = d / rel
        if not p.is_file() or p.stat().st_size != want["size"] or _sha256(p) != want["sha256"]:
            log.warning("skipping checkpoint %s: %s is missing or corrupt", d, rel)
            return None
    return meta


def complete_steps(root: str | Path) -> list[int]:
    """Steps with a published directory (newest last); not yet verified."""
    r = Path(root)
    if not r.is_dir():
        return []
    steps = []
    for p in r.iterdir():
        name = p.name
        if p.is_dir() and name.startswith(_PREFIX) and name[len(_PREFIX):].isdigit():
            steps.append(int(name[len(_PREFIX):]))
    return sorted(steps)


def latest(root: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest intact checkpoint and its manifest, skipping corrupt or partial ones."""
    for step in reversed(complete_steps(root)):
        d = step_dir(root, step)
        meta = read_manifest(d)
        if meta is not None:
            return d, meta
    return None


def prune(root: str | Path, keep_last: int) -> list[int]:
    """Delete all but the newest ``keep_last`` published checkpoints; returns deleted steps."""
    steps = complete_steps(root)
    doomed = steps[:-keep_last] if keep_last > 0 else []
    for s in doomed:
        shutil.rmtree(step_dir(root, s), ignore_errors=True)
    return doomed
