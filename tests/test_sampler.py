"""The sampler is a pure function of (seed, step, global index), the same for every DP degree."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainmesh.data import sampler, shards, tokenizer
from trainmesh.data.dataset import TokenDataset


def test_one_epoch_is_disjoint_and_complete():
    n, batch = 96, 8
    seen = np.concatenate([sampler.sample_ids(3, s, batch, n) for s in range(n // batch)])
    assert sorted(seen.tolist()) == list(range(n))


def test_epochs_reshuffle_and_wrap_mid_batch():
    n, batch = 10, 4  # step 2 straddles epochs 0 and 1
    step2 = sampler.sample_ids(0, 2, batch, n)
    epoch0 = np.concatenate([sampler.sample_ids(0, s, batch, n) for s in range(2)])
    assert set(step2[:2]) == set(range(n)) - set(epoch0)
    ep1 = np.concatenate([sampler.sample_ids(0, s, batch, n) for s in range(2, 5)])[2:12]
    assert sorted(ep1.tolist()) == list(range(n))
    assert ep1.tolist() != np.concatenate([epoch0, step2[:2]]).tolist()


@pytest.mark.parametrize("dp, mbs", [(1, 1), (2, 1), (4, 1), (3, 1), (5, 2), (7, 2)])
def test_dp_ranks_read_exactly_the_global_batch(dp, mbs):
    """Any dp up to the microbatches: shares in whole microbatches, differing by at most one,
    together the global batch in order."""
    n, batch = 1000, 16
    for step in (0, 7, 123):
        whole = sampler.sample_ids(5, step, batch, n)
        parts, counts = [], []
        for r in range(dp):
            start, count = sampler.rank_slice(r, dp, batch, mbs)
            parts.append(sampler.sample_ids(5, step, batch, n, start, count))
            counts.append(count // mbs)
            assert count % mbs == 0
        assert np.concatenate(parts).tolist() == whole.tolist()
        assert max(counts) - min(counts) <= 1 and min(counts) >= 1


def test_pure_function_of_seed_and_step():
    a = sampler.sample_ids(1, 42, 8, 500)
    b = sampler.sample_ids(1, 42, 8, 500)
    c = sampler.sample_ids(2, 42, 8, 500)
    assert a.tolist() == b.tolist() and a.tolist() != c.tolist()


def test_bad_slices_are_refused():
    with pytest.raises(ValueError, match="outside a batch"):
        sampler.sample_ids(0, 0, 8, 100, start=6, count=4)
    with pytest.raises(ValueError, match="holds 4 microbatches"):
        sampler.rank_slice(0, 5, 8, 2)
    with pytest.raises(ValueError, match="microbatch_size=3"):
        sampler.rank_slice(0, 2, 8, 3)


def test_shards_round_trip_and_samples_shift_by_one(tmp_path, monkeypatch):
    monkeypatch.setattr(shards, "OPEN_FILES", 2)  # reading 5 shards keeps at most 2 open
    docs = ["hello world", "trainmesh ü", "x" * 50]
    meta = shards.write_shards(docs, tmp_path, shard_tokens=16)
    assert len(meta["shards"]) > 1 and meta["dtype"] == "uint16" and meta["documents"] == 3
    tokens = shards.read_tokens(tmp_path)
    expect = [t for d in docs for t in tokenizer.encode(d)]
    assert tokens.tolist() == expect
    # Samples read from the shard files (spanning shard boundaries) are the array's samples.
    streamed, in_memory = TokenDataset(shards.TokenStream(tmp_path), 8), TokenDataset(tokens, 8)
    for ids in (np.array([0, 2]), np.array([1, 7, 3])):
        for a, b in zip(streamed.batch(ids), in_memory.batch(ids), strict=True):
            assert torch.equal(a, b)
    assert len(streamed.tokens._handles) == 2
    x, y = streamed.batch(np.array([0, 2]))
    assert x.shape == (2, 8) and torch.equal(x[:, 1:], y[:, :-1])
    assert x[1, 0].item() == expect[16]


def test_token_type_is_the_smallest_that_holds_the_vocabulary():
    assert [shards.token_dtype(v).name for v in (256, 257, 65536, 65537)] == \
        ["uint8", "uint16", "uint16", "uint32"]


def test_a_directory_without_dataset_json_is_not_a_dataset(tmp_path):
    (tmp_path / "shard-00000.parquet").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="Parquet shards of an earlier trainmesh.*data prepare"):
        shards.TokenStream(tmp_path)


def test_cli_prepare(tmp_path):
    from trainmesh.cli.main import main

    (tmp_path / "a.txt").write_text("first document")
    (tmp_path / "b.txt").write_text("second one")
    assert main(["data", "prepare", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"),
                 "--out", str(tmp_path / "out")]) == 0
    toks = shards.read_tokens(tmp_path / "out").tolist()
    assert tokenizer.decode(toks) == "first documentsecond one"
    assert toks.count(tokenizer.EOS) == 2


def test_the_prefetcher_reads_the_next_step_ahead_and_returns_exactly_what_a_read_gives(tmp_path):
    """The next step's windows are read in the background while a step trains (an object
    store's ranged reads off the step's path), one step ahead; a step asked for out of turn (a
    resume, a re-form) is read at once: every step's data is what reading it directly gives."""
    import threading

    from trainmesh.data.dataset import Prefetcher, TokenDataset
    from trainmesh.data.shards import TokenStream, ensure_tiny_corpus

    data = TokenDataset(TokenStream(ensure_tiny_corpus(tmp_path / "data")), seq_len=16)
    reads: list[tuple[int, str]] = []

    def fetch(step: int):
        reads.append((step, threading.current_thread().name))
        return data.microbatches(7, step, 8, 1, 2, 2)

    prefetch = Prefetcher(fetch)
    try:
        for step in [0, 1, 2, 9, 10, 3]:
            got, want = prefetch.get(step), data.microbatches(7, step, 8, 1, 2, 2)
            assert len(got) == len(want) == 2
            for (x, y), (wx, wy) in zip(got, want, strict=True):
                assert torch.equal(x, wx) and torch.equal(y, wy)
    finally:
        prefetch.close()
    ahead = {s for s, thread in reads if thread.startswith("trainmesh-data")}
    assert {1, 2, 10} <= ahead  # read ahead, in the background
    assert {s for s, thread in reads if not thread.startswith("trainmesh-data")} == {0, 9, 3}
