"""Context parallel (ring and all-gather attention over 2·cp load-balanced chunks) alone and
with ZeRO-3 over dp × cp, TP + SP, PP (1F1B), expert parallel and document masks, on real ranks
over gloo (point-to-point under NCCL's rules: the rank pool's ProbedRank), against the
single-process model at seq_len 256 with grouped-query attention (tiny: 4 heads, 2 KV heads)
and Multi-head Latent Attention (tiny-dsv3)."""

from __future__ import annotations

import pytest
import torch
from reference import reference_grad_norms, reference_run
from test_tensor_parallel import BASE, _close, _parallel_run, _same_norm, resumed_elsewhere
from tiers import cases

from trainmesh.cli.loading import load_spec
from trainmesh.data.dataset import open_datasets
from trainmesh.data.shards import ensure_tiny_corpus
from trainmesh.engine.engine import build_model
from trainmesh.models.llama.parallelize import apply_context_parallel
from trainmesh.parallel.context import ContextParallel, local_positions, shard_sequence
from trainmesh.parallel.dims import ParallelDims

LONG = ["training.seq_len=256", "optimizer.grad_clip=0"]  # unclipped: a mis-scaled sum shows
MOE = ["model.preset=tiny-moe", "training.seq_len=256", "optimizer.grad_clip=0"]
DOCS = "data.document_mask=true"
CASES = {  # largest meshes first: the rank pool then only shrinks
    "cp4-ring": (ParallelDims(cp=4), ["parallelism.cp_mode=ring"]),
    "cp4-allgather": (ParallelDims(cp=4), ["parallelism.cp_mode=allgather"]),
    # ZeRO-3 shards and reduces over dp × cp
    "cp2-dp2-ring": (ParallelDims(cp=2, dp=2), ["parallelism.keep_gathered=false"]),
    "cp2-dp2-allgather": (ParallelDims(cp=2, dp=2), ["parallelism.cp_mode=allgather"]),
    # interrupted and resumed on a mesh without context parallel (_resumed_at_cp1): the
    # recovery after losing half of the ranks of a cp2 × dp2 job
    "cp2-dp2-resumed-at-cp1-dp2": (ParallelDims(cp=2, dp=2), []),
    # hybrid sharding: ZeRO-3 inside each replica's cp ring, all-reduced across the replicas
    "cp2-hsdp-2x1": (ParallelDims(cp=2, dp=2), ["parallelism.dp_replicate=2"]),
    "cp2-tp2-sp-allgather": (ParallelDims(cp=2, tp=2), ["parallelism.sequence_parallel=true",
                                                         "parallelism.cp_mode=allgather"]),
    "cp2-tp2-sp-ring": (ParallelDims(cp=2, tp=2), ["parallelism.sequence_parallel=true"]),
    "cp2-pp2-1f1b-ring": (ParallelDims(cp=2, pp=2), ["schedule.name=1f1b"]),
    "cp2-pp2-1f1b-allgather": (ParallelDims(cp=2, pp=2), ["schedule.name=1f1b",
                                                           "parallelism.cp_mode=allgather"]),
    # experts split over an EP group of 2 replicas' whole rings (ep = 2 × cp)
    "moe-cp2-dp2-ep4": (ParallelDims(cp=2, dp=2, ep=4), ["parallelism.ep=4"]),
    "cp2-ring-documents-full-ac": (ParallelDims(cp=2), [DOCS, "activation_checkpoint.mode=full"]),
    "cp2-allgather-documents": (ParallelDims(cp=2), [DOCS, "parallelism.cp_mode=allgather"]),
    "documents-alone": (ParallelDims(), [DOCS]),
    # Multi-head Latent Attention (tiny-dsv3): query/key heads of 24 beside values of 16 (the
    # ring moves them padded to one width), YaRN's softmax scale; its MoE blocks' experts over
    # an EP group of one ring
    "dsv3-cp2-dp2-ring-yarn": (ParallelDims(cp=2, dp=2), [
        "model.preset=tiny-dsv3", "parallelism.ep=2", "model.rope_scaling.type=yarn",
        "model.rope_scaling.factor=4", "model.rope_scaling.original_max_position_embeddings=64",
        "model.rope_scaling.mscale_all_dim=1"]),
    "dsv3-cp2-allgather-documents": (ParallelDims(cp=2), [
        "model.preset=tiny-dsv3", "parallelism.cp_mode=allgather", DOCS]),
    # the ring moves MLA's latent (parallelism.cp_latent, the default) and each tp rank
    # expands it for its heads: the latent's gradient summed over tp; and the expanded keys
    # and values moved instead
    "dsv3-cp2-tp2-sp-ring": (ParallelDims(cp=2, tp=2), [
        "model.preset=tiny-dsv3", "parallelism.sequence_parallel=true"]),
    # ... its weight re-gathered for backward (keep_gathered off) and the ring run again
    # in the recomputation
    "dsv3-cp2-dp2-ring-reshard-full-ac": (ParallelDims(cp=2, dp=2), [
        "model.preset=tiny-dsv3", "parallelism.keep_gathered=false",
        "activation_checkpoint.mode=full"]),
    "dsv3-cp2-dp2-ring-expanded": (ParallelDims(cp=2, dp=2), [
        "model.preset=tiny-dsv3", "parallelism.ep=2", "parallelism.cp_latent=false"]),
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", cases(CASES, {
    "cp2-dp2-ring": "the context-parallel axis: ring attention, beside dp"}))
def test_context_parallel_matches_single_process(rank_pool, tmp_path, case):
    if case == "cp2-dp2-resumed-at-cp1-dp2":
        return _resumed_at_cp1(rank_pool, tmp_path)
    dims, extra = CASES[case]
    base = MOE if case.startswith("moe") else LONG
    spec = load_spec(None, [*BASE, *base, f"parallelism.pp={dims.pp}", f"parallelism.tp={dims.tp}",
                            f"parallelism.dp={dims.dp}", f"parallelism.cp={dims.cp}",
                            f"runtime.output_dir={tmp_path}", *extra])
    data_dir = str(ensure_tiny_corpus(tmp_path / "data"))
    # two steps: the gradients of the first, the parameters after the second's update
    losses, grads, params, norms = _parallel_run(rank_pool, spec, dims, data_dir, steps=2)
    ref_losses, ref_params, ref_grads = reference_run(spec, data_dir, steps=2, grads_after=1)
    _same_norm(norms, reference_grad_norms(spec, data_dir, steps=2, grads_after=1))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    _close(grads, ref_grads)
    _close(params, ref_params, rtol=1e-5, atol=5e-5)  # after AdamW: see test_tensor_parallel


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode,tp", [("ring", 1), ("allgather", 1), ("ring", 2)])
def test_mla_ring_moves_the_latent(rank_pool, tmp_path, mode, tp):
    """Multi-head Latent Attention over cp 2: moving each token's latent and rotary key
    (tiny-dsv3: 32 + 8 values) and expanding them where they are attended gives the gradients
    of moving the expanded keys and values (4 heads × 2 × 24 padded), and the ring carries
    40/192 of their bytes, forward and backward (float32: every message scales alike); under
    tp 2 each rank moves the whole latent against its 2 heads' keys and values: 40/96."""
    from trainmesh.testing import probes

    sent, grads = {}, {}
    dims = ParallelDims(cp=2, tp=tp)
    for latent in (True, False):
        spec = load_spec(None, [*BASE, *LONG, "model.preset=tiny-dsv3", "parallelism.cp=2",
                                f"parallelism.tp={tp}", f"parallelism.cp_mode={mode}",
                                f"parallelism.cp_latent={latent}", f"runtime.output_dir={tmp_path}"])
        data_dir = str(ensure_tiny_corpus(tmp_path / "data"))
        group = rank_pool.group_for(spec, dims)
        try:
            group.build(spec.model_dump_json(), dims, data_dir)
            stats = group.train_step()
            sent[latent] = [r["breakdown"]["cp_sent_mib"] for r in stats]
            grads[latent] = probes.full_grads(group)
        finally:
            rank_pool.release(group)
    _close(grads[True], grads[False], rtol=1e-5, atol=1e-6)
    assert sent[False][0] > 0
    for moved, expanded in zip(sent[True], sent[False], strict=True):
        assert moved / expanded == pytest.approx(40 / (192 / tp), rel=1e-9)


def _resumed_at_cp1(rank_pool, tmp_path) -> None:
    """cp 2 × dp 2 saves at step 2; dp 2 alone restores it (parameters are replicated across
    cp: the checkpoint does not depend on it) and reads on from the same data position with
    whole sequences: every loss is the single process's."""
    spec = load_spec(None, [*BASE, *LONG, "parallelism.dp=2", "parallelism.cp=2",
                            f"runtime.output_dir={tmp_path}", "training.steps=4"])
    after = spec.model_copy(update={"parallelism": spec.parallelism.model_copy(update={"cp": 1})})
    resumed_elsewhere(rank_pool, tmp_path, (spec, ParallelDims(dp=2, cp=2)),
                      (after, ParallelDims(dp=2)))


def test_document_masks_equal_each_document_alone(tmp_path):
    """A packed sequence under document masks gives every token the logits that its document
    gives alone (RoPE is relative: a document's offset in the pack does not matter), also with
    the sequence split into a rank's load-balanced chunks and their global positions."""
    spec = load_spec(None, [*BASE, *LONG, DOCS, f"runtime.output_dir={tmp_path}"])
    data_dir = str(ensure_tiny_corpus(tmp_path / "data"))
    data = open_datasets(data_dir, 256)[0]
    eos = data.tokens.meta["eos_id"]
    x, _ = data.batch([3, 4])
    assert all((row == eos).sum() >= 1 for row in x)  # several documents in each window
    model = build_model(spec, torch.device("cpu"))
    alone = torch.empty(*x.shape, spec.model.vocab_size)
    with torch.no_grad():
        for b, row in enumerate(x):
            ends = [int(i) + 1 for i in torch.nonzero(row == eos)] + [len(row)]
            start = 0
            for end in ends:
                if end > start:
                    alone[b, start:end] = model(row[None, start:end])[0]
                start = end
        apply_context_parallel(model, ContextParallel(eos=eos), None)
        packed = model(x)
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(packed, build_model(spec, torch.device("cpu"))(x), atol=1e-3)


def test_load_balanced_chunks_and_positions():
    """Rank i of cp holds chunks i and 2·cp−1−i; together the ranks hold the sequence once."""
    seq = torch.arange(16)[None]
    parts = [shard_sequence(seq, r, 4) for r in range(4)]
    assert parts[0].tolist() == [[0, 1, 14, 15]] and parts[3].tolist() == [[6, 7, 8, 9]]
    assert sorted(torch.cat(parts, 1)[0].tolist()) == list(range(16))
    for r in range(4):
        assert torch.equal(local_positions(16, r, 4), parts[r][0])


@pytest.mark.parametrize("causal", [True, False])
def test_fused_attention_block_equals_the_math_and_merges(causal):
    """The CPU kernel (flash attention with its log-sum-exp) against the explicit math, with
    grouped-query heads and a document mask that leaves some queries nothing to see in one
    block (their log-sum-exp −inf there, not the kernel's 0); and its backward given the
    log-sum-exp merged over the two key blocks gives each block's share of the gradients."""
    import math

    from trainmesh.kernels import attention, reference
    from trainmesh.parallel.context import _merge

    g = torch.Generator().manual_seed(0)
    B, Hkv, rep, T, D = 2, 2, 2, 16, 8
    q = torch.randn(B, Hkv, rep, T, D, generator=g)
    k, v = (torch.randn(B, Hkv, 1, 2 * T, D, generator=g) for _ in range(2))
    docs_q = torch.arange(T).repeat(B, 1) // 5
    # document 0's queries (0-4) see nothing in the first key block, all of the second
    docs_k = torch.cat([torch.arange(T) // 5 + 1, torch.zeros(T, dtype=torch.long)]).repeat(B, 1)
    mask = docs_q[:, None, None, :, None] == docs_k[:, None, None, None, :]
    scale = 1 / math.sqrt(D)
    halves = [(k[..., s, :], v[..., s, :], mask[..., s]) for s in (slice(0, T), slice(T, 2 * T))]
    acc = None
    for i, (kb, vb, mb) in enumerate(halves):
        c = causal and i == 0
        o, lse = attention.attention_block(q, kb, vb, c, mb, scale)
        ro, rlse = reference.attention_block(q, kb, vb, attention._bool_mask(q, kb, c, mb), scale)
        torch.testing.assert_close(o, ro, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse, rlse)
        if i == 0:
            assert torch.isinf(lse[..., :5]).all() and torch.isfinite(lse[..., 5:]).all()
        acc = _merge(acc, o, lse)
    out, lse = acc
    assert torch.isfinite(lse).all()
    dout = torch.randn_like(out)
    for i, (kb, vb, mb) in enumerate(halves):
        c = causal and i == 0
        got = attention.attention_block_backward(dout, q, kb, vb, out, lse, c, mb, scale)
        want = reference.attention_block_backward(dout, q, kb, vb, out, lse,
                                                  attention._bool_mask(q, kb, c, mb), scale)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
