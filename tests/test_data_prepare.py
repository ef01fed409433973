"""Real tokenizers and streamed token datasets: ``data prepare`` from JSONL and Parquet (local
and fsspec URIs) with a tokenizer trained here, the dataset's record of it, clear refusals,
and a reader whose memory does not grow with the data."""

from __future__ import annotations

import gzip
import hashlib
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from trainmesh.cli.loading import load_spec
from trainmesh.cli.main import main
from trainmesh.controller.preflight import preflight_problems
from trainmesh.data import corpus, sampler, shards
from trainmesh.data.dataset import TokenDataset, open_datasets

EOS = "<|endoftext|>"


def train_tokenizer(path, vocab_size: int = 600):
    """A byte-level BPE trained on the bundled corpus with the ``tokenizers`` trainer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus.documents(), trainer)
    tok.save(str(path))
    return tok


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory):
    """The corpus as gzipped JSONL (field ``body``) and as Parquet (column ``content``), a
    trained tokenizer, and both prepared with it (the JSONL through file:// URIs)."""
    d = tmp_path_factory.mktemp("tok")
    tok = train_tokenizer(d / "tokenizer.json")
    docs = corpus.documents()
    with gzip.open(d / "docs.jsonl.gz", "wt") as f:
        for i, doc in enumerate(docs):
            f.write(json.dumps({"id": i, "body": doc}) + "\n")
    pq.write_table(pa.table({"content": docs[:200]}), d / "a.parquet")
    pq.write_table(pa.table({"content": docs[200:]}), d / "b.parquet")
    assert main(["data", "prepare", f"file://{d}/docs.jsonl.gz", "--field", "body", "--tokenizer",
                 str(d), "--out", f"file://{d}/from-jsonl", "--shard-tokens", "4096"]) == 0
    assert main(["data", "prepare", str(d / "a.parquet"), str(d / "b.parquet"), "--column",
                 "content", "--tokenizer", str(d / "tokenizer.json"), "--out", str(d / "from-parquet")]) == 0
    return d, tok, docs


def test_jsonl_and_parquet_hold_the_tokenizers_ids_and_record_it(tokenized):
    d, tok, docs = tokenized
    eos = tok.token_to_id(EOS)
    want = [t for doc in docs for t in [*tok.encode(doc).ids, eos]]
    for name in ("from-jsonl", "from-parquet"):
        meta = shards.read_meta(d / name)
        assert shards.read_tokens(d / name).tolist() == want, name
        assert meta["vocab_size"] == tok.get_vocab_size() and meta["eos_id"] == eos
        assert meta["dtype"] == "uint16" and meta["documents"] == len(docs)
        blob = (d / name / "tokenizer.json").read_bytes()
        assert meta["tokenizer"]["sha256"] == hashlib.sha256((d / "tokenizer.json").read_bytes()).hexdigest()
        assert hashlib.sha256(blob).hexdigest() == meta["tokenizer"]["sha256"]
    assert len(shards.read_meta(d / "from-jsonl")["shards"]) > 1


def test_every_dp_degree_reads_the_same_samples_of_a_tokenized_dataset(tokenized):
    """What makes a resume at another DP degree exact: at any step, the ranks' shares of the
    global batch, in rank order, are the dp=1 batch, read from the shard files."""
    d, _, _ = tokenized
    ds = TokenDataset(shards.TokenStream(f"file://{d}/from-jsonl"), 32)
    for step in (0, 3, 1000):  # 1000: past an epoch of this small dataset
        want = torch.cat([x for x, _ in ds.microbatches(7, step, 16, 0, 1, 2)])
        for dp in (2, 4):
            got = torch.cat([x for r in range(dp) for x, _ in ds.microbatches(7, step, 16, r, dp, 2)])
            assert torch.equal(got, want), (step, dp)


def test_bad_inputs_are_refused_naming_the_flag(tokenized, tmp_path, capsys):
    d, _, _ = tokenized
    assert main(["data", "prepare", str(d / "docs.jsonl.gz"), "--field", "text",
                 "--out", str(tmp_path / "x")]) == 2
    assert "no field 'text'; pass --field NAME" in capsys.readouterr().err
    assert main(["data", "prepare", str(d / "a.parquet"), "--out", str(tmp_path / "x")]) == 2
    assert "no column 'text' (columns: content); pass --column NAME" in capsys.readouterr().err
    assert main(["data", "prepare", str(d / "a.parquet"), "--column", "content", "--tokenizer",
                 str(d), "--eos", "<nope>", "--out", str(tmp_path / "x")]) == 2
    assert "has no token '<nope>'; pass --eos TOKEN" in capsys.readouterr().err
    assert main(["data", "prepare", str(d / "a.parquet"), "--tokenizer", str(tmp_path),
                 "--out", str(tmp_path / "x")]) == 2
    assert "no tokenizer.json there" in capsys.readouterr().err
    assert main(["data", "prepare", str(d / "a.parquet"), "--shard-tokens", "0",
                 "--out", str(tmp_path / "x")]) == 2
    assert "--shard-tokens 0: give a positive number" in capsys.readouterr().err


def test_special_tokens_the_tokenizer_adds_are_kept_once(tokenized, tmp_path):
    """A Llama-3-style post-processor (BOS first, EOS last): BOS is kept and recorded, EOS is
    not doubled."""
    from tokenizers import Tokenizer, processors

    d, _, docs = tokenized
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.add_special_tokens(["<|begin_of_text|>"])
    bos, eos = tok.token_to_id("<|begin_of_text|>"), tok.token_to_id(EOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"<|begin_of_text|> $A {EOS}", special_tokens=[("<|begin_of_text|>", bos), (EOS, eos)])
    tok.save(str(tmp_path / "tokenizer.json"))
    assert main(["data", "prepare", str(d / "a.parquet"), "--column", "content", "--tokenizer",
                 str(tmp_path), "--out", str(tmp_path / "ds")]) == 0
    meta = shards.read_meta(tmp_path / "ds")
    assert meta["tokenizer"]["bos_id"] == bos and meta["eos_id"] == eos
    plain = Tokenizer.from_file(str(d / "tokenizer.json"))
    want = [t for doc in docs[:200] for t in [bos, *plain.encode(doc).ids, eos]]
    assert shards.read_tokens(tmp_path / "ds").tolist() == want


def test_a_model_vocabulary_smaller_than_the_datasets_is_refused(tokenized):
    d, tok, _ = tokenized
    vocab = tok.get_vocab_size()
    assert vocab > 264  # the tiny preset's vocabulary: the refusal below is real
    spec = load_spec(None, [f"data.path={d}/from-parquet"])
    [problem] = preflight_problems(spec)
    assert problem.path == "model.vocab_size" and f"smaller than the {vocab} tokens" in str(problem)
    assert f"use at least {vocab}" in str(problem)
    ok = load_spec(None, [f"data.path={d}/from-parquet", f"model.vocab_size={vocab}"])
    assert preflight_problems(ok) == []
    [problem] = preflight_problems(load_spec(None, [f"data.path={d}/nothing"]))
    assert problem.path == "data.path" and "trainmesh data prepare" in str(problem)
    shards.write_shards(["held out, in bytes"] * 20, d / "bytes")  # another tokenizer's data
    [problem] = preflight_problems(load_spec(None, [f"data.path={d}/from-parquet",
                                                      f"data.eval_path={d}/bytes", f"model.vocab_size={vocab}"]))
    assert problem.path == "data.eval_path" and "same --tokenizer" in str(problem)


def test_held_out_windows_are_fixed_and_never_trained_on(tokenized):
    d, _, _ = tokenized
    train, held = open_datasets(str(d / "from-parquet"), 32, eval_fraction=0.1)
    assert train.num_samples + held.num_samples == (len(train.tokens) - 1) // 32
    assert held.first == train.num_samples  # held-out samples come after every training one
    drawn = {int(i) for s in range(200) for i in sampler.sample_ids(0, s, 8, train.num_samples)}
    assert max(drawn) == train.num_samples - 1  # training draws all of its own, none beyond
    # The same held-out windows for any DP degree: the union over ranks is the dp=1 batch.
    one = held.eval_microbatches(1, 8, 0, 1, 2)
    four = [mb for r in range(4) for mb in held.eval_microbatches(1, 8, r, 4, 2)]
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(one, four, strict=True))


def test_a_dataset_at_a_uri_is_read_with_ranged_reads(tokenized):
    """``data.path`` as an fsspec URI: an in-memory filesystem stands in for an object store."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    class Counting(MemoryFileSystem):  # counts the bytes each read brings over
        protocol, store, fetched = "countmem", {}, []

        def cat_file(self, path, start=None, end=None, **kw):
            data = super().cat_file(path, start, end, **kw)
            Counting.fetched.append(len(data))
            return data

    fsspec.register_implementation("countmem", Counting, clobber=True)
    d, _, _ = tokenized
    for f in (d / "from-parquet").iterdir():
        Counting().pipe_file(f"countmem://ds/{f.name}", f.read_bytes())
    stream = shards.TokenStream("countmem://ds")
    assert not stream.local
    Counting.fetched.clear()
    want = TokenDataset(shards.read_tokens(d / "from-parquet"), 32).batch(np.array([5, 0, 77]))
    got = TokenDataset(stream, 32).batch(np.array([5, 0, 77]))
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    assert Counting.fetched == [33 * 2] * 3  # one ranged read per sample, of its bytes only


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_reading_a_corpus_far_larger_than_the_budget_keeps_rss_flat(tmp_path):
    # The bound is a quarter of what the loop reads (the whole corpus: 128 MiB of tokens, 512 MiB
    # as int64 batches): a reader that kept what it read crosses it. The allocator alone moved RSS by
    # up to 17.5 MiB between runs here (freed batch buffers not returned to the system).
    budget = 32 << 20
    writer = shards.ShardWriter(str(tmp_path), 50_000, 0, {"kind": "test"}, shard_tokens=16 << 20)
    rng = np.random.default_rng(0)
    for _ in range(8):  # 8 × 8M uint16 tokens: 128 MiB on disk, 4 × the budget
        writer.add(rng.integers(1, 50_000, 8 << 20, dtype=np.int64))
    meta = writer.close()
    assert meta["tokens"] * 2 >= 4 * budget
    ds = TokenDataset(shards.TokenStream(tmp_path), seq_len=4096)
    x, _ = ds.batch(np.arange(64))  # the reader's and allocator's fixed costs, once
    before, checksum = _rss_bytes(), int(x[:, 0].sum())
    for start in range(64, ds.num_samples, 64):  # every other sample of the corpus, in batches
        x, _ = ds.batch(np.arange(start, min(start + 64, ds.num_samples)))
        checksum += int(x[:, 0].sum())
    grown = _rss_bytes() - before
    assert checksum > 0 and grown < budget, f"RSS grew by {grown / 2**20:.1f} MiB"
