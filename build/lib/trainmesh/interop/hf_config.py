"""A Hugging Face Llama ``config.json`` ↔ the spec's ``model`` fields; and the parameter names
and RoPE layouts of the two. No torch here: the spec loader uses it.

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
SHAPE_FIELDS = (*_FIELDS, "rope_theta", "rope_scaling")
_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

# trainmesh parameter name pattern → Hugging Face name
_NAMES = [("tok_embeddings.weight", "model.embed_tokens.weight"),
          ("norm.weight", "model.norm.weight"), ("output.weight", "lm_head.weight")]
_LAYER = {"attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
          "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
          "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
          "feed_forward.w2.weight": "mlp.down_proj.weight", "attention_norm.weight": "input_layernorm.weight",
          "ffn_norm.weight": "post_attention_layernorm.weight"}
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
    """The spec's model fields a Llama ``config.json`` (transformers 4 or 5) describes."""
    if cfg.get("model_type") != "llama":
        raise HfConfigError(f"model_type {cfg.get('model_type')!r}: only 'llama' can be imported")
    for key, want in (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu")):
        if cfg.get(key, want) != want:
            raise HfConfigError(f"{key}={cfg[key]!r}: trainmesh's Llama has {key}={want!r}")
    out = {f: cfg[k] for f, k in _FIELDS.items() if k in cfg}
    out.setdefault("n_kv_heads", out.get("n_heads"))
    out.setdefault("tie_embeddings", False)
    head_dim = cfg.get("head_dim")
    if head_dim is not None and head_dim * out["n_heads"] != out["dim"]:
        raise HfConfigError(f"head_dim={head_dim} × num_attention_heads={out['n_heads']} != "
                            f"hidden_size={out['dim']}: trainmesh needs head_dim = hidden/heads")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    out["rope_theta"] = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "llama3":
        missing = [k for k in _SCALING_KEYS if k not in rope]
        if missing:
            raise HfConfigError(f"llama3 RoPE scaling without {', '.join(missing)}")
        out["rope_scaling"] = {"type": "llama3", **{k: rope[k] for k in _SCALING_KEYS}}
    elif kind == "default":
        out["rope_scaling"] = None
    else:
        raise HfConfigError(f"rope_type {kind!r}: only default and llama3 RoPE are supported")
    return out


def config_json(model: dict[str, Any], eos_token_id: int | None = None,
                bos_token_id: int | None = None, dtype: str = "float32") -> dict[str, Any]:
    """A transformers ``LlamaConfig`` (as config.json) for the spec's model fields."""
    cfg: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                           **{k: model[f] for f, k in _FIELDS.items()},
                           "head_dim": model["dim"] // model["n_heads"], "hidden_act": "silu",
                           "attention_bias": False, "mlp_bias": False, "rope_theta": model["rope_theta"],
                           "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
                           "dtype": dtype, "torch_dtype": dtype}  # the latter: transformers < 4.56
    s = model.get("rope_scaling")
    cfg["rope_scaling"] = {"rope_type": "llama3", **{k: s[k] for k in _SCALING_KEYS}} if s else None
    return cfg


def hf_name(name: str) -> str:
    """The Hugging Face name of a trainmesh parameter."""
    for ours, theirs in _NAMES:
        if name == ours:
            return theirs
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    raise KeyError(f"no Hugging Face name for parameter {name!r}")


def rope_permuted(name: str) -> bool:
    """Whether a parameter's rows are in a different RoPE layout in the two formats."""
    return name.endswith(("attention.wq.weight", "attention.wk.weight"))


def hf_row(row: int, head_dim: int) -> int:
    """The Hugging Face row of trainmesh row ``row`` of ``wq``/``wk``."""
    head, m = divmod(row, head_dim)
    return head * head_dim + (m % 2) * (head_dim // 2) + m // 2
