"""Checkpoint directories and their manifests, on any fsspec filesystem (no torch).

Layout: ``ROOT/step-NNNNNN/`` holds the Distributed Checkpoint files and ``manifest.json``.
ROOT is a local path or a URI (``file://``, ``s3://``, ``gs://``, ... — whatever fsspec has an
implementation installed for).

The manifest is the commit record, on every filesystem. A save writes its files under their
final directory; the manifest (size and sha256 of every file, computed by the ranks that wrote
them) is written last, at its final place, in one atomic write (a write, an fsync and a rename
on a local disk; one object PUT on an object store) once every file it lists is there. Nothing
renames a directory: object stores have no such thing (a "move" is a copy of every object, then
a delete), and a process that dies mid-copy would leave half a checkpoint under the final name.
A step directory counts only if its manifest verifies: readable, and every file it lists there
at its size (and, where asked, its sha256). A save of step N replaces a ``step-N/`` that does not
verify and never one that does; ``prune`` deletes only behind verified checkpoints and never the
newest verified one; ``cleanup`` removes what interrupted saves left, older than the newest
verified checkpoint. Deleting a checkpoint removes its manifest first, so that a delete
interrupted half-way leaves a directory that no longer counts.

A synchronous save is published as soon as its files are written and synced, with their sizes;
the ranks take the sha256s afterwards, off the training's path, and ``add_digests`` writes them
into the manifest (atomically again). Until then (``"sha256": null``) its files are checked by
size only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Iterator
from typing import Any

from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_PREFIX = "step-"
_PARTIAL = ".partial"


def is_uri(root: str) -> bool:
    return "://" in root


class CheckpointStore:
    """The checkpoints under one root. Paths it returns are the filesystem's own paths (plain
    absolute paths on a local disk); ``uri`` turns one into what DCP and users are given."""

    def __init__(self, root: str | os.PathLike):
        self.root_uri = str(root)
        self.fs, self.root = url_to_fs(self.root_uri)
        self.local = isinstance(self.fs, LocalFileSystem)

    def uri(self, path: str) -> str:
        return self.fs.unstrip_protocol(path) if is_uri(self.root_uri) else path

    def step_dir(self, step: int) -> str:
        return f"{self.root}/{_PREFIX}{step:06d}"

    def prepare(self, step: int) -> str | None:
        """The directory to save ``step`` into — its final place — emptied of what an
        interrupted save (or a stale manifest) left there; or None when a checkpoint of
        ``step`` that verifies is there already: it is never replaced (a
        resumed run saving the same step again: the same state)."""
        d = self.step_dir(step)
        self.fs.invalidate_cache(self.root)
        if self.fs.exists(d):
            # (sizes: the ranks check sha256s when they restore; strict: a store that fails
            # to answer raises, it never gets a checkpoint deleted)
            if self.read_manifest(d, hashes=False, quiet=True, strict=True) is not None:
                return None
            self.remove(d)
        self.fs.makedirs(d, exist_ok=True)
        return d

    def discard(self, d: str) -> None:
        """Remove a save that failed or was never committed (one without a manifest: a
        committed checkpoint is never discarded)."""
        self.fs.invalidate_cache(d)
        if self.fs.exists(d) and not self.fs.exists(f"{d}/{MANIFEST}"):
            self.remove(d)

    def remove(self, d: str) -> None:
        """Delete a step directory, its manifest first (a delete interrupted half-way leaves a
        directory that does not count)."""
        try:
            self.fs.rm(f"{d}/{MANIFEST}")
        except FileNotFoundError:
            pass
        try:
            self.fs.rm(d, recursive=True)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(self.root)

    def write_bytes(self, directory: str, name: str, data: bytes) -> None:
        self.fs.makedirs(directory, exist_ok=True)
        self.fs.pipe_file(f"{directory}/{name}", data)

    def read_bytes(self, directory: str, name: str) -> bytes | None:
        path = f"{directory}/{name}"
        return self.fs.cat_file(path) if self.fs.exists(path) else None

    def _sha256(self, path: str) -> str:
        return _sha256(self.fs, path)

    def _payload_files(self, d: str) -> dict[str, int]:
        """{path relative to d: size} of every file but the manifest."""
        found = self.fs.find(d, detail=True)
        return {p[len(d) + 1:]: int(info["size"]) for p, info in sorted(found.items())
                if info["type"] == "file" and p.rsplit("/", 1)[-1] != MANIFEST}

    def commit(self, d: str, meta: dict[str, Any],
               digests: dict[str, dict[str, Any]] | None = None) -> str:
        """Write the manifest of the save in ``d`` last and atomically: the commit. Returns ``d``.

        ``digests``: {file: {"size", "sha256"}} the ranks computed for the files they wrote
        (sha256 None: still being taken, ``add_digests``); only files no rank reported (the
        controller's own) are hashed here. A reported file
        that is not in the directory means the ranks wrote somewhere else (storage that is not
        shared): :class:`IncompleteCheckpoint`, and nothing is committed."""
        self.fs.invalidate_cache(d)
        digests = digests or {}
        have = self._payload_files(d)
        missing = sorted(set(digests) - set(have))
        if missing:
            raise IncompleteCheckpoint(
                f"{len(missing)} file(s) the ranks wrote are not in {self.uri(d)} "
                f"(e.g. {missing[0]}): the ranks do not share this storage")
        files = {rel: digests[rel] if digests.get(rel, {}).get("size") == size else
                 {"size": size, "sha256": self._sha256(f"{d}/{rel}")}
                 for rel, size in have.items()}
        if self.local:  # the files' names durable before the manifest that lists them
            _fsync_dir(d)
        self._write_manifest(d, {**meta, "files": files})
        if self.local:  # the manifest's name, and the step directory's in the root
            _fsync_dir(d)
            _fsync_dir(self.root)
        return d

    def _write_manifest(self, d: str, manifest: dict[str, Any]) -> None:
        data = json.dumps(manifest, indent=1, sort_keys=True).encode()
        if self.local:  # write, fsync, rename: atomic on a POSIX filesystem
            tmp = f"{d}/{MANIFEST}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, f"{d}/{MANIFEST}")
        else:  # one object PUT: atomic on object stores
            self.fs.pipe_file(f"{d}/{MANIFEST}", data)

    def add_digests(self, d: str, digests: dict[str, dict[str, Any]]) -> int | None:
        """Write into the published checkpoint ``d``'s manifest the sha256s it lacks, from
        ``digests`` (the ranks', of the files they wrote for it; a file whose size differs is
        left without); returns how many it still lacks (0: complete), or None if it is gone
        (pruned, set aside: left alone)."""
        try:
            manifest = json.loads(self.fs.cat_file(f"{d}/{MANIFEST}"))
        except (OSError, ValueError):
            return None
        files, added = manifest.get("files", {}), 0
        for name, want in files.items():
            got = digests.get(name, {})
            if want.get("sha256") is None and got.get("sha256") and got.get("size") == want["size"]:
                want["sha256"] = got["sha256"]
                added += 1
        if added:
            self._write_manifest(d, manifest)
        return sum(v.get("sha256") is None for v in files.values())

    def read_manifest(self, d: str, verify: bool = True, hashes: bool = True,
                      quiet: bool = False, strict: bool = False) -> dict[str, Any] | None:
        """The manifest of a complete, intact checkpoint, else None (with a warning why,
        unless ``quiet``). ``verify``: every file present with its size, and (``hashes``) its
        sha256 where recorded — hashing here is one process; the controller has the ranks do
        it instead (``bad_files``). ``strict``: a store that fails to answer (anything but a
        missing or unparsable manifest) raises instead of counting as "does not verify": what
        decides a deletion must not take a timeout for a broken checkpoint."""
        warn = (lambda *a: None) if quiet else log.warning
        try:
            meta = json.loads(self.fs.cat_file(f"{d}/{MANIFEST}"))
        except (FileNotFoundError, ValueError) as err:
            warn("skipping checkpoint %s: no readable manifest (%s)", self.uri(d), err)
            return None
        except OSError as err:
            if strict:
                raise
            warn("skipping checkpoint %s: no readable manifest (%s)", self.uri(d), err)
            return None
        if not verify:
            return meta
        have = self._payload_files(d)
        for rel, want in meta.get("files", {}).items():
            if have.get(rel) != want["size"] or (hashes and want.get("sha256") is not None
                                                  and self._sha256(f"{d}/{rel}") != want["sha256"]):
                warn("skipping checkpoint %s: %s is missing or corrupt", self.uri(d), rel)
                return None
        return meta

    def verified_steps(self, hashes: bool = False, strict: bool = False) -> list[int]:
        """The steps whose checkpoint verifies (``hashes``: sha256s too), oldest first
        (``strict``: as ``read_manifest``'s)."""
        return [s for s in self.complete_steps() if self.read_manifest(
            self.step_dir(s), hashes=hashes, quiet=True, strict=strict) is not None]

    def complete_steps(self) -> list[int]:
        """Steps with a directory (newest last), verified or not: ``intact`` and
        ``verified_steps`` tell which count."""
        self.fs.invalidate_cache(self.root)
        if not self.fs.isdir(self.root):
            return []
        steps = []
        for info in self.fs.ls(self.root, detail=True):
            name = info["name"].rstrip("/").rsplit("/", 1)[-1]
            if info["type"] == "directory" and name.startswith(_PREFIX) and name[len(_PREFIX):].isdigit():
                steps.append(int(name[len(_PREFIX):]))
        return sorted(steps)

    def latest(self, hashes: bool = True) -> tuple[str, dict[str, Any]] | None:
        """The newest intact checkpoint and its manifest, skipping corrupt or partial ones
        (``hashes=False``: checked by file sizes only)."""
        return next(self.intact(hashes), None)

    def intact(self, hashes: bool = True) -> Iterator[tuple[str, dict[str, Any]]]:
        """Published checkpoints whose files match their manifest, newest first."""
        for step in reversed(self.complete_steps()):
            d = self.step_dir(step)
            meta = self.read_manifest(d, hashes=hashes)
            if meta is not None:
                yield d, meta

    def quarantine(self, d: str) -> str:
        """Set a checkpoint found corrupt aside (``step-N.corrupt-T``), for a person to look
        at: never restored again, and the step can be saved anew. Returns where it went. Its
        files are copied there one by one (no directory rename: object stores have none), then
        the original is removed, its manifest first."""
        import time

        aside = f"{d}.corrupt-{int(time.time())}"
        if self.local:  # a local rename is one atomic step
            self.fs.mv(d, aside, recursive=True)
        else:
            for rel in [*self._payload_files(d), MANIFEST]:
                if self.fs.exists(f"{d}/{rel}"):
                    self.fs.copy(f"{d}/{rel}", f"{aside}/{rel}")
            self.remove(d)
        self.fs.invalidate_cache(self.root)
        return aside

    def prune(self, keep_last: int, verified: list[int] | None = None) -> list[int]:
        """Delete the verified checkpoints older than the newest ``keep_last`` verified ones
        (0: keep all); returns the deleted steps. Only checkpoints that verify are counted as
        kept (by their files' sizes: the ranks check sha256s when they restore), so the newest
        verified one is never deleted for a broken one; what does not verify is ``cleanup``'s.
        ``verified``: ``verified_steps(strict=True)``, when the caller has it already."""
        if keep_last <= 0:
            return []
        verified = self.verified_steps(strict=True) if verified is None else verified
        doomed = verified[:-keep_last]
        for s in doomed:
            self.remove(self.step_dir(s))
        return doomed

    def cleanup(self, keep: Iterable[int] = (), verified: list[int] | None = None) -> list[str]:
        """Remove what interrupted saves left: step directories that do not verify and are
        older than the newest verified checkpoint (never one in ``keep``: a save in flight),
        and ``step-N.partial`` directories of earlier versions. Returns what was removed."""
        if verified is None:
            verified = self.verified_steps(strict=True)
        keep = set(keep)
        newest = verified[-1] if verified else None
        gone = []
        for s in self.complete_steps():
            if newest is not None and s < newest and s not in verified and s not in keep:
                self.remove(self.step_dir(s))
                gone.append(self.step_dir(s))
        self.fs.invalidate_cache(self.root)
        if self.fs.isdir(self.root):
            for info in self.fs.ls(self.root, detail=True):
                name = info["name"].rstrip("/").rsplit("/", 1)[-1]
                if info["type"] == "directory" and name.startswith(_PREFIX) and name.endswith(_PARTIAL):
                    self.fs.rm(info["name"], recursive=True)
                    gone.append(info["name"])
        return gone

    def exists(self, step: int) -> bool:
        """Whether ``step``'s checkpoint verifies (its files at their sizes)."""
        return self.read_manifest(self.step_dir(step), hashes=False, quiet=True) is not None


class IncompleteCheckpoint(RuntimeError):
    """A save whose files are not all where the manifest is being written."""


def _sha256(fs, path: str) -> str:
    with fs.open(path, "rb") as f:
        return read_digest(f)["sha256"]


def read_digest(f, block: int = 4 << 20) -> dict[str, Any]:
    """{"size", "sha256"} of an open file, read from where it is to its end."""
    h, size = hashlib.sha256(), 0
    while chunk := f.read(block):
        h.update(chunk)
        size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def file_digests(directory: str, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """{name: {"size", "sha256"}} of files in ``directory`` (a path or URI), as a manifest
    records them."""
    fs, root = url_to_fs(directory)
    return {n: {"size": int(fs.size(f"{root}/{n}")), "sha256": _sha256(fs, f"{root}/{n}")}
            for n in names}


def bad_files(directory: str, files: dict[str, dict[str, Any]]) -> list[str]:
    """The names among ``files`` (a share of a manifest) that are missing, or whose size or
    sha256 differs (a file without its sha256 yet: its size): what a rank checks, in parallel
    with the others, before a restore."""
    fs, root = url_to_fs(directory)
    bad = []
    for name, want in sorted(files.items()):
        path = f"{root}/{name}"
        try:
            ok = int(fs.size(path)) == want["size"] and (
                want["sha256"] is None or _sha256(fs, path) == want["sha256"])
        except (OSError, KeyError):
            ok = False
        if not ok:
            bad.append(name)
    return bad


def split_by_size(files: dict[str, dict[str, Any]], n: int) -> list[dict[str, dict[str, Any]]]:
    """``files`` in ``n`` shares of about equal bytes (largest first, each to the lightest)."""
    shares: list[dict[str, dict[str, Any]]] = [{} for _ in range(n)]
    load = [0] * n
    for name, info in sorted(files.items(), key=lambda kv: -kv[1]["size"]):
        i = load.index(min(load))
        shares[i][name] = info
        load[i] += info["size"]
    return shares


def _fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
