"""DeepSeek-V3's architecture: Multi-head Latent Attention (low-rank or full queries, the
compressed key/value latent, the rotary key shared by the heads, a value head of its own size,
YaRN's frequencies and softmax scale), group-limited sigmoid routing with the correction bias
and ``routed_scaling_factor``, a shared expert and leading dense blocks. Against transformers'
``DeepseekV3ForCausalLM``: imported, the logits are its own; exported, transformers loads every
tensor with the same logits. On real ranks, the tiny preset trains as one process does
(``test_expert_parallel.py``)."""

from __future__ import annotations

import json

import pytest
import torch
from test_hf_interop import _assert_round_trip
from tiers import full

from trainmesh.cli.loading import SpecError, load_spec
from trainmesh.engine.engine import build_model
from trainmesh.models.moe.moe import limit_to_groups

transformers = pytest.importorskip("transformers")  # a dev dependency: installed by .ci/run

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
        "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 0.9, "mscale_all_dim": 0.8}


def _deepseek(path, seed: int = 0, **kw):
    """A small random ``DeepseekV3ForCausalLM`` saved to ``path``, with its norms, routing
    biases and scores away from their initial values (so that their layouts matter)."""
    torch.manual_seed(seed)
    cfg = transformers.DeepseekV3Config(**{
        "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
        "n_shared_experts": 1, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4,
        "topk_group": 2, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
        "q_lora_rank": 24, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "v_head_dim": 12, "vocab_size": 264, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "rope_parameters": YARN, "num_mtp_layers": 0, **kw})
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("gate.weight"):
                p.normal_(0.0, 0.3)  # scores spread apart: no near-ties between experts
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.1, 0.1)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("kw", [{}, {"q_lora_rank": None, "rope_parameters": {
    "rope_type": "default", "rope_theta": 10000.0}}], ids=["low-rank-q-yarn", "full-q-plain-rope"])
def test_deepseek_v3_imports_and_exports_with_transformers_logits(tmp_path, kw):
    theirs = _deepseek(tmp_path / "hf", **kw)
    spec = load_spec(None, [f"model.init_from={tmp_path / 'hf'}", f"runtime.output_dir={tmp_path}"])
    m = spec.model
    assert m.mla.v_head_dim == 12 and m.mla.q_lora_rank == kw.get("q_lora_rank", 24)
    assert (m.moe.router, m.moe.balance, m.moe.n_group, m.moe.topk_group, m.moe.dense_layers,
            m.moe.shared_experts, m.moe.routed_scaling_factor) == ("sigmoid", "bias", 4, 2, 1, 1, 2.5)
    ours = build_model(spec, torch.device("cpu"))
    bias = theirs.model.layers[1].mlp.gate.e_score_correction_bias
    assert torch.equal(ours.layers["1"].feed_forward.expert_bias, bias)  # the buffer came too
    out = _assert_round_trip(theirs, spec, tmp_path, "DeepseekV3ForCausalLM")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["num_mtp_layers"] == 0
    # The per-expert tensors as DeepSeek's checkpoints hold them, the bias in float32.
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in index
    from safetensors import safe_open

    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    with safe_open(out / index[name], "pt") as f:
        assert f.get_tensor(name).dtype == torch.float32


def test_group_limited_routing_is_transformers_router(tmp_path):
    """Over random tokens, the experts and weights trainmesh's router chooses are those of
    ``DeepseekV3TopkRouter`` (groups scored by their two best biased scores, a token's experts
    from its best groups, the chosen sigmoid scores normalised and scaled)."""
    theirs = _deepseek(tmp_path / "hf")
    spec = load_spec(None, [f"model.init_from={tmp_path / 'hf'}"])
    ours = build_model(spec, torch.device("cpu")).eval()
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, w_theirs, i_theirs = theirs.model.layers[2].mlp.gate(x)
        _, i_ours, w_ours = ours.layers["2"].feed_forward.route(x)
    order_t, order_o = i_theirs.sort(-1), i_ours.sort(-1)
    assert torch.equal(order_t.values, order_o.values)
    torch.testing.assert_close(w_ours.gather(1, order_o.indices), w_theirs.gather(1, order_t.indices),
                               rtol=1e-6, atol=1e-7)
    # every token's experts lie in 2 of the 4 groups, and the routing used more than 2 groups
    groups = i_ours // 2
    assert all(len(set(g.tolist())) <= 2 for g in groups) and len(set(groups.flatten().tolist())) == 4


def test_limit_to_groups_keeps_the_best_groups_ties_to_the_lower():
    choose = torch.tensor([[0.25, 0.75, 0.5, 0.25, 0.5, 0.5, 0.0, 0.125],
                           [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]])
    out = limit_to_groups(choose, n_group=4, topk_group=2)
    inf = float("-inf")
    # groups scored 1, 0.75, 1, 0.125: the first and the third kept
    assert out[0].tolist() == [0.25, 0.75, inf, inf, 0.5, 0.5, inf, inf]
    assert out[1].tolist() == [0.5, 0.5, 0.5, 0.5, inf, inf, inf, inf]  # all tied: 0 and 1


@pytest.mark.parametrize("setting, field, words", [
    (["model.moe.n_group=3"], "model.moe", "n_group=3 does not divide experts=8"),
    (["model.moe.topk_group=5"], "model.moe", "topk_group=5 exceeds n_group=4"),
    (["model.moe.top_k=5", "model.moe.topk_group=2"], "model.moe", "top_k=5 exceeds the experts"),
    (["model.mla.qk_rope_head_dim=7"], "model.mla", "qk_rope_head_dim=7 is odd"),
    (["model.qk_norm=true"], "model", "qk_norm=true beside mla"),
])
def test_a_deepseek_spec_that_cannot_run_is_refused_naming_the_field(setting, field, words):
    with pytest.raises(SpecError) as err:
        load_spec(None, ["model.preset=tiny-dsv3", "runtime.device=cpu", *setting])
    text = str(err.value)
    assert field in text and words in text, text


def test_deepseek_presets_count_their_published_parameters():
    """DeepSeek-V3: 671B, 37B active (its MTP module aside); Kimi K2: 1.03T, 32B active;
    DeepSeek-V2-Lite: 15.7B."""
    from trainmesh.models.llama.model_math import num_params

    def billions(preset: str, active: bool = False) -> float:
        return num_params(load_spec(None, [f"model.preset={preset}"]).model, active=active) / 1e9

    assert billions("deepseek-v3-671b") == pytest.approx(671.0, abs=0.1)
    assert billions("deepseek-v3-671b", active=True) == pytest.approx(37.5, abs=0.1)
    assert billions("kimi-k2") == pytest.approx(1026.4, abs=0.1)
    assert billions("kimi-k2", active=True) == pytest.approx(32.9, abs=0.1)
    assert billions("deepseek-v2-lite") == pytest.approx(15.7, abs=0.05)


@full("inductor compiles DeepSeek-V3's blocks (latent attention, a dense and an MoE block): "
      "tens of CPU-s; make test keeps the compiled Llama blocks' parity on ranks")
def test_compiled_deepseek_blocks_equal_the_eager_model(tmp_path):
    """``model.compile`` on tiny-dsv3: every block compiled in place (its latent attention, its
    MoE block's dispatch eager between graphs) gives the eager model's loss, gradients and
    parameters over two steps, the routing bias moving."""
    from reference import reference_run
    from test_tensor_parallel import _close

    from trainmesh.data.shards import ensure_tiny_corpus
    from trainmesh.models.llama.parallelize import apply_compile

    spec = load_spec(None, ["model.preset=tiny-dsv3", "training.global_batch_size=4",
                            "training.microbatch_size=2", "training.seq_len=32",
                            "optimizer.warmup_steps=1", "runtime.device=cpu",
                            "model.moe.bias_update_rate=0.01"])
    data_dir = str(ensure_tiny_corpus(tmp_path / "data"))
    want, want_params, want_grads = reference_run(spec, data_dir, steps=2, grads_after=1)
    got, got_params, got_grads = reference_run(spec, data_dir, steps=2, grads_after=1,
                                               prepare=apply_compile)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    _close(got_grads, want_grads)
    _close(got_params, want_params, rtol=1e-5, atol=5e-5)
    assert any(k.endswith("expert_bias") and v.abs().sum() > 0 for k, v in got_params.items())


@pytest.mark.timeout(300)
def test_deepseek_v3_imported_onto_ep2_dp2_reads_each_ranks_share_and_trains_as_one_process(
        rank_pool, tmp_path):
    """Each rank reads its own slices of a ``DeepseekV3ForCausalLM`` directory (of the experts,
    its own; the routing biases whole), and two steps from the import give the single
    process's losses."""
    from test_hf_interop import assert_imported_onto_ep2_dp2

    assert_imported_onto_ep2_dp2(rank_pool, tmp_path / "hf", _deepseek(tmp_path / "hf"), tmp_path)


def test_multi_token_prediction_exports_as_deepseeks_layers_with_transformers_mtp_logits(
        tmp_path, monkeypatch):
    """``model.mtp``: the module exported as DeepSeek's checkpoints hold it (layer n_layers of
    the safetensors, its own norms and projection, its block, the embedding and head copied
    under it; ``num_mtp_layers`` 1). transformers loads the model with every tensor but that
    layer's, and its ``MtpModel`` loads the layer and predicts the token two ahead with
    trainmesh's logits; imported back, trainmesh predicts the same."""
    from test_hf_interop import _committed_checkpoint, _relative_error

    from trainmesh.cli.main import main
    from trainmesh.engine.engine import build_model
    from trainmesh.models.llama.model import LlamaArgs

    spec = load_spec(None, ["model.preset=tiny-dsv3", "model.mtp.depth=1", "runtime.device=cpu",
                            "model.moe.bias_update_rate=0.01", f"runtime.output_dir={tmp_path}"])
    ours = build_model(spec, torch.device("cpu")).eval()
    with torch.no_grad():  # a routing bias of its own in the module's block, and scores
        ours.mtp["0"].block.feed_forward.expert_bias.uniform_(-0.1, 0.1)  # spread apart (no
        for name, p in ours.named_parameters():  # near-ties between experts)
            if name.endswith("router.weight"):
                p.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    assert ours.args == LlamaArgs.from_config(spec.model) and len(ours.mtp) == 1
    step_dir = _committed_checkpoint(ours, spec, tmp_path / "ckpt", 1)
    assert main(["export", step_dir, "--hf", str(tmp_path / "out")]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["num_mtp_layers"] == 1
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    layer = [k for k in index if k.startswith("model.layers.4.")]
    assert {"model.layers.4.eh_proj.weight", "model.layers.4.shared_head.norm.weight",
            "model.layers.4.embed_tokens.weight", "model.layers.4.shared_head.head.weight",
            "model.layers.4.self_attn.kv_b_proj.weight",
            "model.layers.4.mlp.experts.7.up_proj.weight"} <= set(layer)
    # transformers ignores DeepSeek-V3's multi-token layer by its number there (61): this
    # model's is 4
    monkeypatch.setattr(transformers.DeepseekV3ForCausalLM, "_keys_to_ignore_on_load_unexpected",
                        [r"model\.layers\.4\..*"])
    back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out",
                                                                   output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    from transformers.modeling_layers import MtpModel

    theirs = MtpModel.from_pretrained(back.eval()).eval()
    x = torch.randint(0, 264, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hidden = back.model(x).last_hidden_state
        h = theirs.forward_layer(0, hidden[:, :-1], torch.arange(39)[None], None,
                                 input_ids=x[:, 1:])
        want = theirs._project_to_logits(h)
        [got] = ours.predict_ahead(x)
        assert got.shape == want.shape == (2, 39, 264)
        assert _relative_error(got, want) < 1e-5
        again = build_model(load_spec(None, [f"model.init_from={tmp_path / 'out'}",
                                             "model.mtp.depth=1"]), torch.device("cpu")).eval()
        assert _relative_error(again.predict_ahead(x)[0], want) < 1e-5
        # a directory without the module: it keeps its seeded initialisation
        assert build_model(load_spec(None, [f"model.init_from={tmp_path / 'out'}",
                                            "model.mtp.depth=2"]), torch.device("cpu")).mtp["1"] is not None


def test_multi_token_prediction_is_refused_where_it_is_not_built(capsys, tmp_path):
    """Beside capacity where tp or cp split the positions, and in a format other than
    DeepSeek-V3's: one line naming the field and the fix."""
    from trainmesh.cli.main import main

    sets = ["--set", "model.preset=tiny-dsv3", "--set", "model.mtp.depth=1", "--set",
            f"runtime.output_dir={tmp_path}"]
    for extra, field in ((["parallelism.tp=2", "parallelism.dp=1", "model.moe.capacity_factor=1.0"],
                          "model.moe.capacity_factor"),
                         (["parallelism.cp=2", "parallelism.dp=1", "model.moe.capacity_factor=1.0"],
                          "model.moe.capacity_factor")):
        assert main(["run", "jobs/tiny-cpu.yaml", *sets,
                     *[x for e in extra for x in ("--set", e)]]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"{field}: ") and "model.mtp" in err, err
    from trainmesh.interop.hf_config import HfConfigError, export_family

    spec = load_spec(None, ["model.preset=tiny-moe", "model.mtp.depth=1"])
    with pytest.raises(HfConfigError, match="model.mtp=null"):
        export_family(spec.model.model_dump())



def test_a_steps_metrics_carry_the_models_auxiliary_losses():
    """What rank 0 reports of a step with multi-token prediction (``StepStats.losses``) is
    logged beside the loss, by name (the per-step MLflow metrics)."""
    from trainmesh.controller.hooks import step_metrics

    spec = load_spec(None, ["model.preset=tiny-dsv3", "model.mtp.depth=2"])
    stats = {"loss": 5.0, "lr": 1e-3, "grad_norm": 1.0,
             "losses": {"mtp_loss": 5.5, "mtp_loss/depth1": 5.25, "mtp_loss/depth2": 5.75}}
    got = step_metrics(spec, peak_tflops=1.0)(stats, 0.5)
    assert got["loss"] == 5.0 and got["mtp_loss"] == 5.5 and got["mtp_loss/depth2"] == 5.75


@pytest.mark.timeout(300)
def test_the_shipped_deepseek_v3_job_trains_on_its_mesh_as_one_process_and_exports(
        ray_local, tmp_path):
    """``jobs/tiny-dsv3-cpu.yaml`` through the real run path on its own mesh (dp 2 with the
    experts over ep 2): the single process's losses; its checkpoint exports as a
    ``DeepseekV3ForCausalLM`` directory."""
    from pathlib import Path

    from reference import reference_run

    from trainmesh.cli.main import main
    from trainmesh.controller.launch import run_job

    job = Path(__file__).resolve().parents[1] / "jobs" / "tiny-dsv3-cpu.yaml"
    spec = load_spec(job, ["training.steps=3", "optimizer.warmup_steps=1", "eval.every=0",
                           "checkpoint.every=0", "tracking.enabled=false",
                           "elastic.ready_ranks_per_node=0", f"runtime.output_dir={tmp_path}"])
    assert spec.model.mla is not None and spec.parallelism.ep == 2
    summary = run_job(spec, environ={}, show_progress=False)
    assert summary["status"] == "FINISHED" and summary["mesh"]["dp"] == 2
    assert summary["mesh"].get("ep") == 2, summary["mesh"]  # (its experts over both ranks)
    want, _ = reference_run(spec, str(tmp_path / "data" / "tiny-corpus"), steps=3)
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(want), rtol=1e-5, atol=0)
    assert main(["export", str(tmp_path), "--hf", str(tmp_path / "hf")]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["n_routed_experts"] == 8


def test_an_export_cut_into_shards_keeps_each_file_within_the_limit_with_mtp_copies(tmp_path):
    """``max_shard_bytes`` bounds what each safetensors file holds as written: the embedding
    and head copied under each multi-token layer and the float32 routing biases counted (a
    tensor bigger than the limit alone in its file); the index's total is the files' tensors."""
    from safetensors import safe_open
    from test_hf_interop import _committed_checkpoint

    from trainmesh.interop.hf_export import export

    spec = load_spec(None, ["model.preset=tiny-dsv3", "model.mtp.depth=1", "runtime.device=cpu",
                            f"runtime.output_dir={tmp_path}"])
    step_dir = _committed_checkpoint(build_model(spec, torch.device("cpu")), spec,
                                     tmp_path / "ckpt", 1)
    # the largest tensor as written: the embedding (or head) with its copy under the MTP layer
    limit = 2 * spec.model.vocab_size * spec.model.dim * 4 + 1024
    done = export(step_dir, tmp_path / "out", dtype="float32", max_shard_bytes=limit)
    assert done["shards"] > 3
    total = 0
    for path in sorted((tmp_path / "out").glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            held = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
        assert held <= limit, (path.name, held, limit)
        total += held
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == total == done["bytes"]
