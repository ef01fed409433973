"""Model shapes by name. Plain dicts so the job spec can import them without torch."""

# Llama 3.1 / 3.2's RoPE: base 500,000 and the "llama3" long-context scaling.
_LLAMA31_ROPE = dict(rope_theta=500000.0, rope_scaling=dict(
    type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=8192))
_LLAMA32_ROPE = dict(rope_theta=500000.0, rope_scaling={**_LLAMA31_ROPE["rope_scaling"], "factor": 32.0})

# DeepSeek-V2/V3's YaRN RoPE (4K pre-training context stretched 40×) and V3's latent attention.
_DSV2_ROPE = dict(rope_theta=10000.0, rope_scaling=dict(
    type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
    mscale=0.707, mscale_all_dim=0.707))
_DSV3_ROPE = dict(rope_theta=10000.0, rope_scaling={**_DSV2_ROPE["rope_scaling"], "mscale": 1.0,
                                                     "mscale_all_dim": 1.0})
_DSV3_MLA = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                 v_head_dim=128)

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
    # DeepSeek-V3's architecture, small enough for tests and the CPU demo: Multi-head Latent
    # Attention, one dense block then MoE blocks of 8 experts in 4 groups (a token's 2 from its
    # best 2 groups) with a sigmoid router, aux-loss-free balancing and a shared expert.
    # Exports to DeepseekV3ForCausalLM.
    "tiny-dsv3": dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=176, vocab_size=264,
                      max_seq_len=256,
                      mla=dict(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                               qk_rope_head_dim=8, v_head_dim=16),
                      moe=dict(experts=8, top_k=2, expert_ffn_dim=32, shared_experts=1,
                               router="sigmoid", balance="bias", dense_layers=1, n_group=4,
                               topk_group=2, routed_scaling_factor=2.5)),
    # DeepSeek-V2-Lite (16B, 2.4B active): a full query projection, softmax routing.
    "deepseek-v2-lite": dict(dim=2048, n_layers=27, n_heads=16, n_kv_heads=16, ffn_dim=10944,
                             vocab_size=102400, max_seq_len=163840, norm_eps=1e-6, **_DSV2_ROPE,
                             mla=dict(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                                      qk_rope_head_dim=64, v_head_dim=128),
                             moe=dict(experts=64, top_k=6, expert_ffn_dim=1408, shared_experts=2,
                                      normalize_top_k=False, dense_layers=1, aux_loss_coef=0.001)),
    # DeepSeek-V3 (671B, 37B active; R1 and V3.1 share it).
    "deepseek-v3-671b": dict(dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, ffn_dim=18432,
                             vocab_size=129280, max_seq_len=163840, norm_eps=1e-6, **_DSV3_ROPE,
                             mla=_DSV3_MLA,
                             moe=dict(experts=256, top_k=8, expert_ffn_dim=2048, shared_experts=1,
                                      router="sigmoid", balance="bias", dense_layers=3, n_group=8,
                                      topk_group=4, routed_scaling_factor=2.5)),
    # Kimi K2 (1T, 32B active): DeepSeek-V3's architecture, 384 experts, 64 heads.
    "kimi-k2": dict(dim=7168, n_layers=61, n_heads=64, n_kv_heads=64, ffn_dim=18432,
                    vocab_size=163840, max_seq_len=131072, norm_eps=1e-6, rope_theta=50000.0,
                    rope_scaling=dict(type="yarn", factor=32.0, original_max_position_embeddings=4096,
                                      beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
                    mla=_DSV3_MLA,
                    moe=dict(experts=384, top_k=8, expert_ffn_dim=2048, shared_experts=1,
                             router="sigmoid", balance="bias", dense_layers=1,
                             routed_scaling_factor=2.827)),
}
