"""The Llama model: shapes, exact parameter counts, FLOPs per token, stage-split naming."""

from __future__ import annotations

import pytest
import torch

from trainmesh.cli.loading import load_spec
from trainmesh.models.llama.model import Llama, LlamaArgs
from trainmesh.models.llama.model_math import flops_per_token, num_params
from trainmesh.models.moe.moe import moe_layers


def _args(preset: str) -> LlamaArgs:
    return LlamaArgs.from_config(load_spec(None, [f"model.preset={preset}"]).model)


def test_forward_shapes_and_causality():
    args = _args("tiny")
    model = Llama(args)
    model.init_weights(0)
    x = torch.randint(0, args.vocab_size, (3, 17))
    logits = model(x)
    assert logits.shape == (3, 17, args.vocab_size)
    x2 = x.clone()
    x2[:, 10:] = (x2[:, 10:] + 1) % args.vocab_size  # changing the future...
    torch.testing.assert_close(model(x2)[:, :10], logits[:, :10])  # ...leaves the past


def test_tiny_param_count_by_hand():
    # dim 64, 4 layers, 4 heads (head dim 16), 2 kv heads (kv dim 32), ffn 176, vocab 264.
    per_layer = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 176 + 2 * 64
    hand = 264 * 64 + 4 * per_layer + 64 + 64 * 264
    args = _args("tiny")
    assert args.num_params() == hand
    assert sum(p.numel() for p in Llama(args).parameters()) == hand


@pytest.mark.parametrize(("preset", "published"), [("8b", 8_030_261_248),
                                                   ("70b", 70_553_706_496)])
def test_large_presets_match_published_llama3_counts(preset, published):
    assert num_params(_args(preset)) == published


def test_flops_per_token_by_hand():
    args = _args("tiny")
    matmul = args.num_params() - 264 * 64  # everything but the embedding lookup
    assert flops_per_token(args, 64) == 6 * matmul + 6 * 4 * 64 * 64
    tied = load_spec(None, ["model.preset=1b"]).model
    # a tied head is counted once as a parameter but still costs its matmul
    assert flops_per_token(tied, 1) == 6 * num_params(tied) + 6 * 16 * 2048


def test_stage_split_keeps_global_names_and_values():
    args = _args("tiny")
    whole = Llama(args)
    whole.init_weights(7)
    first = Llama(args, layer_ids=range(0, 2), has_head=False)
    last = Llama(args, layer_ids=range(2, 4), has_embedding=False)
    first.init_weights(7)
    last.init_weights(7)
    ref = whole.state_dict()
    parts = {**first.state_dict(), **last.state_dict()}
    assert set(parts) == set(ref)
    for k, v in parts.items():
        assert torch.equal(v, ref[k]), k
    assert "layers.3.attention.wq.weight" in last.state_dict()
    x = torch.randint(0, args.vocab_size, (2, 8))
    torch.testing.assert_close(last(first(x)), whole(x))


def test_any_block_of_a_tensor_fills_exactly_as_the_whole_tensor():
    """Mesh-independent init: shards (row and column blocks, chunk boundaries crossed) fill
    with the same values as the whole tensor — the property every mesh's build relies on."""
    from trainmesh.models.llama.init import CHUNK_ELEMENTS, fill_slice_

    cols = CHUNK_ELEMENTS // 3 + 5  # 2 rows per chunk: blocks straddle chunks
    shape = (11, cols)
    whole = torch.empty(shape)
    fill_slice_(whole, (0, 0), shape, seed=7, std=0.02)
    assert abs(float(whole.std()) - 0.02) < 1e-3
    for (r0, r1), (c0, c1) in [((0, 3), (0, cols)), ((3, 11), (5, 900)), ((5, 6), (cols - 7, cols)),
                               ((1, 10), (0, cols // 2))]:
        block = torch.empty(r1 - r0, c1 - c0)
        fill_slice_(block, (r0, c0), shape, seed=7, std=0.02)
        assert torch.equal(block, whole[r0:r1, c0:c1])
    other = torch.empty(shape)
    fill_slice_(other, (0, 0), shape, seed=8, std=0.02)
    assert not torch.equal(other, whole)


def test_meta_build_then_materialise_equals_the_eager_model():
    args = _args("tiny")
    eager = Llama(args)
    eager.init_weights(3)
    with torch.device("meta"):
        lazy = Llama(args)
    assert all(p.is_meta for p in lazy.parameters())
    lazy.to_empty(device="cpu")
    lazy.init_weights(3)
    lazy.init_buffers()
    for (k, a), (_, b) in zip(eager.state_dict().items(), lazy.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    x = torch.randint(0, args.vocab_size, (2, 9))
    assert torch.equal(eager(x), lazy(x))


@pytest.mark.parametrize("preset", ["1b", "8b"])
def test_presets_carry_llama3_rope_and_it_is_transformers_llama3(preset):
    """Llama 3.1/3.2's RoPE (base 500,000, "llama3" long-context scaling) as transformers
    computes it for the same config: the frequencies match to float32 precision; without the
    scaling they would not (the long wavelengths are stretched by the factor)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from trainmesh.models.llama.model import rope_frequencies

    m = load_spec(None, [f"model.preset={preset}"]).model
    s = m.rope_scaling
    assert m.rope_theta == 500000.0 and s is not None and s.factor == {"1b": 32.0, "8b": 8.0}[preset]
    cfg = LlamaConfig(hidden_size=m.dim, num_attention_heads=m.n_heads,
                      max_position_embeddings=131072,
                      rope_parameters={"rope_type": "llama3", "rope_theta": m.rope_theta,
                                       "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                                       "high_freq_factor": s.high_freq_factor,
                                       "original_max_position_embeddings": s.original_max_position_embeddings})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    head_dim = m.dim // m.n_heads
    got = rope_frequencies(head_dim, m.rope_theta, s.model_dump())
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-6, atol=0)
    plain = rope_frequencies(head_dim, m.rope_theta)
    assert not torch.allclose(plain.float(), want.float(), rtol=1e-3)
    with pytest.raises(Exception, match="high_freq_factor"):
        load_spec(None, [f"model.preset={preset}", "model.rope_scaling.high_freq_factor=0.5"])


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_training_stays_close_to_full_precision(tmp_path, recipe):
    """``training.float8`` (torchao, emulated on CPU): the blocks' linears become Float8Linear
    (the head and the embedding stay as they are), and 4 steps of the tiny model stay within 3%
    of the full-precision losses — without being them (the float8 rounding is there)."""
    from reference import reference_run
    from torchao.float8.float8_linear import Float8Linear

    from trainmesh.data.shards import ensure_tiny_corpus

    args = ["model.preset=tiny", "training.global_batch_size=4", "training.microbatch_size=2",
            "training.seq_len=32", "optimizer.warmup_steps=1", "runtime.device=cpu"]
    data_dir = str(ensure_tiny_corpus(tmp_path / "data"))
    seen = {}

    def kinds(model):
        seen.update({name: type(m) for name, m in model.named_modules()})

    base, _ = reference_run(load_spec(None, args), data_dir, steps=4)
    f8, _ = reference_run(load_spec(None, [*args, f"training.float8={recipe}"]), data_dir,
                          steps=4, prepare=kinds)
    assert seen["layers.0.attention.wq"] is Float8Linear
    assert seen["layers.3.feed_forward.w2"] is Float8Linear
    assert seen["output"] is torch.nn.Linear
    torch.testing.assert_close(torch.tensor(f8), torch.tensor(base), rtol=0.03, atol=0)
    assert f8 != base


def test_float8_moe_experts_run_torchaos_grouped_gemms_close_to_full_precision(tmp_path):
    """``training.float8`` on an MoE model: the stacked experts run torchao's float8 grouped
    GEMMs (MXFP8, emulated on CPU), and 4 steps of tiny-moe stay within 3% of the full
    precision losses without being them."""
    from reference import reference_run

    from trainmesh.data.shards import ensure_tiny_corpus

    args = ["model.preset=tiny-moe", "training.global_batch_size=4",
            "training.microbatch_size=2", "training.seq_len=32", "optimizer.warmup_steps=1",
            "runtime.device=cpu"]
    data_dir = str(ensure_tiny_corpus(tmp_path / "data"))
    kinds = set()

    def experts(model):
        kinds.update(m.experts.float8 for _, m in moe_layers(model))

    base, _ = reference_run(load_spec(None, args), data_dir, steps=4)
    f8, _ = reference_run(load_spec(None, [*args, "training.float8=rowwise"]), data_dir,
                          steps=4, prepare=experts)
    assert kinds == {"mxfp8-emulated"}
    torch.testing.assert_close(torch.tensor(f8), torch.tensor(base), rtol=0.03, atol=0)
    assert f8 != base


def test_float8_is_refused_where_it_cannot_run_or_runs_slower_than_bf16():
    """Each refusal names the setting to change: tensor parallel, a GPU older than compute
    capability 8.9, or a GPU run without model.compile (the kit measured float8 uncompiled at
    0.48× bf16). CPU runs torchao's emulation, compiled or not (the tests above)."""
    from trainmesh.spec.mesh_rules import float8_device_problems
    from trainmesh.spec.problems import SpecError

    assert float8_device_problems("none", "cuda", (8, 0), compiled=False) == []
    assert float8_device_problems("tensorwise", "cuda", (9, 0), compiled=True) == []
    assert float8_device_problems("rowwise", "cpu", None, compiled=False) == []
    for args, fix in [(("rowwise", "cuda", (8, 0), True), "compute capability 8.9"),
                      (("tensorwise", "cuda", (9, 0), False), "set model.compile=true")]:
        (problem,) = float8_device_problems(*args)
        assert fix in problem and "training.float8=none" in problem
    with pytest.raises(SpecError) as err:  # beside tp: the spec's own rule, at load
        load_spec(None, ["model.preset=tiny", "model.tie_embeddings=false", "parallelism.tp=2",
                         "parallelism.dp=1", "training.float8=tensorwise"])
    [problem] = err.value.problems
    assert problem.path == "training.float8" and "parallelism.tp=1" in problem.fix


def test_adamw_is_fused_with_no_decay_on_norms():
    """One fused in-place AdamW op per group (the foreach step's list ops cost DTensor a
    sharding decision each on every new mesh: engine/step.build_optimizer), and the groups
    decay the matrices only; the fused step gives the foreach step's values."""
    from trainmesh.engine.step import build_optimizer

    spec = load_spec(None, ["model.preset=tiny"])
    model = Llama(LlamaArgs.from_config(spec.model))
    model.init_weights(0)
    opt = build_optimizer(model, spec.optimizer)
    assert all(g["fused"] and not g["foreach"] for g in opt.param_groups)
    decay, flat = opt.param_groups
    assert {p.ndim for p in decay["params"]} == {2} and {p.ndim for p in flat["params"]} == {1}
    assert decay["weight_decay"] == spec.optimizer.weight_decay and flat["weight_decay"] == 0.0
    twin = Llama(LlamaArgs.from_config(spec.model))
    twin.load_state_dict(model.state_dict())
    ref = torch.optim.AdamW([{"params": g["params"], "weight_decay": g["weight_decay"]} for g in (
        {"params": [p for p in twin.parameters() if p.ndim >= 2], "weight_decay": decay["weight_decay"]},
        {"params": [p for p in twin.parameters() if p.ndim < 2], "weight_decay": 0.0})],
        lr=spec.optimizer.lr, betas=(spec.optimizer.beta1, spec.optimizer.beta2), eps=spec.optimizer.eps,
        foreach=True)
    x = torch.randint(0, spec.model.vocab_size, (2, 16))
    for m, o in ((model, opt), (twin, ref)):
        for _ in range(2):
            m(x).float().square().mean().backward()
            o.step()
            o.zero_grad()
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_a_state_saved_by_the_foreach_step_loads_into_the_fused_one():
    """torch restores a group's settings from the saved state: a checkpoint of the foreach step
    (trainmesh before the fused one) must not turn the job back to it."""
    from trainmesh.engine.step import build_optimizer

    spec = load_spec(None, ["model.preset=tiny"])
    model = Llama(LlamaArgs.from_config(spec.model))
    model.init_weights(0)
    x = torch.randint(0, spec.model.vocab_size, (2, 16))
    old = torch.optim.AdamW([p for p in model.parameters() if p.ndim >= 2], lr=1e-3, foreach=True)
    old.add_param_group({"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0})
    model(x).float().square().mean().backward()
    old.step()
    saved = old.state_dict()
    assert all(g["foreach"] and not g["fused"] for g in saved["param_groups"])
    opt = build_optimizer(model, spec.optimizer)
    opt.load_state_dict(saved)
    assert all(g["fused"] and not g["foreach"] for g in opt.param_groups)
    assert all(s["step"].item() == 1 for s in opt.state.values())
    opt.step()  # the fused step runs on the loaded moments
    assert all(s["step"].item() == 2 for s in opt.state.values())


def test_adamw_steps_each_dtensor_shard_as_dtensor_would():
    """The optimizer (engine/step.ShardwiseAdamW) steps a DTensor parameter's local shard
    where its gradient and moments have its layout: after two steps the parameters and moments
    equal torch's fused AdamW stepping the same DTensors, and the moments are DTensors laid out
    as their parameters (checkpoints reshard them). A gradient still partial takes DTensor's
    own step (which reduces it first). One process on torch's fake process group: a 2 × 2 mesh
    whose collectives do nothing (neither step needs one for these layouts)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from trainmesh.engine.step import ShardwiseAdamW

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        # (layout, this rank's shard of an (8, 6) tensor)
        layouts = [([Shard(0), Shard(0)], (2, 6)), ([Shard(0), Shard(1)], (4, 3)),
                   ([Shard(0), Replicate()], (4, 6)), ([Replicate(), Replicate()], (8, 6))]
        gen = torch.Generator().manual_seed(0)
        start = [torch.randn(shape, generator=gen) for _, shape in layouts]
        grads = [[torch.randn(shape, generator=gen) for _, shape in layouts] for _ in range(2)]

        def dtensor(local, placements):
            return DTensor.from_local(local.clone(), mesh, placements, run_check=False,
                                      shape=torch.Size((8, 6)), stride=(6, 1))

        def run(cls):
            params = [torch.nn.Parameter(dtensor(v, pl)) for v, (pl, _) in zip(start, layouts, strict=True)]
            opt = cls([{"params": params[:2], "weight_decay": 0.1},
                       {"params": params[2:], "weight_decay": 0.0}], lr=1e-2, fused=True)
            for step in grads:
                for p, g, (pl, _) in zip(params, step, layouts, strict=True):
                    p.grad = dtensor(g, pl)
                opt.step()
            return params, opt

        (got, opt), (want, ref) = run(ShardwiseAdamW), run(torch.optim.AdamW)
        for p, q in zip(got, want, strict=True):
            assert torch.equal(p.to_local(), q.to_local())
            for k in ("exp_avg", "exp_avg_sq"):
                m = opt.state[p][k]
                assert isinstance(m, DTensor) and m.placements == p.placements, k
                assert torch.equal(m.to_local(), ref.state[q][k].to_local()), k
            assert opt.state[p]["step"].item() == 2
        assert len(opt.state) == len(got)  # nothing left keyed by a shard
        assert opt._local_views() is not None
        got[3].grad = DTensor.from_local(torch.ones(8, 6), mesh, [Partial(), Replicate()], run_check=False)
        assert opt._local_views() is None  # DTensor's own step, which reduces the gradient first
        opt.step()
        assert len(opt.state) == len(got)
    finally:
        dist.destroy_process_group()


def test_stage_split_is_even_or_puts_the_extra_blocks_between_the_first_and_last_stage():
    """Pipeline stages of unequal size (``model_math.stage_split``): DeepSeek-V3's 61 blocks
    over 16 stages, Llama 3.1 405B's 126 over 16; a pinned split is kept while it has one count
    per stage; a rank holds its chunks' blocks."""
    from trainmesh.models.llama.model_math import rank_blocks, stage_blocks, stage_split

    assert stage_split(8, 4) == [2, 2, 2, 2]
    assert stage_split(61, 16) == [3, *[4] * 13, 3, 3] and sum(stage_split(61, 16)) == 61
    assert stage_split(126, 16) == [7, *[8] * 14, 7]
    assert stage_split(5, 2) == [3, 2] and stage_split(5, 4) == [1, 2, 1, 1]
    assert stage_split(7, 3) == [2, 3, 2] and stage_split(8, 3) == [3, 3, 2]
    assert stage_split(5, 2, pinned=[1, 4]) == [1, 4] and stage_split(5, 4, pinned=[1, 4]) == [1, 2, 1, 1]
    assert [list(stage_blocks(5, 4, s)) for s in range(4)] == [[0], [1, 2], [3], [4]]
    assert rank_blocks(5, 2, 2) == 3 and rank_blocks(61, 16) == 4
