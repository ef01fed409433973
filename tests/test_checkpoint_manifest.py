"""Manifests: written last and atomically; partial or corrupt checkpoints are never used."""

from __future__ import annotations

import json

from trainmesh.checkpoint import manifest


def _save(root, step, payload=b"data"):
    p = manifest.partial_dir(root, step)
    (p / "shard.bin").write_bytes(payload)
    return manifest.commit(p, {"step": step})


def test_commit_publishes_with_sizes_and_checksums(tmp_path):
    d = _save(tmp_path, 5)
    assert d == manifest.step_dir(tmp_path, 5)
    meta = json.loads((d / manifest.MANIFEST).read_text())
    assert meta["step"] == 5 and meta["files"]["shard.bin"]["size"] == 4
    assert manifest.latest(tmp_path)[1]["step"] == 5


def test_interrupted_save_leaves_last_good_checkpoint(tmp_path):
    _save(tmp_path, 2)
    p = manifest.partial_dir(tmp_path, 4)  # a save that died before its manifest
    (p / "shard.bin").write_bytes(b"half")
    assert manifest.latest(tmp_path)[1]["step"] == 2
    # a new save of the same step clears the leftovers first
    assert list(manifest.partial_dir(tmp_path, 4).iterdir()) == []


def test_corrupt_or_truncated_checkpoint_is_skipped(tmp_path, caplog):
    _save(tmp_path, 2)
    d4 = _save(tmp_path, 4)
    (d4 / "shard.bin").write_bytes(b"datX")  # same size, different bytes
    assert manifest.latest(tmp_path)[1]["step"] == 2
    assert "corrupt" in caplog.text
    d6 = _save(tmp_path, 6)
    (d6 / manifest.MANIFEST).write_text("{trunc")
    assert manifest.latest(tmp_path)[1]["step"] == 2


def test_resaving_a_published_step_keeps_the_old_copy(tmp_path):
    _save(tmp_path, 3, b"old!")
    _save(tmp_path, 3, b"new!")
    assert (manifest.step_dir(tmp_path, 3) / "shard.bin").read_bytes() == b"old!"


def test_prune_keeps_newest(tmp_path):
    for s in (1, 2, 3, 4):
        _save(tmp_path, s)
    assert manifest.prune(tmp_path, keep_last=2) == [1, 2]
    assert manifest.complete_steps(tmp_path) == [3, 4]
