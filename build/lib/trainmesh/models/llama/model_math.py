"""Parameter and FLOP counts from a model's shape alone (no torch: the planner uses them).

``shape`` is anything with the Llama shape fields: a ``ModelConfig`` or a ``LlamaArgs``.
"""

from __future__ import annotations


def layer_params(shape) -> int:
    """Parameters of one transformer block: attention, SwiGLU MLP, two norms."""
    d = shape.dim
    kv = shape.n_kv_heads * (shape.dim // shape.n_heads)
    return 2 * d * d + 2 * d * kv + 3 * d * shape.ffn_dim + 2 * d


def num_params(shape, include_embedding: bool = True) -> int:
    """Exact parameter count of ``trainmesh.models.llama.model.Llama``."""
    d = shape.dim
    per_layer = layer_params(shape)
    emb = shape.vocab_size * d
    head = 0 if shape.tie_embeddings else emb
    total = shape.n_layers * per_layer + d + head + emb
    return total if include_embedding else total - emb


def flops_per_token(shape, seq_len: int) -> float:
    """Training FLOPs per token: 6 × (matmul parameters, the output head included) for forward
    and backward, plus 6 × 2 × n_layers × dim × seq_len for attention scores and values (no
    causal discount: the PaLM convention used for MFU)."""
    matmul_params = num_params(shape, include_embedding=False)
    if shape.tie_embeddings:
        matmul_params += shape.vocab_size * shape.dim  # the tied head is still a matmul
    return 6.0 * matmul_params + 12.0 * shape.n_layers * shape.dim * seq_len
