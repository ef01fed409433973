"""Hugging Face Llama in and out: import from ``LlamaForCausalLM.save_pretrained`` and export
back (logits equal transformers' own, GQA, tied and untied, llama3 RoPE scaling); import onto
tp2 × dp2 and pp2 × dp2 meshes gives the single process's held-out and training losses, each
rank reading its own slices; one job trains from an imported model on tokenizer-prepared data,
evaluates held-out data into MLflow, resumes on another mesh with the same losses, and its
checkpoint is exported and evaluated again on another mesh."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from reference import load_checkpoint_params, reference_run
from test_data_prepare import EOS, train_tokenizer

from trainmesh.checkpoint.manifest import CheckpointStore
from trainmesh.cli.loading import SpecError, load_spec
from trainmesh.cli.main import main
from trainmesh.data.dataset import open_datasets
from trainmesh.data.shards import ensure_tiny_corpus
from trainmesh.engine.engine import build_model
from trainmesh.parallel.dims import ParallelDims

transformers = pytest.importorskip("transformers")  # a dev dependency: installed by .ci/run

SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 32}
CASES = {"gqa-untied": dict(num_key_value_heads=2),
         "tied": dict(num_key_value_heads=4, tie_word_embeddings=True),
         "mqa-llama3": dict(num_key_value_heads=1, rope_scaling=SCALING, rope_theta=500000.0)}


def save_hf(path, vocab_size: int = 300, seed: int = 0, **kw):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                                   num_attention_heads=4, vocab_size=vocab_size,
                                   max_position_embeddings=256, rms_norm_eps=1e-5,
                                   **{"num_key_value_heads": 2, **kw})
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: (str(root / name), save_hf(root / name, **kw)) for name, kw in CASES.items()}


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _committed_checkpoint(model, spec, directory, step: int) -> str:
    """``model``'s state as a complete trainmesh checkpoint of ``spec`` at ``step`` (what
    ``trainmesh export`` reads)."""
    import torch.distributed.checkpoint as dcp

    store = CheckpointStore(directory)
    partial = store.prepare(step)
    dcp.save({"model": model.state_dict()}, checkpoint_id=partial, no_dist=True)
    return store.commit(partial, {"step": step, "spec": json.loads(spec.model_dump_json())})


@pytest.mark.parametrize("case", list(CASES))
def test_import_and_export_keep_transformers_logits(hf_models, tmp_path, case):
    path, theirs = hf_models[case]
    spec = load_spec(None, [f"model.init_from={path}", f"runtime.output_dir={tmp_path}"])
    assert spec.model.tie_embeddings == (case == "tied") and spec.model.n_layers == 4
    ours = build_model(spec, torch.device("cpu")).eval()
    x = torch.randint(0, 300, (2, 96), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = theirs(x).logits
        assert _relative_error(ours(x), want) < 1e-5
    # A checkpoint of it, exported in small shards, loads into transformers as the same model.
    step_dir = _committed_checkpoint(ours, spec, tmp_path / "ckpt", 7)
    assert main(["export", step_dir, "--hf", str(tmp_path / "out"), "--max-shard-size", "200000"]) == 0
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    back, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    with torch.no_grad():
        assert _relative_error(back.eval()(x).logits, want) < 1e-5
    # ... and imports again from its sharded index.
    again = build_model(load_spec(None, [f"model.init_from={tmp_path / 'out'}"]), torch.device("cpu"))
    with torch.no_grad():
        assert _relative_error(again.eval()(x), want) < 1e-5


def test_a_shape_that_differs_from_config_json_is_refused_naming_both(hf_models):
    path, _ = hf_models["gqa-untied"]
    with pytest.raises(SpecError) as err:
        load_spec(None, [f"model.init_from={path}", "model.n_kv_heads=4", "model.dim=128"])
    text = str(err.value)
    assert "model.n_kv_heads: 4 here but 2 in" in text and "model.dim: 128 here but 64" in text
    with pytest.raises(SpecError) as err:  # fields the user never wrote: the preset's
        load_spec(None, [f"model.init_from={path}", "model.preset=tiny"])
    text = str(err.value)
    assert text.startswith("model.preset: 'tiny' sets ") and "vocab_size=264" in text
    assert "drop model.preset" in text and "model.vocab_size:" not in text
    with pytest.raises(SpecError, match="model.init_from: .*config.json not found"):
        load_spec(None, [f"model.init_from={path}/nowhere"])


def _held_out_loss(hf_model, data_dir: str, spec) -> float:
    """transformers' own mean loss over the held-out windows the job evaluates."""
    tr = spec.training
    _, held = open_datasets(data_dir, tr.seq_len, eval_fraction=spec.data.eval_fraction)
    losses = []
    with torch.no_grad():
        for b in range(spec.eval.batches):
            x, y = held.eval_microbatches(b, tr.global_batch_size, 0, 1, tr.global_batch_size)[0]
            logits = hf_model(x).logits
            losses.append(float(F.cross_entropy(logits.flatten(0, 1), y.flatten())))
    return sum(losses) / len(losses)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dims", [ParallelDims(tp=2, dp=2), ParallelDims(pp=2, dp=2)],
                         ids=["tp2-dp2", "pp2-dp2"])
def test_import_onto_a_mesh_gives_the_single_process_losses(rank_pool, hf_models, tmp_path, dims):
    path, theirs = hf_models["gqa-untied"]
    spec = load_spec(None, [f"model.init_from={path}", f"parallelism.tp={dims.tp}",
                            f"parallelism.pp={dims.pp}", f"parallelism.dp={dims.dp}",
                            "data.eval_fraction=0.2", "eval.batches=2", "training.seq_len=32",
                            "training.global_batch_size=8", "training.microbatch_size=2",
                            "optimizer.warmup_steps=1", "tracking.enabled=false", "runtime.device=cpu",
                            f"runtime.output_dir={tmp_path}"])
    data_dir = str(ensure_tiny_corpus(tmp_path / "data"))
    group = rank_pool.group_for(spec, dims)
    try:
        group.build(spec.model_dump_json(), dims, data_dir)
        held_out = group.evaluate(spec.eval.batches)
        read = [r["imported"] for r in group.memory_reports()]
        losses = [group.train_step()[0]["loss"] for _ in range(2)]
    finally:
        rank_pool.release(group)
    # each rank read its own slices of the safetensors file, about a quarter of it (the
    # permuted wq/wk rows come in whole heads), and together they read all of it
    whole = sum(p.numel() * 4 for p in theirs.parameters())
    assert sum(read) >= whole and max(read) < 0.4 * whole, (read, whole)
    assert held_out == pytest.approx(_held_out_loss(theirs, data_dir, spec), rel=1e-5)
    ref, _ = reference_run(spec, data_dir, steps=2)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=0)


@pytest.mark.timeout(300)
def test_job_from_an_imported_model_on_tokenized_data_evaluates_resumes_exports_and_reevaluates(
        ray_local, tmp_path, capsys):
    import shutil

    import yaml
    from mlflow.tracking import MlflowClient

    from trainmesh.controller.launch import run_job
    from trainmesh.data import corpus

    (tmp_path / "tok").mkdir()
    tok = train_tokenizer(tmp_path / "tok" / "tokenizer.json")
    docs = corpus.documents()
    for name, part in (("train", docs[:-4]), ("held", docs[-4:])):  # held-out documents apart
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
        assert main(["data", "prepare", str(tmp_path / f"{name}.jsonl"), "--tokenizer",
                     str(tmp_path / "tok"), "--out", str(tmp_path / name)]) == 0
    vocab = -(-tok.get_vocab_size() // 8) * 8  # padded, so that tp can split it
    save_hf(tmp_path / "hf", vocab_size=vocab, seed=3)
    out = tmp_path / "run"
    raw = {"name": "from-hf", "model": {"init_from": str(tmp_path / "hf")},
           "data": {"path": str(tmp_path / "train"), "eval_path": str(tmp_path / "held")},
           "eval": {"every": 2, "batches": 2}, "parallelism": {"dp": 2},
           "training": {"steps": 6, "seq_len": 32, "global_batch_size": 8, "microbatch_size": 2},
           "checkpoint": {"every": 2}, "optimizer": {"warmup_steps": 1},
           "runtime": {"device": "cpu", "output_dir": str(out)},
           "elastic": {"ready_ranks_per_node": 0}}  # no failure here: no spare process
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(raw))
    first = run_job(load_spec(tmp_path / "job.yaml"), environ={}, show_progress=False)
    assert first["status"] == "FINISHED" and [e["step"] for e in first["eval"]] == [2, 4, 6]
    client = MlflowClient(first["tracking_uri"])
    history = sorted(client.get_metric_history(first["mlflow_run_id"], "eval_loss"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in history] == [(e["step"], e["loss"]) for e in first["eval"]]

    # Resumed from step 4 on another mesh (dp 2 → tp 2): the same samples, the same losses.
    shutil.rmtree(first["checkpoints"][-1])
    spec = load_spec(tmp_path / "job.yaml", ["parallelism.dp=1", "parallelism.tp=2"])
    summary = run_job(spec, environ={}, show_progress=False)
    assert summary["steps_done"] == 6 and summary["eval"][-1]["step"] == 6
    torch.testing.assert_close(torch.tensor(summary["losses"][4:]), torch.tensor(first["losses"][4:]),
                               rtol=1e-5, atol=0)
    assert summary["eval"][-1]["loss"] == pytest.approx(first["eval"][-1]["loss"], rel=1e-5)

    # Its step-6 checkpoint (written under tp 2) exported to the Hugging Face format with its
    # tokenizer, and logged to the run.
    assert main(["export", str(out), "--hf", str(tmp_path / "export"), "--mlflow"]) == 0
    back, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "export", output_loading_info=True)
    assert not any(info.values()), info
    ours = build_model(spec, torch.device("cpu"))
    ours.load_state_dict(load_checkpoint_params(spec, summary["checkpoints"][-1]))
    x = torch.randint(0, tok.get_vocab_size(), (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert _relative_error(back.eval()(x).logits, ours.eval()(x)) < 1e-5
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "export" / "tokenizer.json"))
    text = corpus.documents(1)[0]
    assert fast.encode(text) == tok.encode(text).ids
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["eos_token_id"] == tok.token_to_id(EOS)
    # Starting from the export again: its tokenizer is the data's; the bundled byte corpus is not.
    from trainmesh.controller.preflight import preflight_problems

    again = [f"model.init_from={tmp_path / 'export'}", "runtime.device=cpu"]
    assert preflight_problems(load_spec(None, [*again, f"data.path={tmp_path / 'train'}"])) == []
    [problem] = preflight_problems(load_spec(None, again))
    assert problem.path == "data.path" and "prepare the data with --tokenizer" in str(problem)
    logged = {a.path for a in client.list_artifacts(summary["mlflow_run_id"], "hf")}
    assert {"hf/config.json", "hf/tokenizer.json", "hf/model.safetensors.index.json"} <= logged

    # `trainmesh eval` on another mesh restores the newest checkpoint: the same held-out loss.
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "job.yaml"), "--set", "parallelism.dp=1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["step"] == 6 and result["mesh"]["dp"] == 1
    assert result["eval_loss"] == pytest.approx(summary["eval"][-1]["loss"], rel=1e-5)


def _assert_round_trip(theirs, spec, tmp_path, architecture: str):
    """Imported, the model gives transformers' logits; a checkpoint of it exported with
    ``trainmesh export`` loads in transformers as ``architecture``, every tensor used, with the
    same logits. Returns the export directory."""
    ours = build_model(spec, torch.device("cpu")).eval()
    x = torch.randint(0, 264, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = theirs(x).logits
        assert _relative_error(ours(x), want) < 1e-5
    step_dir = _committed_checkpoint(ours, spec, tmp_path / "ckpt", 1)
    assert main(["export", step_dir, "--hf", str(tmp_path / "out")]) == 0
    back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out",
                                                                   output_loading_info=True)
    assert type(back).__name__ == architecture and not any(info.values()), info
    with torch.no_grad():
        assert _relative_error(back.eval()(x).logits, want) < 1e-5
    return tmp_path / "out"


def save_mixtral(path, seed: int = 0, **kw):
    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     num_local_experts=4, num_experts_per_tok=2, vocab_size=264,
                                     max_position_embeddings=256, rms_norm_eps=1e-5, **kw)
    model = transformers.MixtralForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral") / "hf"
    return str(path), save_mixtral(path)


def test_mixtral_imports_and_exports_with_transformers_logits(mixtral, tmp_path):
    """``MixtralForCausalLM``: the per-expert tensors stacked into trainmesh's experts, the
    router as its router; exported back, transformers loads every tensor and gives the same
    logits."""
    path, theirs = mixtral
    spec = load_spec(None, [f"model.init_from={path}", "model.moe.balance=aux_loss",
                            f"runtime.output_dir={tmp_path}"])
    moe = spec.model.moe
    assert (moe.experts, moe.top_k, moe.expert_ffn_dim, moe.router) == (4, 2, 48, "softmax")
    out = _assert_round_trip(theirs, spec, tmp_path, "MixtralForCausalLM")
    config = json.loads((out / "config.json").read_text())
    assert config["num_local_experts"] == 4 and config["num_experts_per_tok"] == 2


@pytest.mark.parametrize("job, setting, named, want", [
    (None, "model.moe.shared_experts=1", "shared_experts", "0"),
    (None, "model.moe.router=sigmoid", "router", "softmax"),
    ("jobs/tiny-moe-cpu.yaml", None, "balance", "aux_loss"),  # the shipped MoE job's
    (None, "model.moe.dense_layers=1", "dense_layers", "0")])
def test_export_refuses_an_moe_model_no_format_holds_naming_the_value_needed_and_a_fix_that_works(
        tmp_path, job, setting, named, want):
    """The refusal names the value the format needs (not the model's own) and the settings to
    train with; trained with them, the same model exports."""
    import re

    from trainmesh.interop.hf_export import ExportError, export

    overrides = ["model.preset=tiny-moe"] if job is None else []
    overrides += [setting] if setting else []
    spec = load_spec(job, overrides)
    step_dir = _committed_checkpoint(build_model(spec, torch.device("cpu")), spec,
                                     tmp_path / "ckpt", 1)
    with pytest.raises(ExportError, match=f"model.moe.{named}={want} \\(this model's is ") as err:
        export(step_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before anything is written
    fix = re.findall(r"--set (\S+)", str(err.value))
    assert fix == [f"model.moe.{named}={want}"]
    spec = load_spec(job, [*overrides, *fix])
    step_dir = _committed_checkpoint(build_model(spec, torch.device("cpu")), spec,
                                     tmp_path / "fixed", 1)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export(step_dir, tmp_path / "out")
    assert not caught, [str(w.message) for w in caught]  # nothing of torch's leaks into it
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "mixtral"


@pytest.mark.timeout(300)
def test_mixtral_imported_onto_ep2_dp2_reads_only_each_ranks_experts(rank_pool, mixtral,
                                                                     tmp_path):
    path, theirs = mixtral
    assert_imported_onto_ep2_dp2(rank_pool, path, theirs, tmp_path)


def assert_imported_onto_ep2_dp2(rank_pool, path, theirs, tmp_path) -> None:
    """The Hugging Face directory ``path`` (of ``theirs``) imported onto dp 2 × ep 2: the ranks
    read it all between them, none more than 0.6 of it (of the experts, each its own), and two
    steps give the single process's losses."""
    dims = ParallelDims(dp=2, ep=2)
    spec = load_spec(None, [f"model.init_from={path}", "parallelism.dp=2", "parallelism.ep=2",
                            "training.seq_len=32", "training.global_batch_size=4",
                            "training.microbatch_size=1", "optimizer.warmup_steps=1",
                            "tracking.enabled=false", "runtime.device=cpu",
                            f"runtime.output_dir={tmp_path}"])
    data_dir = str(ensure_tiny_corpus(tmp_path / "data"))
    group = rank_pool.group_for(spec, dims)
    try:
        group.build(spec.model_dump_json(), dims, data_dir)
        read = [r["imported"] for r in group.memory_reports()]
        losses = [group.train_step()[0]["loss"] for _ in range(2)]
    finally:
        rank_pool.release(group)
    whole = sum(p.numel() * 4 for p in theirs.parameters())
    assert sum(read) >= whole and max(read) < 0.6 * whole, (read, whole)
    ref, _ = reference_run(spec, data_dir, steps=2)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=0)


def _saved_with_spread_qk_norms(model, path):
    """``model`` (eval) saved to ``path`` with its per-head q/k norms away from 1, so that their
    layout matters; returns it."""
    model = model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return model


def test_qwen3_moe_imports_and_exports_with_transformers_logits(tmp_path):
    """``Qwen3MoeForCausalLM``: 32-wide heads beside a 64 hidden size, per-head q/k norms (in
    the same RoPE layout mapping as the projections), unnormalised top-k scores and a leading
    dense block; exported back, transformers loads every tensor with the same logits."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[0], vocab_size=264,
        max_position_embeddings=256, rms_norm_eps=1e-6)
    theirs = _saved_with_spread_qk_norms(transformers.Qwen3MoeForCausalLM(cfg), tmp_path / "hf")
    spec = load_spec(None, [f"model.init_from={tmp_path / 'hf'}", f"runtime.output_dir={tmp_path}"])
    m = spec.model
    assert (m.head_dim, m.qk_norm, m.moe.dense_layers, m.moe.normalize_top_k) == (32, True, 1, False)
    _assert_round_trip(theirs, spec, tmp_path, "Qwen3MoeForCausalLM")


def test_qwen3_dense_imports_and_exports_with_transformers_logits(tmp_path):
    """``Qwen3ForCausalLM``: the dense Qwen3 (per-head q/k norms, 32-wide heads beside a 64
    hidden size); exported back, transformers loads every tensor with the same logits."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=264, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=False)
    theirs = _saved_with_spread_qk_norms(transformers.Qwen3ForCausalLM(cfg), tmp_path / "hf")
    spec = load_spec(None, [f"model.init_from={tmp_path / 'hf'}", f"runtime.output_dir={tmp_path}"])
    assert (spec.model.head_dim, spec.model.qk_norm, spec.model.moe) == (32, True, None)
    out = _assert_round_trip(theirs, spec, tmp_path, "Qwen3ForCausalLM")
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3"


def test_qwen3_with_yarn_scaling_and_a_quantised_checkpoint_refused(tmp_path):
    """YaRN on a grouped-query model as transformers reads it (no mscale given: its own
    0.1·ln(factor) + 1 on the tables): the logits are transformers'. A checkpoint whose
    config.json has a quantization_config (DeepSeek's block-FP8 releases) is refused naming
    it, not read as if its weights were unquantised."""
    from trainmesh.interop.hf_config import HfConfigError, model_fields

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=264, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16})
    theirs = transformers.Qwen3ForCausalLM(cfg).eval()
    theirs.save_pretrained(tmp_path / "hf")
    spec = load_spec(None, [f"model.init_from={tmp_path / 'hf'}", f"runtime.output_dir={tmp_path}"])
    assert spec.model.rope_scaling.type == "yarn"
    _assert_round_trip(theirs, spec, tmp_path, "Qwen3ForCausalLM")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "weight_block_size": [128, 128]}
    with pytest.raises(HfConfigError, match="quantization_config \\(fp8\\).*dequantise"):
        model_fields(config)
