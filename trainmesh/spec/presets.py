"""Model shapes by name. Plain dicts so the job spec can import them without torch."""

# Llama 3.1 / 3.2's RoPE: base 500,000 and the "llama3" long-context scaling.
_LLAMA31_ROPE = dict(rope_theta=500000.0, rope_scaling=dict(
    type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=8192))
_LLAMA32_ROPE = dict(rope_theta=500000.0, rope_scaling={**_LLAMA31_ROPE["rope_scaling"], "factor": 32.0})

PRESETS: dict[str, dict[str, object]] = {
    # Tests and the CPU demo: ~0.2M parameters, byte-level vocabulary (256 bytes + EOS, padded).
    "tiny": dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=176, vocab_size=264,
                 max_seq_len=256),
    # A few-minute CPU/GPU smoke model: ~6M parameters.
    "small": dict(dim=256, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=704, vocab_size=264,
                  max_seq_len=1024),
    # Llama-3.2-1B-like shape and RoPE.
    "1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
               vocab_size=128256, max_seq_len=8192, tie_embeddings=True, **_LLAMA32_ROPE),
    # Llama-3.1-8B-like shape and RoPE.
    "8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
               vocab_size=128256, max_seq_len=8192, **_LLAMA31_ROPE),
    # Llama-3.1-70B-like shape and RoPE.
    "70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                vocab_size=128256, max_seq_len=8192, **_LLAMA31_ROPE),
    # Llama-3.1-405B-like shape and RoPE (126 blocks: pipeline degrees must divide them, so a
    # 16-stage plan of Meta's needs model.n_layers=128 here; stages are even).
    "405b": dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248,
                 vocab_size=128256, max_seq_len=8192, **_LLAMA31_ROPE),
    # Mixture of Experts. Tests and the CPU demo: 8 experts (ep 2, 4 and 8 divide them),
    # top-2 softmax routing, no shared expert or dense block: Mixtral's layout, so it exports
    # to MixtralForCausalLM.
    "tiny-moe": dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=176, vocab_size=264,
                     max_seq_len=256, moe=dict(experts=8, top_k=2, expert_ffn_dim=64)),
    # Mixtral 8x7B.
    "mixtral-8x7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                         vocab_size=32000, max_seq_len=32768, rope_theta=1e6,
                         moe=dict(experts=8, top_k=2, expert_ffn_dim=14336, aux_loss_coef=0.02)),
    # Mixtral 8x22B.
    "mixtral-8x22b": dict(dim=6144, n_layers=56, n_heads=48, n_kv_heads=8, ffn_dim=16384,
                          vocab_size=32768, max_seq_len=65536, rope_theta=1e6,
                          moe=dict(experts=8, top_k=2, expert_ffn_dim=16384, aux_loss_coef=0.001)),
    # Qwen3-30B-A3B: 128-wide heads beside a 2048 hidden size, per-head q/k norms.
    "qwen3-30b-a3b": dict(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
                          qk_norm=True, ffn_dim=6144, vocab_size=151936, max_seq_len=40960,
                          rope_theta=1e6, moe=dict(experts=128, top_k=8, expert_ffn_dim=768,
                                                   aux_loss_coef=0.001)),
    # Qwen3-235B-A22B.
    "qwen3-235b-a22b": dict(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim=128,
                            qk_norm=True, ffn_dim=12288, vocab_size=151936, max_seq_len=40960,
                            rope_theta=1e6, moe=dict(experts=128, top_k=8, expert_ffn_dim=1536,
                                                     aux_loss_coef=0.001)),
}
