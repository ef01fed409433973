"""The in-memory checkpoint tier's decisions, without processes: each rank's buddy, which
snapshot a recovery may restore, and a snapshot that is still being written never counting.
(Snapshots meeting real node losses: test_placement_cluster.py, test_fault_matrix.py.)"""

from __future__ import annotations

import pytest

from trainmesh.checkpoint import memory_fs
from trainmesh.controller.memory_tier import MemoryTier, buddies


@pytest.mark.parametrize("nodes", [["a"] * 4 + ["b"] * 4, ["a", "a", "b", "b", "c", "c"],
                                   ["a"] * 4 + ["b"] * 2 + ["c"] * 2])
def test_any_one_nodes_loss_leaves_a_copy_of_every_ranks_snapshot(nodes):
    buddy = buddies(nodes)
    for lost in set(nodes):
        for r, node in enumerate(nodes):
            if node == lost:
                assert nodes[buddy[r]] != lost, (r, buddy)


def test_one_node_has_no_buddies():
    assert buddies(["a", "a"]) == [None, None]


class _Survivors:
    """What the survivors hold (``RankGroup.memory_inventory``'s answer)."""

    def __init__(self, inventory):
        self.inventory = inventory

    def memory_inventory(self):
        return self.inventory


def _tier(*steps, ranks=4):
    tier = MemoryTier(every=1)
    for s in steps:
        tier.snapshots[f"0001-{s:08d}"] = {"step": s, "ranks": ranks, "rng": None, "losses": [], "mesh": {}}
    return tier


def _files(*ranks):
    return [n for r in ranks for n in (f"__{r}_0.distcp", f"__{r}.metadata")]


def test_the_newest_snapshot_every_rank_of_which_survives_is_restored():
    # ranks 2-3 lost: rank 0 holds its own and rank 2's copy, rank 1 its own and rank 3's
    survivors = _Survivors([{"0001-00000004": _files(0, 2), "0001-00000005": _files(0, 2)},
                            {"0001-00000004": _files(1, 3), "0001-00000005": _files(1)}])
    # step 5: rank 3's copy had not arrived when its node went (its metadata comes last)
    directory, meta, holders = _tier(4, 5).newest_complete(survivors, at_least=0)
    assert directory == "0001-00000004" and meta["step"] == 4
    assert holders["__3.metadata"] == 1 and holders["__2_0.distcp"] == 0
    # not older than the newest storage checkpoint
    assert _tier(4, 5).newest_complete(survivors, at_least=5) is None
    # a node and its buddy lost: no rank holds rank 3's files
    assert _tier(4, 5).newest_complete(_Survivors([{"0001-00000004": _files(0, 1, 2)}]), 0) is None


def test_a_snapshot_some_rank_skipped_is_not_recorded_and_evicts_nothing():
    """A rank whose last snapshot is still being saved skips the next (0 bytes): that snapshot
    is incomplete, so the controller records it not, and the records of complete ones stay —
    two skipped in a row used to push the newest complete one out."""
    from test_controller_states import rank_streams

    from trainmesh.controller.memory_tier import MemoryTier

    class Ranks:
        def __init__(self):
            self.skip: set[int] = set()

        def memory_snapshot(self, directory, buddies):
            return [{"bytes": 0 if r in self.skip else 64, "blocked_s": 0.0,
                     "rng": rank_streams(r, len(buddies))} for r in range(len(buddies))]

    tier, ranks = MemoryTier(every=1), Ranks()
    nodes = ["a", "a", "b", "b"]
    tier.snapshot(ranks, 1, nodes, [], {})
    ranks.skip = {2}
    for step in (2, 3):
        metrics = tier.snapshot(ranks, step, nodes, [], {})
        assert metrics["snapshot_bytes"] == 3 * 64
    assert [m["step"] for m in tier.snapshots.values()] == [1]
    ranks.skip = set()
    tier.snapshot(ranks, 4, nodes, [], {})
    tier.snapshot(ranks, 5, nodes, [], {})
    assert [m["step"] for m in tier.snapshots.values()] == [4, 5]  # the newest two complete


def test_a_snapshot_being_written_is_not_held_until_committed():
    store = memory_fs.MemoryStore()
    fs = store.fs()
    fs.pipe_file(memory_fs.uri(".0001-00000007-3", "__3_0.distcp"), b"shard")
    fs.pipe_file(memory_fs.uri(".0001-00000007-3", "__3.metadata"), b"meta")
    assert store.held() == {}
    files = store.commit(".0001-00000007-3", "0001-00000007")
    assert list(files) == ["__3_0.distcp", "__3.metadata"]  # the metadata last
    assert sorted(store.held()["0001-00000007"]) == ["__3.metadata", "__3_0.distcp"]
    assert store.read("0001-00000007", "__3_0.distcp") == b"shard"
    assert memory_fs.MemoryStore().held() == {}  # each rank's store is its own


def test_a_restore_reads_missing_files_from_peers_and_forgets_them():
    store, peer = memory_fs.MemoryStore(), {memory_fs.uri("0001-00000004", "__1_0.distcp"): b"theirs"}
    store.put("0001-00000004", {"__0_0.distcp": b"mine"})
    with store.fetching(peer.get):
        with store.fs().open(memory_fs.uri("0001-00000004", "__1_0.distcp"), "rb") as f:  # as DCP reads
            assert f.read() == b"theirs"
        assert store.held() == {"0001-00000004": ["__0_0.distcp"]}  # a fetched file is not held
    assert store.read("0001-00000004", "__1_0.distcp") is None  # dropped after the restore
    assert store.read("0001-00000004", "__0_0.distcp") == b"mine"


def test_the_host_copy_is_the_state_as_copied_and_reuses_its_buffers():
    """What training waits for (``checkpoint/host_copy.py``): a copy apart from the training
    state, DTensors kept DTensors (DCP reshards them), the next copy into the same buffers."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from trainmesh.checkpoint.host_copy import HostCopy

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        w = distribute_tensor(torch.randn(4, 3), init_device_mesh("cpu", (1,)), [Shard(0)])
        state = {"model": {"w": w, "b": torch.randn(3)}, "optim": {"lr": 0.1, "betas": (0.9, 0.95)}}
        host = HostCopy(torch.device("cpu"))
        first = host.copy(state)
        assert type(first["model"]["w"]) is DTensor and first["model"]["w"].placements == (Shard(0),)
        assert torch.equal(first["model"]["w"].to_local(), w.to_local()) and host.nbytes == 15 * 4
        buffer = first["model"]["w"].to_local().data_ptr()
        with torch.no_grad():  # training goes on
            w.to_local().add_(1.0)
            state["model"]["b"].mul_(2.0)
        state["optim"]["lr"] = 0.05
        assert not torch.equal(first["model"]["w"].to_local(), w.to_local())
        second = host.copy(state)
        assert torch.equal(second["model"]["w"].to_local(), w.to_local())
        assert torch.equal(second["model"]["b"], state["model"]["b"]) and second["optim"]["lr"] == 0.05
        assert second["model"]["w"].to_local().data_ptr() == buffer  # the same host buffer
        state["model"]["c"] = torch.ones(2)  # another structure: copied anew
        assert torch.equal(host.copy(state)["model"]["c"], torch.ones(2)) and host.nbytes == 17 * 4
    finally:
        dist.destroy_process_group()


def test_a_snapshot_restores_exactly_with_each_tensor_read_in_place():
    """A restore from memory (``snapshot_io.snapshot_reader``) copies each tensor from the snapshot
    file's bytes: no record is loaded with its data (DCP's own reader ``torch.load``s each one:
    a tensor loaded with data fails here), none even for its layout once the snapshot is
    indexed (``index_snapshot``), and every dtype, a non-contiguous tensor and non-tensor state
    come back exactly. (Resharded onto another mesh, from peers' memory, on real ranks:
    test_reshard_restore.py.)"""
    import warnings
    from unittest import mock

    import torch
    import torch.distributed.checkpoint as dcp

    from trainmesh.checkpoint import snapshot_io

    state = {"w": torch.randn(64, 48), "t": torch.randn(48, 64).t(), "s": torch.randn(48, 64).t()[3:40],
             "bf": torch.randn(1000).bfloat16(), "i": torch.arange(7), "step": 7, "betas": (0.9, 0.95)}
    store, snap = memory_fs.MemoryStore(), "0001-00000003"
    load, layouts_read = torch.load, []

    def layout_only(*args, **kwargs):  # DCP's planner also loads non-tensor state this way
        out = load(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            assert out.is_meta, "a record was loaded with its data"
            layouts_read.append(out.shape)
        return out

    with warnings.catch_warnings():  # DCP warns that no process group is there (as intended)
        warnings.simplefilter("ignore", UserWarning)
        snapshot_io.snapshot(memory_fs.uri(snap), 0, state, store)
        for indexed in (False, True):
            if indexed:
                snapshot_io.index_snapshot(store, snap)
                [layouts] = store.layouts.values()
                assert len(layouts) == 5 and all(v.start is not None for v in layouts.values())
            target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None
                      for k, v in state.items()}
            layouts_read.clear()
            with mock.patch.object(torch, "load", layout_only):
                dcp.load(target, storage_reader=snapshot_io.snapshot_reader(
                    memory_fs.uri(snap), ["__0.metadata"], store), no_dist=True)
            assert len(layouts_read) == (0 if indexed else 5), indexed
            for k, v in state.items():
                assert (torch.equal(target[k], v) and target[k].dtype == v.dtype) if isinstance(
                    v, torch.Tensor) else target[k] == v, (k, indexed)
    store.drop(snap)
    assert store.layouts == {}


def test_any_part_of_a_saved_tensor_is_copied_at_any_alignment():
    """DCP writes a file's records back to back, so a tensor's bytes sit at any offset: a part
    of it (as a resharded restore reads: whole rows, or a block across rows) is copied exactly
    whatever the alignment, as bytes where it is contiguous, else through an aligned view."""
    import io
    from types import SimpleNamespace

    import torch

    from trainmesh.checkpoint import snapshot_io

    saved = torch.randn(6, 8, dtype=torch.float64)
    for prefix in range(8):
        f = io.BytesIO(b"x" * prefix)
        f.seek(0, io.SEEK_END)
        torch.save(saved, f)
        record = memoryview(f.getvalue())[prefix:]
        layout = snapshot_io._record_layout(record)
        for offsets, lengths in (([2, 0], [3, 8]), ([1, 3], [4, 5]), ([0, 0], [6, 8])):
            target = torch.empty(lengths, dtype=torch.float64)
            item = SimpleNamespace(storage_index="w", storage_offsets=offsets, lengths=lengths)
            snapshot_io._copy_saved(record, layout, item, target)
            rows, cols = (slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))
            assert torch.equal(target, saved[rows, cols]), (prefix, offsets)
