"""A Hugging Face Llama, Qwen3, Mixtral, Qwen3-MoE or DeepSeek-V3 ``config.json`` ↔ the spec's
``model`` fields; and the parameter names and RoPE layouts of the formats. No torch here: the
spec loader uses it. Qwen3 is the Llama decoder with an RMSNorm over each query and key head.

Mixtral is the Llama decoder with every MLP a Mixture of Experts (softmax top-k router, the
chosen scores renormalised, no shared expert, no routing bias). Qwen3-MoE adds an RMSNorm over
each query and key head (``model.qk_norm``), a head size of its own (``model.head_dim``),
optionally unnormalised top-k scores and leading dense blocks (``mlp_only_layers``). Both
hold each expert's three matrices as separate tensors, which trainmesh stacks expert-major.

Meta's Llama (and trainmesh) rotates interleaved pairs of a head's dimensions (2i, 2i+1);
transformers rotates halves (i, i + d/2). The models are the same once the rows of ``wq`` and
``wk`` are permuted head by head: trainmesh row ``h·d + 2i + j`` is Hugging Face row
``h·d + j·d/2 + i``.
"""

from __future__ import annotations

import json
import re
from typing import Any

import fsspec

# spec field ← config.json key
_FIELDS = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
           "n_kv_heads": "num_key_value_heads", "ffn_dim": "intermediate_size",
           "vocab_size": "vocab_size", "max_seq_len": "max_position_embeddings",
           "norm_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings"}
SHAPE_FIELDS = (*_FIELDS, "rope_theta", "rope_scaling", "moe", "head_dim", "qk_norm", "mla")
# What a Mixture-of-Experts config fixes about the model (the rest of model.moe is training).
MOE_STRUCTURE = ("experts", "top_k", "expert_ffn_dim", "shared_experts", "router",
                 "normalize_top_k", "dense_layers", "n_group", "topk_group", "routed_scaling_factor")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM"}
_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim")
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")

# trainmesh parameter name pattern → Hugging Face name
_NAMES = [("tok_embeddings.weight", "model.embed_tokens.weight"),
          ("norm.weight", "model.norm.weight"), ("output.weight", "lm_head.weight")]
_LAYER = {"attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
          "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
          "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
          "feed_forward.w2.weight": "mlp.down_proj.weight", "attention_norm.weight": "input_layernorm.weight",
          "ffn_norm.weight": "post_attention_layernorm.weight"}
_FAMILY_LAYER = {
    "llama": {},
    "qwen3": {"attention.q_norm.weight": "self_attn.q_norm.weight",
              "attention.k_norm.weight": "self_attn.k_norm.weight"},
    "mixtral": {"feed_forward.router.weight": "block_sparse_moe.gate.weight"},
    "qwen3_moe": {"feed_forward.router.weight": "mlp.gate.weight",
                  "attention.q_norm.weight": "self_attn.q_norm.weight",
                  "attention.k_norm.weight": "self_attn.k_norm.weight"},
    "deepseek_v3": {"attention.wq_a.weight": "self_attn.q_a_proj.weight",
                    "attention.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
                    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
                    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
                    "attention.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
                    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
                    "feed_forward.router.weight": "mlp.gate.weight",
                    # the balancing bias (a buffer here): DeepSeek's e_score_correction_bias
                    "feed_forward.expert_bias": "mlp.gate.e_score_correction_bias",
                    "feed_forward.shared.w1.weight": "mlp.shared_experts.gate_proj.weight",
                    "feed_forward.shared.w3.weight": "mlp.shared_experts.up_proj.weight",
                    "feed_forward.shared.w2.weight": "mlp.shared_experts.down_proj.weight"}}
_EXPERTS = {"mixtral": ("block_sparse_moe.experts", {"w1": "w1", "w2": "w2", "w3": "w3"}),
            "qwen3_moe": ("mlp.experts", {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}),
            "deepseek_v3": ("mlp.experts", {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"})}
_EXPERT_RE = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.(w[123])$")
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")


class HfConfigError(ValueError):
    """A config.json trainmesh cannot take, with the reason."""


def read_config(path: str) -> dict[str, Any]:
    where = f"{path.rstrip('/')}/config.json"
    try:
        with fsspec.open(where, "r") as f:
            return json.load(f)
    except FileNotFoundError:
        raise HfConfigError(f"{where} not found; model.init_from must be a Hugging Face model "
                            "directory (config.json + safetensors)") from None


def model_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The spec's model fields a Llama, Mixtral or Qwen3-MoE ``config.json`` (transformers 4
    or 5) describes."""
    kind = cfg.get("model_type")
    if kind not in ARCHITECTURES:
        raise HfConfigError(f"model_type {kind!r}: trainmesh imports {', '.join(ARCHITECTURES)}")
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        raise HfConfigError(f"quantization_config ({method}): trainmesh reads unquantised weights "
                            "(bf16/fp32); dequantise the checkpoint first (DeepSeek's block-FP8 "
                            "releases: its fp8_cast_bf16 script)")
    for key, want in (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu")):
        if cfg.get(key, want) != want:
            raise HfConfigError(f"{key}={cfg[key]!r}: trainmesh's Llama has {key}={want!r}")
    out = {f: cfg[k] for f, k in _FIELDS.items() if k in cfg}
    out.setdefault("n_kv_heads", out.get("n_heads"))
    out.setdefault("tie_embeddings", False)
    head_dim = cfg.get("head_dim")
    if kind == "deepseek_v3":
        out["mla"] = _deepseek_mla(cfg)
        out["n_kv_heads"] = out["n_heads"]
    elif head_dim is not None and head_dim * out["n_heads"] != out["dim"]:
        out["head_dim"] = head_dim  # its own head size (Qwen3: 128 beside a 2048 hidden)
    if kind in ("qwen3", "qwen3_moe"):
        out["qk_norm"] = True
        if cfg.get("use_sliding_window"):
            raise HfConfigError("use_sliding_window=true: trainmesh attends over the whole sequence")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    out["rope_theta"] = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "llama3":
        missing = [k for k in _SCALING_KEYS if k not in rope]
        if missing:
            raise HfConfigError(f"llama3 RoPE scaling without {', '.join(missing)}")
        out["rope_scaling"] = {"type": "llama3", **{k: rope[k] for k in _SCALING_KEYS}}
    elif kind == "yarn":
        if "factor" not in rope or "original_max_position_embeddings" not in rope:
            raise HfConfigError("yarn RoPE scaling without factor and "
                                "original_max_position_embeddings")
        if rope.get("attention_factor") is not None or rope.get("truncate", True) is False:
            raise HfConfigError("yarn RoPE scaling with attention_factor or truncate=false: "
                                "trainmesh derives the factor from mscale and mscale_all_dim and "
                                "rounds YaRN's ramp bounds")
        out["rope_scaling"] = {"type": "yarn", **{k: rope[k] for k in _YARN_KEYS
                                                  if rope.get(k) is not None}}
    elif kind == "default":
        out["rope_scaling"] = None
    else:
        raise HfConfigError(f"rope_type {kind!r}: only default, llama3 and yarn RoPE are supported")
    family = cfg["model_type"]
    out["moe"] = {"mixtral": _mixtral_moe, "qwen3_moe": _qwen3_moe, "deepseek_v3": _deepseek_moe,
                  "llama": lambda c: None, "qwen3": lambda c: None}[family](cfg)
    return out


def _deepseek_mla(cfg: dict[str, Any]) -> dict[str, Any]:
    if not cfg.get("rope_interleave", True):
        raise HfConfigError("rope_interleave=false: trainmesh takes DeepSeek's interleaved "
                            "rotary layout (its released checkpoints')")
    return {f: cfg.get(f) for f in MLA_FIELDS}


def _deepseek_moe(cfg: dict[str, Any]) -> dict[str, Any]:
    n, dense = cfg["num_hidden_layers"], cfg.get("first_k_dense_replace", 0)
    if cfg.get("moe_layer_freq", 1) != 1:
        raise HfConfigError(f"moe_layer_freq={cfg['moe_layer_freq']}: trainmesh's dense blocks "
                            "are the leading ones, every later block MoE")
    if dense >= n:
        raise HfConfigError("every block is dense (first_k_dense_replace ≥ num_hidden_layers): "
                            "trainmesh imports DeepSeek-V3 as a Mixture of Experts")
    if not cfg.get("n_shared_experts"):
        raise HfConfigError("n_shared_experts=0: DeepSeek-V3's blocks have a shared expert")
    return {"experts": cfg["n_routed_experts"], "top_k": cfg["num_experts_per_tok"],
            "expert_ffn_dim": cfg["moe_intermediate_size"],
            "shared_experts": cfg["n_shared_experts"], "router": "sigmoid",
            "normalize_top_k": bool(cfg.get("norm_topk_prob", True)), "dense_layers": dense,
            "n_group": cfg.get("n_group") or 1, "topk_group": cfg.get("topk_group") or 1,
            "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 1.0)),
            "balance": "bias"}


_NO_GROUPS = {"n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0}


def _qwen3_moe(cfg: dict[str, Any]) -> dict[str, Any]:
    n = cfg["num_hidden_layers"]
    dense = sorted(cfg.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))) or cfg.get("decoder_sparse_step", 1) != 1:
        raise HfConfigError(f"mlp_only_layers={dense}, decoder_sparse_step="
                            f"{cfg.get('decoder_sparse_step', 1)}: trainmesh's dense blocks are "
                            "the leading ones (model.moe.dense_layers), every later block MoE")
    if len(dense) >= n:
        raise HfConfigError("every block is dense: import it as a dense model")
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))  # the latter: transformers 5
    return {"experts": experts, "top_k": cfg["num_experts_per_tok"],
            "expert_ffn_dim": cfg["moe_intermediate_size"], "shared_experts": 0,
            "router": "softmax", "normalize_top_k": bool(cfg.get("norm_topk_prob", False)),
            "dense_layers": len(dense), **_NO_GROUPS,
            "aux_loss_coef": float(cfg.get("router_aux_loss_coef", 0.001))}


def _mixtral_moe(cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg.get("sliding_window") is not None:
        raise HfConfigError(f"sliding_window={cfg['sliding_window']}: trainmesh attends over the "
                            "whole sequence (Mixtral 8x7B v0.1 and 8x22B have none)")
    return {"experts": cfg["num_local_experts"], "top_k": cfg["num_experts_per_tok"],
            "expert_ffn_dim": cfg["intermediate_size"], "shared_experts": 0,
            "router": "softmax", "normalize_top_k": True, "dense_layers": 0, **_NO_GROUPS,
            "aux_loss_coef": float(cfg.get("router_aux_loss_coef", 0.02))}


def export_family(model: dict[str, Any]) -> str:
    """The Hugging Face format that holds the spec's model exactly: llama for a dense model,
    mixtral for an MoE one Mixtral can express, qwen3_moe for one with per-head q/k norms;
    otherwise what does not fit, and the fix."""
    moe, qk_norm = model.get("moe"), bool(model.get("qk_norm"))
    if model.get("mla") is not None:
        return _deepseek_family(model)
    if model.get("mtp") is not None:
        raise HfConfigError("no supported Hugging Face format holds this model: multi-token "
                            "prediction (model.mtp) is DeepSeek-V3's, which also has latent "
                            "attention (model.mla). Train it with model.mtp=null (or as "
                            "DeepSeek-V3) to export it")
    if moe is None:
        return "qwen3" if qk_norm else "llama"
    family = "qwen3_moe" if qk_norm else "mixtral"
    rules = [("shared_experts", 0, "it has no shared expert"),
             ("router", "softmax", "its router is a softmax"),
             ("balance", "aux_loss", "its router has no routing bias"),
             ("n_group", 1, "its routing has no expert groups"),
             ("routed_scaling_factor", 1.0, "its routed weights are not rescaled")]
    if family == "mixtral":
        rules += [("dense_layers", 0, "every block is MoE"),
                  ("normalize_top_k", True, "it renormalises the chosen scores")]
    wants = {f"model.moe.{field}": (want, moe[field], why) for field, want, why in rules
             if moe.get(field, want) != want}
    if family == "mixtral" and model.get("head_dim") and model["head_dim"] * model["n_heads"] != model["dim"]:
        wants["model.head_dim"] = (None, model["head_dim"], "its heads are hidden / heads wide")
    if wants:
        name = {"mixtral": "Mixtral", "qwen3_moe": "Qwen3-MoE"}[family]
        needs = "; ".join(f"{key}={_yaml(want)} (this model's is {_yaml(have)}: {why})"
                          for key, (want, have, why) in wants.items())
        sets = " ".join(f"--set {key}={_yaml(want)}" for key, (want, _, _) in wants.items())
        raise HfConfigError(f"no supported Hugging Face format holds this model: {name} needs "
                            f"{needs}. Train it with {name}'s settings to export it: {sets}")
    return family


def _deepseek_family(model: dict[str, Any]) -> str:
    """A latent-attention model is exported as DeepSeek-V3, which has MoE blocks after the
    leading dense ones, each with a sigmoid router and a shared expert."""
    moe = model.get("moe")
    if moe is None:
        raise HfConfigError("no supported Hugging Face format holds this model: model.mla without "
                            "model.moe (DeepSeek-V3's blocks after the leading dense ones are MoE). "
                            "Train it with model.moe set to export it")
    wants = []
    if moe.get("router", "softmax") != "sigmoid":
        wants.append(("model.moe.router", "sigmoid", moe.get("router", "softmax")))
    if not moe.get("shared_experts"):
        wants.append(("model.moe.shared_experts", 1, moe.get("shared_experts", 0)))
    if moe.get("dense_layers", 0) >= model["n_layers"]:
        wants.append(("model.moe.dense_layers", model["n_layers"] - 1, moe["dense_layers"]))
    if wants:
        needs = "; ".join(f"{key}={_yaml(want)} (this model's is {_yaml(have)})"
                          for key, want, have in wants)
        sets = " ".join(f"--set {key}={_yaml(want)}" for key, want, _ in wants)
        raise HfConfigError(f"no supported Hugging Face format holds this model: DeepSeek-V3 "
                            f"needs {needs}. Train it with DeepSeek-V3's settings to export it: {sets}")
    return "deepseek_v3"


def _yaml(value: Any) -> str:
    """A spec value as ``--set`` and YAML take it."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def config_json(model: dict[str, Any], eos_token_id: int | None = None,
                bos_token_id: int | None = None, dtype: str = "float32") -> dict[str, Any]:
    """A transformers ``LlamaConfig`` or ``MixtralConfig`` (as config.json) for the spec's
    model fields (``export_family`` chooses; it refuses what neither holds)."""
    family = export_family(model)
    cfg: dict[str, Any] = {"architectures": [ARCHITECTURES[family]], "model_type": family,
                           **{k: model[f] for f, k in _FIELDS.items()},
                           "head_dim": model.get("head_dim") or model["dim"] // model["n_heads"],
                           "hidden_act": "silu",
                           "attention_bias": False, "mlp_bias": False, "rope_theta": model["rope_theta"],
                           "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
                           "dtype": dtype, "torch_dtype": dtype}  # the latter: transformers < 4.56
    s = model.get("rope_scaling")
    if s and s.get("type") == "yarn":
        cfg["rope_scaling"] = {"rope_type": "yarn", "type": "yarn", "rope_theta": model["rope_theta"],
                               **{k: s[k] for k in _YARN_KEYS if k in s}}
    else:
        cfg["rope_scaling"] = {"rope_type": "llama3", **{k: s[k] for k in _SCALING_KEYS}} if s else None
    if family == "deepseek_v3":
        moe, mla = model["moe"], model["mla"]
        cfg.update(**{f: mla[f] for f in MLA_FIELDS}, rope_interleave=True,
                   head_dim=mla["qk_rope_head_dim"], n_routed_experts=moe["experts"],
                   num_experts_per_tok=moe["top_k"], moe_intermediate_size=moe["expert_ffn_dim"],
                   n_shared_experts=moe["shared_experts"], norm_topk_prob=moe["normalize_top_k"],
                   first_k_dense_replace=moe["dense_layers"], n_group=moe.get("n_group", 1),
                   topk_group=moe.get("topk_group", 1),
                   routed_scaling_factor=moe.get("routed_scaling_factor", 1.0),
                   num_mtp_layers=(model.get("mtp") or {}).get("depth", 0), attention_dropout=0.0)
        del cfg["mlp_bias"]
    if family == "qwen3":
        cfg.update(use_sliding_window=False, sliding_window=None)
        del cfg["mlp_bias"]
    if family == "mixtral":
        moe = model["moe"]
        cfg.update(num_local_experts=moe["experts"], num_experts_per_tok=moe["top_k"],
                   intermediate_size=moe["expert_ffn_dim"], sliding_window=None,
                   router_aux_loss_coef=moe.get("aux_loss_coef", 0.02), router_jitter_noise=0.0,
                   output_router_logits=False)
        del cfg["attention_bias"], cfg["mlp_bias"]
    if family == "qwen3_moe":
        moe = model["moe"]
        cfg.update(num_experts=moe["experts"], num_local_experts=moe["experts"],
                   num_experts_per_tok=moe["top_k"], moe_intermediate_size=moe["expert_ffn_dim"],
                   norm_topk_prob=moe["normalize_top_k"], decoder_sparse_step=1,
                   mlp_only_layers=list(range(moe["dense_layers"])), use_sliding_window=False,
                   sliding_window=None, router_aux_loss_coef=moe.get("aux_loss_coef", 0.001),
                   output_router_logits=False)
        del cfg["mlp_bias"]
    return cfg


_MTP_RE = re.compile(r"^mtp\.(\d+)\.(.+)$")
# a multi-token prediction module's own parameters → DeepSeek's names under its layer
_MTP_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
            "eh_proj.weight": "eh_proj.weight", "norm.weight": "shared_head.norm.weight"}


def _mtp_as_layer(name: str, n_layers: int | None) -> tuple[str, str | None]:
    """A multi-token prediction module's parameter (``mtp.k.…``) as DeepSeek's checkpoints
    number it: module k is layer n_layers + k, its block's parameters that layer's (the name
    to map as a block's) or its own (the Hugging Face name, second)."""
    m = _MTP_RE.match(name)
    if m is None or n_layers is None:
        return name, None
    layer, rest = n_layers + int(m.group(1)), m.group(2)
    if rest in _MTP_OWN:
        return name, f"model.layers.{layer}.{_MTP_OWN[rest]}"
    return f"layers.{layer}.{rest.removeprefix('block.')}", None


def mtp_copies(family: str, n_layers: int, depth: int) -> dict[str, list[str]]:
    """The tensors DeepSeek's checkpoints hold once more under each multi-token prediction
    layer (the embedding and the head, which the modules share with the model)."""
    if family != "deepseek_v3" or not depth:
        return {}
    layers = range(n_layers, n_layers + depth)
    return {"tok_embeddings.weight": [f"model.layers.{i}.embed_tokens.weight" for i in layers],
            "output.weight": [f"model.layers.{i}.shared_head.head.weight" for i in layers]}


def hf_name(name: str, family: str = "llama", n_layers: int | None = None) -> str:
    """The Hugging Face name of a trainmesh parameter (not a stacked expert weight: see
    ``hf_expert_names``); ``n_layers``: the model's, numbering multi-token prediction modules
    after its blocks."""
    name, own = _mtp_as_layer(name, n_layers)
    if own is not None:
        return own
    for ours, theirs in _NAMES:
        if name == ours:
            return theirs
    m = _LAYER_RE.match(name)
    layer = {**_LAYER, **_FAMILY_LAYER[family]}
    if m and m.group(2) in layer:
        return f"model.layers.{m.group(1)}.{layer[m.group(2)]}"
    raise KeyError(f"no Hugging Face {family} name for parameter {name!r}")


def hf_expert_names(name: str, experts: int, family: str,
                    n_layers: int | None = None) -> list[str] | None:
    """For a stacked expert weight (``layers.i.feed_forward.experts.w1``: expert-major), the
    tensor of each expert in ``family``'s format, in order; None for any other parameter."""
    m = _EXPERT_RE.match(_mtp_as_layer(name, n_layers)[0])
    if m is None:
        return None
    prefix, names = _EXPERTS[family]
    return [f"model.layers.{m.group(1)}.{prefix}.{j}.{names[m.group(2)]}.weight"
            for j in range(experts)]


def rope_permuted(name: str, family: str = "llama") -> bool:
    """Whether a parameter's rows are in a different RoPE layout in the two formats (the q/k
    projections, and the per-head q/k norms: one head's dimensions). DeepSeek's rotary
    dimensions are interleaved pairs, as trainmesh's: none."""
    return family != "deepseek_v3" and name.endswith((
        "attention.wq.weight", "attention.wk.weight", "attention.q_norm.weight",
        "attention.k_norm.weight"))


def hf_row(row: int, head_dim: int) -> int:
    """The Hugging Face row of trainmesh row ``row`` of ``wq``/``wk``."""
    head, m = divmod(row, head_dim)
    return head * head_dim + (m % 2) * (head_dim // 2) + m // 2
