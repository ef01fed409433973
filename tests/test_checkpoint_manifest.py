"""Manifests: written last and atomically; partial or corrupt checkpoints are never used.

Every test runs on a local directory and on fsspec's in-memory filesystem (an object-store-
like filesystem that is not the local disk: no os.rename, no fsync), through the same code.
"""

from __future__ import annotations

import json
import uuid

import fsspec
import pytest

from trainmesh.checkpoint import manifest
from trainmesh.checkpoint.manifest import CheckpointStore


@pytest.fixture(params=["local", "memory"])
def store(request, tmp_path):
    if request.param == "local":
        yield CheckpointStore(tmp_path / "ckpt")
        return
    root = f"memory://ckpt-{uuid.uuid4().hex}"
    yield CheckpointStore(root)
    fsspec.filesystem("memory").rm(root, recursive=True)


def _save(store, step, payload=b"data"):
    p = store.partial_dir(step)
    store.write_bytes(p, "shard.bin", payload)
    store.write_bytes(f"{p}/nested", "part.bin", payload * 2)
    return store.commit(p, {"step": step})


def test_commit_publishes_with_sizes_and_checksums(store):
    d = _save(store, 5)
    assert d == store.step_dir(5) and not store.fs.exists(d + ".partial")
    meta = json.loads(store.fs.cat_file(f"{d}/{manifest.MANIFEST}"))
    assert meta["step"] == 5 and meta["files"]["shard.bin"]["size"] == 4
    assert meta["files"]["nested/part.bin"]["size"] == 8
    assert store.latest()[1]["step"] == 5
    assert store.uri(d).startswith("memory://" if "memory" in store.root_uri else "/")


def test_interrupted_save_leaves_last_good_checkpoint(store):
    _save(store, 2)
    p = store.partial_dir(4)  # a save that died before its manifest
    store.write_bytes(p, "shard.bin", b"half")
    assert store.complete_steps() == [2] and store.latest()[1]["step"] == 2
    # a new save of the same step clears the leftovers first
    assert store.fs.find(store.partial_dir(4)) == []


def test_corrupt_missing_or_truncated_checkpoint_is_skipped(store, caplog):
    _save(store, 2)
    d4 = _save(store, 4)
    store.write_bytes(d4, "shard.bin", b"datX")  # same size, different bytes
    assert store.latest()[1]["step"] == 2
    assert "corrupt" in caplog.text
    d6 = _save(store, 6)
    store.fs.rm(f"{d6}/nested/part.bin")  # a publish (copy) that stopped half way
    assert store.latest()[1]["step"] == 2
    d8 = _save(store, 8)
    store.write_bytes(d8, manifest.MANIFEST, b"{trunc")
    assert store.latest()[1]["step"] == 2


def test_resaving_a_published_step_keeps_the_old_copy(store):
    _save(store, 3, b"old!")
    _save(store, 3, b"new!")
    assert store.read_bytes(store.step_dir(3), "shard.bin") == b"old!"


def test_discard_removes_only_unpublished_saves(store):
    d = _save(store, 1)
    store.discard(d)  # a published checkpoint is never removed this way
    p = store.partial_dir(2)
    store.write_bytes(p, "shard.bin", b"x")
    store.discard(p)
    assert store.complete_steps() == [1] and not store.fs.exists(p)


def test_prune_keeps_newest(store):
    for s in (1, 2, 3, 4):
        _save(store, s)
    assert store.prune(keep_last=2) == [1, 2]
    assert store.complete_steps() == [3, 4]
