"""The in-memory checkpoint tier's decisions, without processes: each rank's buddy, which
snapshot a recovery may restore, and a snapshot that is still being written never counting.
(Snapshots meeting real node losses: test_placement_cluster.py, test_fault_matrix.py.)"""

from __future__ import annotations

import pytest

from trainmesh.checkpoint import memory_fs
from trainmesh.platform.memory_tier import MemoryTier, buddies


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


def test_a_snapshot_being_written_is_not_held_until_committed():
    memory_fs.keep_newest(0)
    try:
        fs = memory_fs.RankMemoryFS()
        fs.pipe_file(memory_fs.uri(".0001-00000007-3", "__3_0.distcp"), b"shard")
        fs.pipe_file(memory_fs.uri(".0001-00000007-3", "__3.metadata"), b"meta")
        assert memory_fs.held() == {}
        files = memory_fs.commit(".0001-00000007-3", "0001-00000007")
        assert list(files) == ["__3_0.distcp", "__3.metadata"]  # the metadata last
        assert sorted(memory_fs.held()["0001-00000007"]) == ["__3.metadata", "__3_0.distcp"]
        assert memory_fs.read("0001-00000007", "__3_0.distcp") == b"shard"
    finally:
        memory_fs.keep_newest(0)
