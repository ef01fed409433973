"""When a save counts: the controller's commit/drop policy for synchronous and background saves,
on a real checkpoint directory. The rank actors are stood in for by ``_Ranks``, which writes a
shard per rank the way DCP would and reports each rank's background-save state as the test
sets it (the real ranks' background saves run in tests/test_dp_zero3.py and test_fault_matrix.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainmesh.checkpoint.manifest import CheckpointStore, bad_files, file_digests, split_by_size
from trainmesh.cli.loading import load_spec
from trainmesh.controller.checkpointing import RNG_FILE, Checkpointer


class _Ranks:
    """``deferred``: as real ranks on local storage, a synchronous save reports its files'
    sizes first and their digests once every rank's status is "done" (the test sets them)."""

    def __init__(self, world: int = 2, deferred: bool = False):
        self.world, self.deferred = world, deferred
        self.statuses: list[str | None] = [None] * world

    def save(self, uri: str, background: bool) -> list[dict]:
        self.uri = uri
        for r in range(self.world):
            (Path(uri) / f"__{r}_0.distcp").write_bytes(bytes([r]) * 64)
        # (what the ranks' digests will say: of the files as written, wherever they are later)
        self.digests = file_digests(uri, [f"__{r}_0.distcp" for r in range(self.world)])
        running = background or self.deferred
        self.statuses = ["running"] * self.world if running else [None] * self.world
        return [{"coords": f"pp0.dp{r}.cp0.tp0", "layout": {"dp": self.world}, "cpu": f"cpu-{r}",
                 "device": None, "replica": "shared"} for r in range(self.world)]

    def wait_save(self) -> list[str | None]:
        return list(self.statuses)

    def saved_files(self) -> dict:
        """What real ranks report: each digests the files it wrote (here with a marker, so a
        test sees whether the manifest took the ranks' digests or hashed again)."""
        pending = self.deferred and not all(s == "done" for s in self.statuses)
        return {k: {**v, "by": "ranks", **({"sha256": None} if pending else {})}
                for k, v in self.digests.items()}

    def bad_files(self, uri: str, files: dict) -> list[str]:
        return sorted(b for share in split_by_size(files, self.world) for b in bad_files(uri, share))


class _Events:
    def __init__(self):
        self.events: list[tuple[str, dict]] = []
        self.metrics: list[tuple[dict, int]] = []

    def event(self, kind: str, **fields) -> None:
        self.events.append((kind, fields))

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.metrics.append((metrics, step))


def _setup(tmp_path, *overrides):
    warnings: list[str] = []
    spec = load_spec(None, [f"runtime.output_dir={tmp_path}", "checkpoint.keep_last=5", *overrides])
    return Checkpointer(spec, tmp_path, warnings.append), _Ranks(), _Events(), warnings


def test_synchronous_save_is_committed_at_once(tmp_path):
    ck, ranks, tracker, _ = _setup(tmp_path)
    ck.save(ranks, 2, {"losses": [1.0, 0.9]}, tracker, background=False)
    assert ck.pending is None and ck.steps == [2]
    d, meta = ck.latest()
    assert meta["step"] == 2 and meta["losses"] == [1.0, 0.9]
    assert set(meta["files"]) == {"__0_0.distcp", "__1_0.distcp", RNG_FILE}
    uri, rng = ck.restored(d)
    assert uri == d and json.loads(rng) == {  # every rank's streams, by its coordinates
        "layout": {"dp": 2}, "ranks": {f"pp0.dp{r}.cp0.tp0": {"cpu": f"cpu-{r}", "device": None,
                                                              "replica": "shared"} for r in (0, 1)}}
    [(kind, ev)] = tracker.events
    assert kind == "checkpoint" and ev["background"] is False and ev["steps_during"] == 0


def test_a_synchronous_save_counts_at_once_and_its_digests_follow_off_the_step(tmp_path):
    """The ranks take a synchronous save's digests after its write (``dcp_io.save``): it is
    published at once with its files' sizes, and their sha256s go into its manifest at the
    first step at which every rank has them; from then a corruption that keeps the size is
    caught. The controller hashes only its own file either way."""
    ck, _, tracker, warnings = _setup(tmp_path)
    ranks = _Ranks(deferred=True)
    ck.save(ranks, 2, {}, tracker, background=False)
    d, meta = ck.latest(ranks)  # counts at once (the ranks check sizes only, for now)
    assert meta["step"] == 2 and ck.steps == [2]
    assert {k for k, v in meta["files"].items() if v["sha256"] is None} == {"__0_0.distcp", "__1_0.distcp"}
    assert meta["files"][RNG_FILE]["sha256"]
    ranks.statuses = ["done", "running"]
    ck.poll(ranks, ranks.statuses, tracker)  # a step later, one rank still hashing
    assert ck.pending is not None and ck.latest()[1]["files"]["__0_0.distcp"]["sha256"] is None
    ranks.statuses = ["done", "done"]
    ck.poll(ranks, ranks.statuses, tracker)
    assert ck.pending is None and not warnings
    files = ck.latest()[1]["files"]
    for name, want in file_digests(d, ["__0_0.distcp", "__1_0.distcp"]).items():
        assert files[name] == {**want, "by": "ranks"}  # the ranks' digests, as the files are
    assert [k for k, _ in tracker.events] == ["checkpoint", "checkpoint-digests"]
    assert tracker.events[1][1]["lacking"] == 0 and tracker.events[1][1]["steps_during"] == 2
    (Path(d) / "__1_0.distcp").write_bytes(b"x" * 64)  # same size: only the digest tells
    ck.save(ranks, 4, {}, tracker, background=False)
    ranks.statuses = ["done", "done"]
    ck.settle(ranks, tracker)  # (as before the next save, at the end, before a resize)
    assert ck.latest(ranks)[1]["step"] == 4
    (Path(ck.store.step_dir(4)) / "__0_0.distcp").write_bytes(b"y" * 64)
    assert ck.latest(ranks) is None and len(warnings) == 2  # both caught: nothing left


def test_a_failure_before_a_synchronous_saves_digests_keeps_it_checked_by_size(tmp_path):
    """A failure while the ranks are still hashing does not cost the checkpoint (a recovery
    restores it, as it would have before the digests moved off the step): it stays published,
    its files checked by size — a shard cut short is caught — and its digests never come. It
    does not count towards ``keep_last``: the newest checkpoint with digests stays."""
    ck, _, tracker, warnings = _setup(tmp_path, "checkpoint.keep_last=1")
    ranks = _Ranks(deferred=True)
    ck.save(ranks, 2, {}, tracker, background=False)
    ranks.statuses = ["done", "done"]
    ck.poll(ranks, ranks.statuses, tracker)  # step 2's digests in
    ck.save(ranks, 4, {}, tracker, background=False)
    ck.forget()  # the job failed after step 4's write, its digests not in
    assert ck.store.complete_steps() == [2, 4]  # (keep_last=1: step 2 not pruned for it)
    d, meta = ck.latest(ranks)
    assert meta["step"] == 4 and meta["files"]["__1_0.distcp"]["sha256"] is None
    (Path(d) / "__1_0.distcp").write_bytes(b"short")
    assert ck.latest(ranks)[1]["step"] == 2  # (a size that differs: passed over at once)
    ck.save(ranks, 6, {}, tracker, background=False)  # (digests in at the first step after)
    ck.save(ranks, 8, {}, tracker, background=False)  # (step 6's digests never came)
    assert "step 6" in warnings[0] and "size only" in warnings[0]
    ranks.statuses = ["done", "done"]
    ck.settle(ranks, tracker)
    assert ck.store.complete_steps() == [8]


def test_a_step_saved_again_keeps_its_first_copy_and_none_of_the_new_digests(tmp_path):
    """A step saved again (a run that does not resume, or one that passed over it) keeps the
    copy published first (``CheckpointStore.commit``); the new save's digests, taken of files
    that were never published, are not written into that copy's manifest."""
    ck, _, tracker, warnings = _setup(tmp_path)
    ranks = _Ranks(deferred=True)
    ck.save(ranks, 4, {"first": True}, tracker, background=False)
    ck.forget()  # its digests never came
    first = json.loads((Path(ck.store.step_dir(4)) / "manifest.json").read_text())
    ranks.world = 3  # the new save's files differ from the kept copy's
    ck.save(ranks, 4, {"first": False}, tracker, background=False)
    assert ck.pending is None
    ranks.statuses = ["done"] * 3
    ck.settle(ranks, tracker)
    assert json.loads((Path(ck.store.step_dir(4)) / "manifest.json").read_text()) == first
    assert ck.latest(ranks)[1]["first"] is True and not warnings


def test_background_save_counts_only_once_every_rank_is_done(tmp_path):
    ck, ranks, tracker, _ = _setup(tmp_path, "checkpoint.async_save=true")
    ck.save(ranks, 2, {}, tracker, background=True)
    assert ck.latest() is None  # nothing counts yet
    ck.poll(ranks, ["done", "running"], tracker)  # a step later, one rank still writing
    assert ck.latest() is None and ck.pending is not None
    ck.poll(ranks, ["done", "done"], tracker)
    assert ck.latest()[1]["step"] == 2 and ck.pending is None
    [(kind, ev)] = tracker.events
    assert ev["background"] is True and ev["steps_during"] == 2
    assert tracker.metrics[0][1] == 2 and "checkpoint_blocked_s" in tracker.metrics[0][0]


def test_failed_background_save_is_dropped_and_the_previous_stays(tmp_path):
    ck, ranks, tracker, warnings = _setup(tmp_path)
    ck.save(ranks, 2, {}, tracker, background=False)
    ck.save(ranks, 4, {}, tracker, background=True)
    partial = ck.pending.directory  # (the step's own: no manifest yet)
    ck.poll(ranks, ["done", "failed: OSError(28, 'No space left on device')"], tracker)
    assert ck.pending is None and not Path(partial).exists()
    assert ck.latest()[1]["step"] == 2 and ck.published() == [ck.store.step_dir(2)]
    assert "step 4 was not saved" in warnings[0] and "No space left" in warnings[0]
    assert tracker.events[-1][0] == "checkpoint-failed"


def test_settle_waits_then_commits_or_drops(tmp_path):
    ck, ranks, tracker, warnings = _setup(tmp_path)
    ck.save(ranks, 2, {}, tracker, background=True)
    ranks.statuses = ["done", "done"]  # what waiting on the ranks returns
    ck.settle(ranks, tracker)
    assert ck.latest()[1]["step"] == 2 and tracker.events[-1][1]["steps_during"] == 0
    ck.save(ranks, 4, {}, tracker, background=True)
    ck.settle(ranks, tracker)  # a rank's write outlived the wait: it does not count
    assert ck.latest()[1]["step"] == 2 and "not finished in time" in warnings[0]


def test_a_save_interrupted_by_a_failure_never_counts(tmp_path):
    ck, ranks, tracker, _ = _setup(tmp_path)
    ck.save(ranks, 2, {}, tracker, background=False)
    ck.save(ranks, 4, {}, tracker, background=True)
    ck.forget()  # the job failed while step 4 was being written
    assert ck.latest()[1]["step"] == 2
    ck.save(ranks, 4, {}, tracker, background=False)  # saved again after the recovery
    assert ck.latest()[1]["step"] == 4
    assert CheckpointStore(tmp_path / "checkpoints").complete_steps() == [2, 4]


def test_the_manifest_takes_the_ranks_digests_and_the_ranks_catch_corruption(tmp_path):
    """The controller hashes only its own file (the RNG state); the shards' digests are the
    ranks'. On restore the ranks check the digests, a share each: a shard corrupted in place
    (same size) is caught, set aside, and the checkpoint before it is used."""
    ck, ranks, tracker, warnings = _setup(tmp_path)
    ck.save(ranks, 2, {}, tracker, background=False)
    ck.save(ranks, 4, {}, tracker, background=False)
    d4, meta = ck.latest(ranks)
    assert meta["step"] == 4
    assert {k for k, v in meta["files"].items() if v.get("by") == "ranks"} == {
        "__0_0.distcp", "__1_0.distcp"}
    assert "by" not in meta["files"][RNG_FILE]
    shard = Path(d4) / "__1_0.distcp"
    shard.write_bytes(b"x" * shard.stat().st_size)
    assert ck.latest()[1]["step"] == 4  # sizes alone cannot tell
    d, meta = ck.latest(ranks)
    assert meta["step"] == 2 and "__1_0.distcp" in warnings[0]
    assert not Path(d4).exists() and list(Path(d4).parent.glob("step-000004.corrupt-*"))
    ck.save(ranks, 4, {}, tracker, background=False)  # the step can be saved again
    assert ck.latest(ranks)[1]["step"] == 4


def test_files_the_ranks_wrote_elsewhere_are_not_a_checkpoint(tmp_path):
    """A rank reports a file the controller cannot see (node-local storage): nothing is
    published and the previous checkpoint stays the newest."""
    ck, ranks, tracker, warnings = _setup(tmp_path)
    ck.save(ranks, 2, {}, tracker, background=False)
    elsewhere = ranks.saved_files
    ranks.saved_files = lambda: {**elsewhere(), "__2_0.distcp": {"size": 1, "sha256": "0"}}
    ck.save(ranks, 4, {}, tracker, background=False)
    assert ck.latest()[1]["step"] == 2 and "not in" in warnings[0]
    assert "checkpoint.dir" in warnings[0]


def test_a_ranks_digests_are_taken_after_a_local_write_and_as_a_uris_is_written(tmp_path):
    """``dcp_io.save`` returns once the files are written: on a local path with their sizes
    only, their sha256s taken afterwards by a thread (the future); on a URI digested while
    written (no read back). Either way the digests are those of the files on disk, the
    metadata file included."""
    import torch

    from trainmesh.checkpoint import dcp_io

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    local = dcp_io.save(str(tmp_path / "plain"), model, opt)
    assert ".metadata" in local.sizes and any(n.endswith(".distcp") for n in local.sizes)
    on_disk = file_digests(str(tmp_path / "plain"), list(local.sizes))
    assert local.sizes == {n: {**d, "sha256": None} for n, d in on_disk.items()}
    assert local.digests.result(timeout=30) == on_disk
    uri = f"file://{tmp_path / 'uri'}"
    remote = dcp_io.save(uri, model, opt)
    assert remote.digests.done() and remote.sizes == remote.digests.result()
    assert remote.sizes == file_digests(uri, list(remote.sizes)) and ".metadata" in remote.sizes


def test_checkpoint_tensors_are_written_without_zip_crcs_and_load_back_exactly(tmp_path):
    """``torch.save``'s zip CRC32s (never checked by ``torch.load``) are skipped while a
    checkpoint is written, the process's option restored after: every tensor record of the
    shard file has CRC 0, the file's sha256 is still the manifest's guard, and the state loads
    back bit for bit."""
    import io
    import zipfile

    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from trainmesh.checkpoint import dcp_io

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 256)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    assert torch.serialization.get_crc32_options()
    dcp_io.save(tmp_path, model, opt)
    assert torch.serialization.get_crc32_options()  # restored
    meta = FileSystemReader(str(tmp_path)).read_metadata()
    tensors = {k for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    crcs = []
    for index, info in meta.storage_data.items():
        if index.fqn in tensors:
            blob = (tmp_path / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
            crcs += [z.CRC for z in zipfile.ZipFile(io.BytesIO(blob)).infolist() if z.file_size]
    assert len(crcs) >= len(tensors) >= 4 and set(crcs) == {0}, crcs
    fresh = torch.nn.Linear(64, 256)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    fresh(torch.randn(4, 64)).sum().backward()
    fresh_opt.step()
    dcp_io.load(tmp_path, fresh, fresh_opt)
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(opt.state.values(), fresh_opt.state.values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq"))


def test_the_zip_crc_option_is_restored_after_overlapping_writes_and_a_users_change():
    """``without_zip_crc`` counts overlapping writers (a background save's thread beside a
    snapshot): CRCs stay off until the last ends, then the option is what it was; a change
    made meanwhile by someone else is not overwritten."""
    import torch

    from trainmesh.checkpoint.zip_crc import without_zip_crc

    get, set_ = torch.serialization.get_crc32_options, torch.serialization.set_crc32_options
    try:
        first, second = without_zip_crc(), without_zip_crc()
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)
        assert get() is False  # the second writer is still writing
        second.__exit__(None, None, None)
        assert get() is True
        set_(False)  # the user's choice before a save: none
        with without_zip_crc():
            set_(True)  # ... changed mid-write: theirs stands, not the one saved before
        assert get() is True
        with pytest.raises(RuntimeError), without_zip_crc():  # a failed write restores too
            raise RuntimeError("disk full")
        assert get() is True
    finally:
        set_(True)
