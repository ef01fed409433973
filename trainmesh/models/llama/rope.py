"""RoPE's tables: the rotation frequencies of a head's pairs of dimensions, plain or with a
long-context scaling (Llama 3.1's "llama3", YaRN), and the attention's softmax scale YaRN
changes. No module of the model here: ``model.py`` and ``mla.py`` both read them."""

from __future__ import annotations

import math

import torch


def rope_tables(head_dim: int, max_seq_len: int, theta: float,
                scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (max_seq_len, head_dim // 2); ``scaling``: Llama 3.1's "llama3" or
    YaRN's long-context frequencies (YaRN's tables scaled by its attention factor; the kernels
    take these tables as they are)."""
    inv_freq = rope_frequencies(head_dim, theta, scaling)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    factor = 1.0
    if scaling is not None and scaling.get("type") == "yarn":
        f, m, m_all = scaling["factor"], scaling.get("mscale", 1.0), scaling.get("mscale_all_dim", 0.0)
        # YaRN's table scale: the ratio of the two mscales where both are given (DeepSeek's),
        # else its own 0.1·ln(factor) + 1 (as transformers and the YaRN paper have it)
        factor = yarn_mscale(f, m) / yarn_mscale(f, m_all) if m and m_all else yarn_mscale(f, 1.0)
    return (angles.cos() * factor).float(), (angles.sin() * factor).float()


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """The rotation frequency of each pair of dimensions (float64)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None:
        return inv_freq
    if scaling.get("type", "llama3") == "yarn":
        return _yarn_frequencies(inv_freq, head_dim, theta, scaling)
    return _llama3_frequencies(inv_freq, scaling)


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's magnitude correction for a context stretched ``factor`` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(qk_head_dim: int, scaling: dict | None) -> float:
    """The attention logits' scale: 1/√(query head size), × YaRN's mscale(mscale_all_dim)²."""
    scale = qk_head_dim ** -0.5
    if scaling is not None and scaling.get("type") == "yarn" and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return scale


def _yarn_frequencies(inv_freq: torch.Tensor, head_dim: int, theta: float, s: dict) -> torch.Tensor:
    """YaRN: a pair that turns fewer than ``beta_slow`` times over the original context has its
    frequency divided by ``factor``, one that turns more than ``beta_fast`` times keeps it,
    and the pairs between (bounds rounded outwards) ramp linearly from one to the other."""
    context = s["original_max_position_embeddings"]

    def pair_of(turns: float) -> float:  # the (fractional) pair index turning ``turns`` times
        return head_dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(pair_of(s.get("beta_fast", 32.0))), 0)
    high = min(math.ceil(pair_of(s.get("beta_slow", 1.0))), head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low)
            / max(high - low, 1e-3)).clamp(0.0, 1.0)
    return inv_freq / s["factor"] * ramp + inv_freq * (1 - ramp)


def _llama3_frequencies(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1's RoPE scaling: a wavelength longer than original context / low_freq_factor
    is divided by ``factor``; shorter than original context / high_freq_factor, kept; between
    the two, blended linearly in (original context / wavelength)."""
    context, factor = s["original_max_position_embeddings"], s["factor"]
    low, high = s["low_freq_factor"], s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    blend = ((context / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    scaled = (1 - blend) * inv_freq / factor + blend * inv_freq
    return torch.where(wavelen > context / low, inv_freq / factor,
                       torch.where(wavelen < context / high, inv_freq, scaled))
