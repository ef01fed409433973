"""Manifests: written last and atomically; partial or corrupt checkpoints are never used.

Every test runs on a local directory, on fsspec's in-memory filesystem (not the local disk: no
os.rename, no fsync) and on a real S3 endpoint on loopback (moto's server through s3fs: no
directories, a "move" is a copy then a delete), through the same code.
"""

from __future__ import annotations

import json
import uuid

import fsspec
import pytest

from trainmesh.checkpoint import manifest
from trainmesh.checkpoint.manifest import CheckpointStore


@pytest.fixture(params=["local", "memory", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        yield CheckpointStore(tmp_path / "ckpt")
        return
    if request.param == "s3":
        server = request.getfixturevalue("s3_server")
        yield CheckpointStore(f"s3://{server.bucket()}/ckpt")
        return
    root = f"memory://ckpt-{uuid.uuid4().hex}"
    yield CheckpointStore(root)
    fsspec.filesystem("memory").rm(root, recursive=True)


def _save(store, step, payload=b"data"):
    d = store.prepare(step)
    if d is None:  # a verified checkpoint of the step is there: kept
        return store.step_dir(step)
    store.write_bytes(d, "shard.bin", payload)
    store.write_bytes(f"{d}/nested", "part.bin", payload * 2)
    return store.commit(d, {"step": step})


def _interrupted(store, step, payload=b"half"):
    """A save that died before its manifest: its files under the step's directory."""
    d = store.prepare(step)
    store.write_bytes(d, "shard.bin", payload)
    return d


def test_commit_writes_the_manifest_last_with_sizes_and_checksums(store):
    d = _save(store, 5)
    assert d == store.step_dir(5)  # written in place: nothing is renamed
    meta = json.loads(store.fs.cat_file(f"{d}/{manifest.MANIFEST}"))
    assert meta["step"] == 5 and meta["files"]["shard.bin"]["size"] == 4
    assert meta["files"]["nested/part.bin"]["size"] == 8
    assert store.latest()[1]["step"] == 5
    assert store.uri(d).startswith(store.root_uri.split("ckpt")[0] if "://" in store.root_uri else "/")


def test_interrupted_save_leaves_last_good_checkpoint(store):
    _save(store, 2)
    _interrupted(store, 4)
    assert store.verified_steps() == [2] and store.latest()[1]["step"] == 2
    # a new save of the same step clears the leftovers first
    assert store.fs.find(store.prepare(4)) == []


def test_corrupt_missing_or_truncated_checkpoint_is_skipped(store, caplog):
    _save(store, 2)
    d4 = _save(store, 4)
    store.write_bytes(d4, "shard.bin", b"datX")  # same size, different bytes
    assert store.latest()[1]["step"] == 2
    assert "corrupt" in caplog.text
    d6 = _save(store, 6)
    store.fs.rm(f"{d6}/nested/part.bin")  # a copy that stopped half way
    assert store.latest()[1]["step"] == 2
    d8 = _save(store, 8)
    store.write_bytes(d8, manifest.MANIFEST, b"{trunc")
    assert store.latest()[1]["step"] == 2


def test_resaving_a_verified_step_keeps_it_and_replaces_one_that_does_not_verify(store):
    _save(store, 3, b"old!")
    assert store.prepare(3) is None  # verified: never replaced
    assert _save(store, 3, b"new!") == store.step_dir(3)
    assert store.read_bytes(store.step_dir(3), "shard.bin") == b"old!"
    # a copy cut short under the final name (a file missing): replaced by the next save
    store.fs.rm(f"{store.step_dir(3)}/nested/part.bin")
    _save(store, 3, b"new!")
    assert store.read_bytes(store.step_dir(3), "shard.bin") == b"new!"
    assert store.latest()[1]["step"] == 3
    # a stale manifest whose files are gone: the same
    store.fs.rm(f"{store.step_dir(3)}/shard.bin")
    assert not store.exists(3)
    _save(store, 3, b"3rd!")
    assert store.exists(3) and store.read_bytes(store.step_dir(3), "shard.bin") == b"3rd!"


def test_discard_removes_only_uncommitted_saves(store):
    d = _save(store, 1)
    store.discard(d)  # a committed checkpoint is never removed this way
    p = _interrupted(store, 2)
    store.discard(p)
    assert store.complete_steps() == [1] and not store.fs.exists(p)


def test_prune_keeps_the_newest_verified_and_deletes_only_behind_them(store):
    for s in (1, 2, 3, 4):
        _save(store, s)
    assert store.prune(keep_last=2) == [1, 2]
    assert store.complete_steps() == [3, 4]
    # the newest is broken: with keep_last 1 the newest verified one (3) stays
    store.fs.rm(f"{store.step_dir(4)}/shard.bin")
    assert store.prune(keep_last=1) == [] and store.verified_steps() == [3]
    _save(store, 5)
    assert store.prune(keep_last=1) == [3]
    assert store.verified_steps() == [5]


def test_cleanup_removes_interrupted_saves_behind_the_newest_verified_only(store):
    _interrupted(store, 1)
    _save(store, 2)
    _interrupted(store, 3)  # newer than the newest verified: maybe a save in flight
    legacy = store.step_dir(4) + ".partial"  # an earlier version's leftover
    store.write_bytes(legacy, "shard.bin", b"old")
    gone = store.cleanup()
    assert store.step_dir(1) in gone and store.complete_steps() == [2, 3]
    assert not store.fs.exists(legacy)
    _save(store, 5)
    assert store.cleanup(keep={3}) == [] and store.complete_steps() == [2, 3, 5]
    assert store.cleanup() == [store.step_dir(3)] and store.complete_steps() == [2, 5]


def test_quarantine_sets_a_checkpoint_aside_on_any_filesystem(store):
    _save(store, 2)
    d4 = _save(store, 4)
    aside = store.quarantine(d4)
    assert store.complete_steps() == [2] and store.latest()[1]["step"] == 2
    assert store.fs.cat_file(f"{aside}/shard.bin") == b"data"
    assert json.loads(store.fs.cat_file(f"{aside}/{manifest.MANIFEST}"))["step"] == 4


def test_a_store_that_fails_to_answer_gets_nothing_deleted(tmp_path, monkeypatch):
    """Whether a checkpoint verifies decides deletions (a re-save of its step, pruning, clean-up):
    a read that fails for another reason than a missing manifest (a timeout, throttling,
    credentials that expired) raises there, instead of counting as "does not verify"."""
    store = CheckpointStore(tmp_path / "ckpt")
    _save(store, 2)
    _save(store, 4)
    real = store.fs.cat_file

    def flaky(path, *args, **kwargs):
        if path.endswith(manifest.MANIFEST):
            raise TimeoutError("the store did not answer")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(store.fs, "cat_file", flaky)
    for call in (lambda: store.prepare(4), lambda: store.prune(1), store.cleanup):
        with pytest.raises(TimeoutError):
            call()
    assert store.latest() is None  # (a restore skips what it cannot read: nothing deleted)
    monkeypatch.undo()
    assert store.verified_steps() == [2, 4]
