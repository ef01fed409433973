"""A checkpoint written under one (tp, pp, vpp, dp) restores bit-identically under another."""

from __future__ import annotations

import pytest
import torch
from rank_pool import next_generation
from test_tensor_parallel import BASE
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from trainmesh.cli.loading import load_spec
from trainmesh.data.shards import ensure_tiny_corpus
from trainmesh.parallel.dims import ParallelDims
from trainmesh.testing import probes

SOURCE = (ParallelDims(pp=2, tp=2), ["parallelism.vpp=2", "schedule.name=interleaved-1f1b",
                                     "parallelism.sequence_parallel=true"])
TARGETS = {
    "dp4": (ParallelDims(dp=4), []),
    "hsdp-2x2": (ParallelDims(dp=4), ["parallelism.dp_replicate=2"]),  # FSDP2's HSDP mesh
    "tp4": (ParallelDims(tp=4), ["model.n_heads=4", "model.n_kv_heads=4"]),
    "pp4": (ParallelDims(pp=4), ["schedule.name=1f1b"]),
    "pp2-dp2": (ParallelDims(pp=2, dp=2), ["schedule.name=gpipe"]),
    "tp2-dp2": (ParallelDims(tp=2, dp=2), []),
    "single": (ParallelDims(), []),
}


def _spec(dims: ParallelDims, extra, tmp_path):
    return load_spec(None, [*BASE, "model.n_kv_heads=4", f"parallelism.pp={dims.pp}",
                            f"parallelism.tp={dims.tp}", f"parallelism.dp={dims.dp}",
                            f"runtime.output_dir={tmp_path}", *extra])


def _group(pool, spec, dims, data_dir):
    g = pool.group_for(spec, dims)
    g.build(spec.model_dump_json(), dims, data_dir)
    return g


def _flat(directory, tmp_path, name) -> dict:
    out = tmp_path / f"{name}.pt"
    dcp_to_torch_save(str(directory), str(out))
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def source_checkpoint(rank_pool, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("src")
    dims, extra = SOURCE
    spec = _spec(dims, extra, tmp)
    data_dir = str(ensure_tiny_corpus(tmp / "data"))
    g = _group(rank_pool, spec, dims, data_dir)
    try:
        for _ in range(2):  # non-trivial Adam moments
            g.train_step()
        probes.save_to(g, str(tmp / "ckpt"))
        # A snapshot is the rank's alone (no collective, even from its background thread): one
        # rank takes one while the others take none.
        import ray
        gen = next_generation(g)  # (named above what the processes hold)
        alone = ray.get(g.group.workers[0].memory_snapshot.remote(f"{gen:04d}-00000001", None, True),
                        timeout=30)
        assert alone["files_bytes"] > alone["bytes"] > 0
        # The same state as an in-memory snapshot, each rank's copy handed to the rank two
        # further on (as if ranks 0-1 and 2-3 were two nodes).
        snapshot = f"{gen:04d}-00000002"
        snap = g.memory_snapshot(snapshot, [2, 3, 0, 1], wait=True)
        assert all(r["blocked_s"] > 0 and r["bytes"] > 0 for r in snap)
    finally:
        rank_pool.release(g)
    return tmp / "ckpt", data_dir, _flat(tmp / "ckpt", tmp, "src"), snapshot


def _assert_same_state(got: dict, want: dict) -> None:
    assert set(got["model"]) == set(want["model"])
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    optim_keys = {k for k in want["optim"] if k.startswith("state.")}
    assert optim_keys and optim_keys == {k for k in got["optim"] if k.startswith("state.")}
    for k in optim_keys:
        assert torch.equal(torch.as_tensor(got["optim"][k]), torch.as_tensor(want["optim"][k])), k


@pytest.mark.timeout(300)
def test_restore_from_peers_memory_onto_another_plan_is_bit_identical(rank_pool, source_checkpoint,
                                                                      tmp_path):
    """Two of the four processes stand for a lost node: restored onto tp2 × dp2 from what the
    other two hold in memory (their own snapshots and the copies of the lost ones'), the state
    equals the storage checkpoint's (which every storage target below restores bit-identically)."""
    import itertools
    import time

    _, data_dir, want, snapshot = source_checkpoint
    dims, extra = TARGETS["tp2-dp2"]
    spec = _spec(dims, extra, tmp_path)
    g = _group(rank_pool, spec, dims, data_dir)
    try:
        deadline = time.monotonic() + 30
        while True:  # the copies travel in the background: wait until they have arrived
            held = [set(h.get(snapshot, [])) for h in g.memory_inventory()]
            files = set().union(*held)
            pair = next((p for p in itertools.combinations(range(4), 2)
                         if held[p[0]] | held[p[1]] == files and len(files) == 8), None)
            if pair or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert pair, held  # 4 ranks: shards and metadata; two survivors covering all of them
        assert all(held[r] != files for r in pair)  # neither alone: the copies are needed
        holders = {f: next(r for r in pair if f in held[r]) for f in files}
        got = g.memory_load(snapshot, holders, 2, None)
        # The ranks' metadata read once, by rank 0 (the merged metadata broadcast): the group
        # fetches the metadata files rank 0 lacks, no other rank any.
        meta = [[n for n in r["fetched"] if n.endswith(".metadata")] for r in got]
        lacking = sorted({f for f in files if f.endswith(".metadata")} - held[0])
        assert sorted(meta[0]) == lacking and lacking, (meta, held)  # (each once)
        assert not any(meta[1:]), meta
        probes.save_to(g, str(tmp_path / "again"))
    finally:
        rank_pool.release(g)
    _assert_same_state(_flat(tmp_path / "again", tmp_path, "again"), want)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("target", list(TARGETS))
def test_restore_under_another_plan_is_bit_identical(rank_pool, source_checkpoint, tmp_path,
                                                     target):
    ckpt, data_dir, want, _ = source_checkpoint
    dims, extra = TARGETS[target]
    spec = _spec(dims, extra, tmp_path)
    g = _group(rank_pool, spec, dims, data_dir)
    try:
        g.load(str(ckpt), 2, None)
        probes.save_to(g, str(tmp_path / "again"))
    finally:
        rank_pool.release(g)
    _assert_same_state(_flat(tmp_path / "again", tmp_path, "again"), want)


def test_ranks_that_answer_are_not_hung_however_long_a_restore_takes(rank_pool, tmp_path):
    """Outside a timed step only silence counts (``elastic.hang_timeout_s``; a frozen rank in a
    restore: the fault matrix): ranks in one long call — asleep here, as a restore waiting on
    its storage is — answer their control path and are not hung, 3.5× past a 1 s bound. Judged
    as a step is, they would be (every rank in one phase for half the bound, nobody moving)."""
    import sys

    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    dims = ParallelDims(dp=2)
    group = rank_pool.group_for(_spec(dims, ["elastic.hang_timeout_s=1"], tmp_path), dims)
    try:
        assert probes.execute(group, _asleep, 3.5) == [3.5, 3.5]
    finally:
        rank_pool.release(group)


def _asleep(engine, seconds: float) -> float:
    import time

    time.sleep(seconds)
    return seconds
